// A tensor as the graph and the kernels see it: type, shape (outermost first, numpy order),
// byte strides and a data pointer. Quantized types keep their innermost dimension contiguous
// (whole blocks); the outer strides are free, so views are first class.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "pyfast/dtype.h"

namespace pyfast {

constexpr int kMaxDims = 4;

struct Shape {
  int ndim = 0;
  std::array<int64_t, kMaxDims> dims{};      // numpy order
  std::array<int64_t, kMaxDims> strides{};   // bytes, numpy order

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
  int64_t operator[](int i) const { return dims[i < 0 ? i + ndim : i]; }
  std::string str() const;
};

// Contiguous strides for `dims` of type t (the innermost dim counts elements; for quantized
// types it must be a multiple of the block size).
Shape make_shape(DType t, const std::vector<int64_t>& dims);
bool is_contiguous(DType t, const Shape& s);
// Bytes spanned by a tensor of this shape (from the first to one past the last byte).
size_t span_bytes(DType t, const Shape& s);

}  // namespace pyfast
