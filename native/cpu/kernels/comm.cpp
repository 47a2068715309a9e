// allreduce: the sum of a tensor over the ranks of a communicator (pyfast/comm.h). One thread
// (share 0) makes the call; a strided source is first gathered into the node's scratch.
#include <cstring>

#include "cpu/kernels/common.h"
#include "pyfast/comm.h"

namespace pyfast {

namespace {
bool is_packed_rows(const Shape& s) {
  int64_t want = 4;
  for (int d = s.ndim - 1; d >= 0; --d) {
    if (s.dims[d] != 1 && s.strides[d] != want) return false;
    want *= s.dims[d];
  }
  return true;
}
}  // namespace

size_t cpu_allreduce_work_size(const Node& dst, const Node* const* src, int nth) {
  (void)nth;
  return is_packed_rows(src[0]->shape) ? 0 : (size_t)dst.shape.numel() * 4;
}

void cpu_allreduce(const ComputeParams& p, Node& dst, const Node* const* src) {
  if (p.ith != 0) return;
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const int64_t n = dst.shape.numel();
  const float* send = reinterpret_cast<const float*>(a->data);
  if (!is_packed_rows(sa)) {
    float* tmp = reinterpret_cast<float*>(p.wdata);
    const int64_t nr = n_rows(sa), nc = sa.dims[sa.ndim - 1], is = inner_stride(sa);
    for (int64_t r = 0; r < nr; ++r) {
      const uint8_t* row = a->data + row_offset(sa, r);
      for (int64_t c = 0; c < nc; ++c) tmp[r * nc + c] = *reinterpret_cast<const float*>(row + c * is);
    }
    send = tmp;
  }
  const auto c = comm_get(dst.params.i[0]);
  if (dst.params.i[1]) c->reduce_sum_f32_root(send, reinterpret_cast<float*>(dst.data), n);
  else c->allreduce_sum_f32(send, reinterpret_cast<float*>(dst.data), n);
}

}  // namespace pyfast
