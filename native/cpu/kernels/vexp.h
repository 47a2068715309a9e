// exp(x) for float32 kernels, one definition in scalar, AVX2 and AVX-512 form that give the same
// bits: the softmax of the fused attention and the SiLU family call it per element, where libm's
// scalar expf used to dominate (one call per (query row, KV cell) and per FFN element).
//
// x = n ln2 + r with n = rint(x log2 e) and r by a two-constant Cody-Waite reduction (|r| <=
// ln2 / 2 + tiny); exp(r) by its Taylor polynomial to degree 7 in Horner form (truncation below
// 1e-8 relative), then scaled by 2^n as two power-of-two factors built from exponent bits (so
// results near overflow and in the subnormal range come out right). Every step is a single
// correctly rounded operation, so the three forms agree bit for bit. Error: within 1.5 ulp of
// exp (measured; tests/ops/test_exp.py); +inf past 88.72, +0 below -103.97, NaN gives NaN.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pyfast/cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pyfast {

namespace vexp_detail {
constexpr float kLo = -110.0f, kHi = 89.0f;  // inputs are clamped here (the results saturate)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kC2 = 1.0f / 2, kC3 = 1.0f / 6, kC4 = 1.0f / 24, kC5 = 1.0f / 120, kC6 = 1.0f / 720,
                kC7 = 1.0f / 5040;
}  // namespace vexp_detail

inline float exp_f32(float x) {
  using namespace vexp_detail;
  if (x != x) return x;
  const float xc = x > kHi ? kHi : x < kLo ? kLo : x;
  const float n = std::nearbyint(xc * kLog2e);
  float r = std::fma(n, -kLn2Hi, xc);
  r = std::fma(n, -kLn2Lo, r);
  float q = std::fma(kC7, r, kC6);
  q = std::fma(q, r, kC5);
  q = std::fma(q, r, kC4);
  q = std::fma(q, r, kC3);
  q = std::fma(q, r, kC2);
  const float p = std::fma(q, r * r, r) + 1.0f;
  const int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;  // n in [-159, 129]
  const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return (p * s1) * s2;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline __m256 exp_f32x8(__m256 x) {
  using namespace vexp_detail;
  const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kHi)), _mm256_set1_ps(kLo));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(kC7), r, _mm256_set1_ps(kC6));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC5));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC4));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC3));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kC2));
  const __m256 p = _mm256_add_ps(_mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN: itself
}

__attribute__((target("avx512f"))) inline __m512 exp_f32x16(__m512 x) {
  using namespace vexp_detail;
  const __m512 xc = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kHi)), _mm512_set1_ps(kLo));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(kC7), r, _mm512_set1_ps(kC6));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC5));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC4));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC3));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kC2));
  const __m512 p = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  const __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);  // NaN: itself
}
#endif

// exp_f32 over an array with the ISA's vector form (tests and small callers).
#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline int64_t exp_f32_array_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp_f32x16(_mm512_loadu_ps(x + i)));
  return i;
}
__attribute__((target("avx2,fma"))) inline int64_t exp_f32_array_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp_f32x8(_mm256_loadu_ps(x + i)));
  return i;
}
#endif
inline void exp_f32_array(const float* x, float* y, int64_t n, CpuIsa isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa == CpuIsa::avx512) i = exp_f32_array_avx512(x, y, n);
  else if (isa == CpuIsa::avx2) i = exp_f32_array_avx2(x, y, n);
#endif
  for (; i < n; ++i) y[i] = exp_f32(x[i]);
}

}  // namespace pyfast
