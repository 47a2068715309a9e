#include "pyfast/tensor.h"

#include <sstream>
#include <stdexcept>

namespace pyfast {

std::string Shape::str() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

Shape make_shape(DType t, const std::vector<int64_t>& dims) {
  if (dims.empty() || dims.size() > (size_t)kMaxDims)
    throw std::invalid_argument("shape must have 1 to 4 dims, got " + std::to_string(dims.size()));
  Shape s;
  s.ndim = (int)dims.size();
  for (int i = 0; i < s.ndim; ++i) {
    if (dims[i] <= 0) throw std::invalid_argument("shape dims must be positive");
    s.dims[i] = dims[i];
  }
  const int64_t bs = dtype_block_size(t);
  if (s.dims[s.ndim - 1] % bs != 0)
    throw std::invalid_argument(std::string("innermost dim of a ") + dtype_name(t) +
                                " tensor must be a multiple of " + std::to_string(bs));
  int64_t stride = (int64_t)dtype_row_size(t, s.dims[s.ndim - 1]);
  s.strides[s.ndim - 1] = bs == 1 ? (int64_t)dtype_type_size(t) : 0;
  for (int i = s.ndim - 2; i >= 0; --i) {
    s.strides[i] = stride;
    stride *= s.dims[i];
  }
  if (bs > 1) s.strides[s.ndim - 1] = 0;  // meaningless for block types
  return s;
}

bool is_contiguous(DType t, const Shape& s) {
  if (s.ndim == 0) return true;
  const int64_t bs = dtype_block_size(t);
  if (bs == 1 && s.strides[s.ndim - 1] != (int64_t)dtype_type_size(t) && s.dims[s.ndim - 1] > 1)
    return false;
  int64_t expect = (int64_t)dtype_row_size(t, s.dims[s.ndim - 1]);
  for (int i = s.ndim - 2; i >= 0; --i) {
    if (s.dims[i] > 1 && s.strides[i] != expect) return false;
    expect *= s.dims[i];
  }
  return true;
}

size_t span_bytes(DType t, const Shape& s) {
  if (s.ndim == 0) return 0;
  int64_t last = (int64_t)dtype_row_size(t, s.dims[s.ndim - 1]);
  if (dtype_block_size(t) == 1) last = (s.dims[s.ndim - 1] - 1) * s.strides[s.ndim - 1] + (int64_t)dtype_type_size(t);
  int64_t span = last;
  for (int i = 0; i < s.ndim - 1; ++i) span += (s.dims[i] - 1) * s.strides[i];
  return (size_t)span;
}

}  // namespace pyfast
