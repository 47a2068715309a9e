// Scalar (reference-mode) matmul kernels and activation quantizer. They define the exact
// per-pair arithmetic the SIMD kernels reproduce (see quant.h); std::fma is the correctly
// rounded fused multiply-add the SIMD paths use.
#include <cmath>
#include <cstring>

#include "cpu/quant/quant.h"

namespace pyfast {
namespace mm {

namespace {

// cvtps2dq semantics: round to nearest even; NaN / out of range -> INT32_MIN.
inline int32_t cvt_rne(float v) {
  if (!(std::fabs(v) < 2147483648.0f)) return INT32_MIN;
  return (int32_t)std::nearbyint(v);
}

inline float wconv(DType t, const uint8_t* row, int64_t k) {
  switch (t) {
    case DType::F32: { float v; std::memcpy(&v, row + k * 4, 4); return v; }
    case DType::F16: { uint16_t v; std::memcpy(&v, row + k * 2, 2); return fp16_to_fp32(v); }
    default:         { uint16_t v; std::memcpy(&v, row + k * 2, 2); return bf16_to_fp32(v); }
  }
}

}  // namespace

void quant_act_scalar(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK, q += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) {
      const float a = std::fabs(x[j]);
      amax = a > amax ? a : amax;
    }
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0, half = 0;
    for (int j = 0; j < QK; ++j) {
      int32_t v = cvt_rne(x[j] * id);
      v = v < -127 ? -127 : v > 127 ? 127 : v;
      q[j] = (int8_t)v;
      sum += v;
      if (j == QK / 2 - 1) half = sum;
    }
    d[b * 4] = db;
    s[b * 4] = sum;
    f[b * 4] = db * (float)sum;
    h[b * 4] = half;
  }
}

void qgemm_scalar(const QJob& j) {
  const int64_t nb = j.a.nb;
  const bool has_min = wtype_has_min(j.wt);
  // One weight row decoded at a time (codes, scales, mins), then used for every activation row.
  int32_t* codes = reinterpret_cast<int32_t*>(j.scratch);
  float* dw = j.scratch + nb * QK;
  float* mw = dw + nb;
  for (int64_t n = j.n0; n < j.n1; ++n) {
    const uint8_t* w = j.w + n * j.w_stride;
    for (int64_t b = 0; b < nb; ++b) wblock_decode(j.wt, w, b, codes + b * QK, dw + b, mw + b);
    for (int64_t m = j.m0; m < j.m1; ++m) {
      const int8_t* xq = j.a.q + m * j.a.K;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const int32_t* c = codes + b * QK;
        const int8_t* qx = xq + b * QK;
        int32_t isum = 0;
        for (int k = 0; k < QK; ++k) isum += c[k] * qx[k];
        const size_t mi = j.a.meta(m, b);
        acc = std::fma(j.a.d[mi] * dw[b], (float)isum, acc);
        if (has_min) acc = std::fma(mw[b], j.a.f[mi], acc);
      }
      reinterpret_cast<float*>(j.y.row(m))[n] = acc;
    }
  }
}

void fgemm_scalar(const FJob& j) {
  const int64_t K = j.K;
  for (int64_t m = j.m0; m < j.m1; ++m) {
    const float* x = reinterpret_cast<const float*>(j.x.row(m));
    float* y = reinterpret_cast<float*>(j.y.row(m));
    for (int64_t n = j.n0; n < j.n1; ++n) {
      const uint8_t* w = j.w + n * j.w_stride;
      float acc[16] = {0};
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        for (int l = 0; l < 16; ++l) {
          const int64_t k = k0 + l;
          const float xv = k < K ? x[k] : 0.0f;
          const float wv = k < K ? wconv(j.wt, w, k) : 0.0f;
          acc[l] = std::fma(xv, wv, acc[l]);
        }
      }
      float g[4];
      for (int c = 0; c < 4; ++c) g[c] = (acc[4 * c] + acc[4 * c + 2]) + (acc[4 * c + 1] + acc[4 * c + 3]);
      y[n] = (g[0] + g[1]) + (g[2] + g[3]);
    }
  }
}

}  // namespace mm
}  // namespace pyfast
