// Rotary position embedding. NORMAL mode rotates adjacent pairs (2i, 2i+1) of each head,
// NEOX mode rotates (i, i + n_dims/2); dims past n_dims pass through.
// theta_i = pos * freq_scale * freq_base^(-2i / n_dims).
#include <cmath>

#include "cpu/kernels/common.h"

namespace pyfast {

void cpu_rope(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* x = src[0];
  const Node* pos = src[1];
  const Shape& sx = x->shape;
  const int64_t T = sx.dims[0], H = sx.dims[1], D = sx.dims[2];
  const int n_dims = dst.params.i[0];
  const int mode = dst.params.i[1];
  const float base = dst.params.f[0], fscale = dst.params.f[1];
  const int half = n_dims / 2;
  const int64_t es = sx.strides[2] / 4;
  float cs[512], sn[512];  // n_dims/2 <= 512 (head dims above 1024 are not supported)
  int64_t t0, t1;
  split_range(T, p.ith, p.nth, t0, t1);
  for (int64_t t = t0; t < t1; ++t) {
    const float pv = (float)*reinterpret_cast<const int32_t*>(pos->data + t * pos->shape.strides[0]);
    for (int i = 0; i < half && i < 512; ++i) {
      const double theta = (double)pv * fscale * std::pow((double)base, -2.0 * i / n_dims);
      cs[i] = (float)std::cos(theta);
      sn[i] = (float)std::sin(theta);
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* in = reinterpret_cast<const float*>(x->data + t * sx.strides[0] + h * sx.strides[1]);
      float* out = reinterpret_cast<float*>(dst.data) + (t * H + h) * D;
      for (int i = 0; i < half; ++i) {
        const int64_t i0 = mode == ROPE_NEOX ? i : 2 * i;
        const int64_t i1 = mode == ROPE_NEOX ? i + half : 2 * i + 1;
        const float a = in[i0 * es], b = in[i1 * es];
        out[i0] = a * cs[i] - b * sn[i];
        out[i1] = a * sn[i] + b * cs[i];
      }
      for (int64_t i = n_dims; i < D; ++i) out[i] = in[i * es];
    }
  }
}

}  // namespace pyfast
