// lane_sums16: the sums of 16 float vectors at once, by one fixed tree (AVX-512). Lane p of the
// result is ((g0 + g1) + (g2 + g3)) of v[p], where g_k = (a0 + a2) + (a1 + a3) over the four
// lanes a0..a3 of quarter k. The float matmul (per-pair dot products) and the attention scores
// use it, so its order is part of their arithmetic.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

namespace pyfast {

__attribute__((target("avx512f"))) inline __m512 lane_sums16(const __m512* v) {
  __m512 u[8], w[4];
  for (int q = 0; q < 8; ++q)
    u[q] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * q], v[2 * q + 1]), _mm512_unpackhi_ps(v[2 * q], v[2 * q + 1]));
  for (int t = 0; t < 4; ++t) {  // w[t], quarter k: the quarter-k sums of v[4t .. 4t+3]
    const __m512d a = _mm512_castps_pd(u[2 * t]), b = _mm512_castps_pd(u[2 * t + 1]);
    w[t] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace pyfast
#endif
