// Row reductions: rms_norm, l2_norm and softmax. Each row is reduced in a fixed order (8 partial sums,
// then a fixed tree), so a row's result never depends on the batch or the thread split.
#include <stdexcept>
#include <cmath>
#include <limits>

#include "cpu/kernels/common.h"

namespace pyfast {

namespace {

// Sum of squares of n floats at stride `st` (elements) in a fixed 8-lane order.
inline float sum_sq(const float* x, int64_t n, int64_t st) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  if (st == 1) {
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += x[i + l] * x[i + l];
  }
  for (; i < n; ++i) acc[i & 7] += x[i * st] * x[i * st];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

}  // namespace

void cpu_rms_norm(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const float eps = dst.params.f[0];
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const int64_t st = inner_stride(sa) / 4;
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    const float mean = sum_sq(x, n, st) / (float)n;
    const float s = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = x[i * st] * s;
  }
}

void cpu_softmax(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Node* m = dst.n_src > 1 ? src[1] : nullptr;
  const Shape& sa = a->shape;
  const float scale = dst.params.f[0];
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const int64_t st = inner_stride(sa) / 4;
  const int64_t mst = m ? (m->shape.dims[m->shape.ndim - 1] == 1 ? 0 : inner_stride(m->shape) / 4) : 0;
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
    const float* mk = m ? reinterpret_cast<const float*>(m->data + bcast_row_offset(sa, m->shape, r)) : nullptr;
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i * st] * scale + (mk ? mk[i * mst] : 0.0f);
      o[i] = v;
      mx = v > mx ? v : mx;
    }
    if (mx == -std::numeric_limits<float>::infinity()) {  // fully masked row
      for (int64_t i = 0; i < n; ++i) o[i] = 0.0f;
      continue;
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; ++i) {
      o[i] = std::exp(o[i] - mx);
      acc[i & 7] += o[i];
    }
    const float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; ++i) o[i] *= inv;
  }
}

// l2_norm: x * 1/sqrt(sum(x^2) + eps) over the last dim (HF's x * rsqrt(sum(x^2) + eps)), with the
// same fixed-order sum of squares as rms_norm.
void cpu_l2_norm(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const float eps = dst.params.f[0];
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const int64_t st = inner_stride(sa) / 4;
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    const float s = 1.0f / std::sqrt(sum_sq(x, n, st) + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = x[i * st] * s;
  }
}

}  // namespace pyfast
