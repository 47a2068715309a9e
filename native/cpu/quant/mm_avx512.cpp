// AVX-512 (F/BW/VL/VNNI) matmul kernels. Compiled per function for the target; only called
// when the run-time ISA is avx512. The arithmetic per output element is the one quant.h fixes.
//
// Quantized weights: a micro-kernel computes 16 (activation row, weight row) pairs at once:
// RM activation rows x 16/RM weight rows (RM = 4, 2 or 1), lane p = j * RM + i. Per 32-block each
// pair's integer dot is formed in one 128-bit lane (4 int32 partials: vpdpbusd over the low and
// high 16 elements), four such lanes per register, and a 2-level transpose-add turns the four
// registers into one vector of 16 exact block sums. The float stage is then one FMA per block
// for all 16 pairs.
#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* temporaries.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/quant/quant.h"

#define PF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define PF_INLINE inline __attribute__((always_inline))

namespace pyfast {
namespace mm {

namespace {

// ----------------------------------------------------------------------------- activations

PF_AVX512 PF_INLINE __m512i clamp127(__m512i v) {
  return _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

}  // namespace

PF_AVX512 void quant_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK, q += QK) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i i0 = clamp127(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)));
    const __m512i i1 = clamp127(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(i1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    d[b * 4] = db;
    s[b * 4] = sum;
    f[b * 4] = db * (float)sum;
  }
}

namespace {

// ----------------------------------------------------------------------------- quantized

struct QCtx {
  const uint8_t* rows[16];  // weight rows of the chunk (clamped to the last valid one)
  const float* dwc;         // [nb][16] weight block scales (f32)
  const float* mwc;         // [nb][16] weight block mins (Q4_1)
  int64_t nb, K;
  int bs;                   // weight block bytes
  __m512i offs;             // byte offsets of the rows from rows[0] (when span fits int32)
  bool gather_ok;
  const uint8_t* pf;        // the chunk after next, prefetched (into L2) while this one runs
  int64_t pf_step;          // bytes of it to prefetch per block
};

// Weight quad: four weight blocks (one per 128-bit lane), low and high 16 elements, as u8.
template <DType WT>
PF_AVX512 PF_INLINE void load_quad(const uint8_t* r0, const uint8_t* r1, const uint8_t* r2,
                                   const uint8_t* r3, __m512i& lo, __m512i& hi) {
  if constexpr (WT == DType::Q8_0) {
    __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(r0 + 2)));
    a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r1 + 2)), 1);
    a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r2 + 2)), 2);
    a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r3 + 2)), 3);
    __m512i c = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(r0 + 18)));
    c = _mm512_inserti32x4(c, _mm_loadu_si128((const __m128i*)(r1 + 18)), 1);
    c = _mm512_inserti32x4(c, _mm_loadu_si128((const __m128i*)(r2 + 18)), 2);
    c = _mm512_inserti32x4(c, _mm_loadu_si128((const __m128i*)(r3 + 18)), 3);
    const __m512i bias = _mm512_set1_epi8((char)0x80);  // s8 -> u8 (+128)
    lo = _mm512_xor_si512(a, bias);
    hi = _mm512_xor_si512(c, bias);
  } else {
    constexpr int off = WT == DType::Q4_1 ? 4 : 2;
    __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(r0 + off)));
    a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r1 + off)), 1);
    a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r2 + off)), 2);
    a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r3 + off)), 3);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(a, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
  }
}

// 16 pairs: RM activation rows starting at m (same group of 4), weight rows jt .. jt + 16/RM.
// GATHER (RM = 1 only): read the 16 rows' block scales in the loop instead of from c.dwc / c.mwc
// (the same values; for a single activation row a separate pass over the weights costs more).
template <DType WT, int RM, bool GATHER = false>
PF_AVX512 void qtile(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  static_assert(!GATHER || RM == 1, "gather only for one activation row");
  constexpr int NQ = 4 / RM;  // weight quads
  const int64_t nb = c.nb, K = c.K;
  const int bs = c.bs;
  const int8_t* xq[RM];
  for (int i = 0; i < RM; ++i) xq[i] = a.q + (m + i) * K;
  const uint8_t* wr[4 * NQ];  // quad h, lane L -> weight row jt + L * NQ + h
  for (int h = 0; h < NQ; ++h)
    for (int L = 0; L < 4; ++L) wr[h * 4 + L] = c.rows[jt + L * NQ + h];
  const int ioff = (int)(m & 3);
  alignas(64) int32_t ii[16], jj[16];
  for (int p = 0; p < 16; ++p) {
    ii[p] = ioff + p % RM;
    jj[p] = jt + p / RM;
  }
  const __m512i idx_i = _mm512_load_si512(ii), idx_j = _mm512_load_si512(jj);
  const size_t g0 = (size_t)((m >> 2) * nb) * 4;
  const float* md = a.d + g0;
  const int32_t* ms = a.s + g0;
  const float* mf = a.f + g0;
  __m512 acc = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t wo = b * bs;
    if (RM == 1)
      for (int64_t o = 0; o < c.pf_step; o += 64) _mm_prefetch((const char*)c.pf + b * c.pf_step + o, _MM_HINT_T1);
    __m512i wlo[NQ], whi[NQ];
    for (int h = 0; h < NQ; ++h)
      load_quad<WT>(wr[h * 4 + 0] + wo, wr[h * 4 + 1] + wo, wr[h * 4 + 2] + wo, wr[h * 4 + 3] + wo,
                    wlo[h], whi[h]);
    __m512i z[4];
    for (int i = 0; i < RM; ++i) {
      const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK)));
      const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK + 16)));
      for (int h = 0; h < NQ; ++h)
        z[h * RM + i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, wlo[h], xlo), whi[h], xhi);
    }
    // lane 4L + q of r = sum of the 4 partials in 128-bit lane L of z[q].
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
    __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    if constexpr (WT != DType::Q4_1) {
      const __m512i sx = _mm512_permutexvar_epi32(idx_i, _mm512_castsi128_si512(_mm_load_si128((const __m128i*)(ms + b * 4))));
      r = _mm512_sub_epi32(r, _mm512_slli_epi32(sx, WT == DType::Q8_0 ? 7 : 3));
    }
    __m512 dw, mw;
    if constexpr (GATHER) {
      const __m512i g = _mm512_i32gather_epi32(c.offs, c.rows[0] + wo, 1);
      dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
      mw = WT == DType::Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))) : dw;
    } else {
      dw = _mm512_permutexvar_ps(idx_j, _mm512_load_ps(c.dwc + b * 16));
      mw = WT == DType::Q4_1 ? _mm512_permutexvar_ps(idx_j, _mm512_load_ps(c.mwc + b * 16)) : dw;
    }
    const __m512 dx = RM == 1 ? _mm512_set1_ps(md[b * 4 + ioff])
                              : _mm512_permutexvar_ps(idx_i, _mm512_castps128_ps512(_mm_load_ps(md + b * 4)));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(r), acc);
    if constexpr (WT == DType::Q4_1) {
      const __m512 fx = RM == 1 ? _mm512_set1_ps(mf[b * 4 + ioff])
                                : _mm512_permutexvar_ps(idx_i, _mm512_castps128_ps512(_mm_load_ps(mf + b * 4)));
      acc = _mm512_fmadd_ps(mw, fx, acc);
    }
  }
  _mm512_storeu_ps(out, acc);
}

template <DType WT>
PF_AVX512 void qgemm_t(const QJob& j) {
  QCtx c;
  const int nv = (int)(j.n1 - j.n0);
  for (int r = 0; r < 16; ++r) c.rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  c.nb = j.a.nb;
  c.K = j.a.K;
  c.bs = wblock_bytes(WT);
  float* dwc = j.scratch;
  float* mwc = j.scratch + c.nb * 16 + 16;
  c.dwc = dwc;
  c.mwc = mwc;
  c.pf = j.w + (j.n0 + 32) * j.w_stride;
  // Software prefetch only helps short rows (the hardware prefetchers follow long streams).
  c.pf_step = j.w_stride <= 2048 ? ((16 * j.w_stride + c.nb - 1) / c.nb + 63) & ~(int64_t)63 : 0;
  // Block scales of the 16 rows, [b][row] (one gather of the d (and m) fields per block); a
  // single activation row reads them inside the kernel instead.
  const int64_t span = (int64_t)(c.rows[15] - c.rows[0]);
  c.gather_ok = span <= INT32_MAX && span >= INT32_MIN;
  if (c.gather_ok) {
    alignas(64) int32_t off[16];
    for (int r = 0; r < 16; ++r) off[r] = (int32_t)(c.rows[r] - c.rows[0]);
    c.offs = _mm512_load_si512(off);
  }
  const bool single = j.m1 - j.m0 == 1 && c.gather_ok;
  if (single) {
    // nothing to precompute
  } else if (c.gather_ok) {
    for (int64_t b = 0; b < c.nb; ++b) {
      const __m512i g = _mm512_i32gather_epi32(c.offs, c.rows[0] + b * c.bs, 1);
      _mm512_store_ps(dwc + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
      if (WT == DType::Q4_1)
        _mm512_store_ps(mwc + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
    }
  } else {
    for (int64_t b = 0; b < c.nb; ++b)
      for (int r = 0; r < 16; ++r) {
        uint16_t v[2];
        std::memcpy(v, c.rows[r] + b * c.bs, 4);
        dwc[b * 16 + r] = fp16_to_fp32(v[0]);
        if (WT == DType::Q4_1) mwc[b * 16 + r] = fp16_to_fp32(v[1]);
      }
  }
  alignas(64) float out[16];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int64_t rem = j.m1 - m;
    const int RM = (rem >= 4 && (m & 3) == 0) ? 4 : (rem >= 2 && (m & 3) <= 2) ? 2 : 1;
    const int NW = 16 / RM;
    for (int jt = 0; jt < nv; jt += NW) {
      if (RM == 4) qtile<WT, 4>(c, j.a, m, jt, out);
      else if (RM == 2) qtile<WT, 2>(c, j.a, m, jt, out);
      else if (single) qtile<WT, 1, true>(c, j.a, m, jt, out);
      else qtile<WT, 1>(c, j.a, m, jt, out);
      for (int i = 0; i < RM; ++i) {
        float* y = reinterpret_cast<float*>(j.y.row(m + i)) + j.n0 + jt;
        const int nj = nv - jt < NW ? nv - jt : NW;
        for (int jj = 0; jj < nj; ++jj) y[jj] = out[jj * RM + i];
      }
    }
    m += RM;
  }
}

// ----------------------------------------------------------------------------- float weights

template <DType WT>
PF_AVX512 PF_INLINE __m512 loadw(const uint8_t* row, int64_t k) {
  if constexpr (WT == DType::F32) return _mm512_loadu_ps((const float*)row + k);
  else if constexpr (WT == DType::F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + k)));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + k))), 16));
}

template <DType WT>
PF_AVX512 PF_INLINE __m512 loadw_mask(const uint8_t* row, int64_t k, __mmask16 mk) {
  if constexpr (WT == DType::F32) return _mm512_maskz_loadu_ps(mk, (const float*)row + k);
  else if constexpr (WT == DType::F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t*)row + k));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t*)row + k)), 16));
}

// Sum of each of 16 vectors: lane p = ((g0 + g1) + (g2 + g3)) of v[p], g = (a0 + a2) + (a1 + a3).
PF_AVX512 PF_INLINE __m512 reduce16(const __m512* v) {
  __m512 u[8];
  for (int q = 0; q < 8; ++q)
    u[q] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * q], v[2 * q + 1]), _mm512_unpackhi_ps(v[2 * q], v[2 * q + 1]));
  __m512 w[4];
  for (int t = 0; t < 4; ++t) {
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

template <DType WT, int RM>
PF_AVX512 void ftile(const FJob& j, const uint8_t* const* rows, int64_t m, int jt, float* out) {
  constexpr int NW = 16 / RM;
  const int64_t K = j.K;
  const float* xr[RM];
  for (int i = 0; i < RM; ++i) xr[i] = reinterpret_cast<const float*>(j.x.row(m + i));
  const uint8_t* wr[NW];
  for (int jj = 0; jj < NW; ++jj) wr[jj] = rows[jt + jj];
  __m512 acc[16];
  for (int p = 0; p < 16; ++p) acc[p] = _mm512_setzero_ps();
  // One activation row: prefetch the chunk after next (into L2) while streaming this one.
  const uint8_t* pf = j.w + (j.n0 + 32) * j.w_stride;
  const int64_t pf_step = RM == 1 && K >= 16 && j.w_stride <= 2048 ? ((256 * j.w_stride / K) + 63) & ~(int64_t)63 : 0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (RM == 1)
      for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch((const char*)pf + (k >> 4) * pf_step + o, _MM_HINT_T1);
    __m512 xv[RM];
    for (int i = 0; i < RM; ++i) xv[i] = _mm512_loadu_ps(xr[i] + k);
    for (int jj = 0; jj < NW; ++jj) {
      const __m512 wv = loadw<WT>(wr[jj], k);
      for (int i = 0; i < RM; ++i) acc[jj * RM + i] = _mm512_fmadd_ps(xv[i], wv, acc[jj * RM + i]);
    }
  }
  if (k < K) {
    const __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
    __m512 xv[RM];
    for (int i = 0; i < RM; ++i) xv[i] = _mm512_maskz_loadu_ps(mk, xr[i] + k);
    for (int jj = 0; jj < NW; ++jj) {
      const __m512 wv = loadw_mask<WT>(wr[jj], k, mk);
      for (int i = 0; i < RM; ++i) acc[jj * RM + i] = _mm512_fmadd_ps(xv[i], wv, acc[jj * RM + i]);
    }
  }
  _mm512_storeu_ps(out, reduce16(acc));
}

template <DType WT>
PF_AVX512 void fgemm_t(const FJob& j) {
  const uint8_t* rows[16];
  const int nv = (int)(j.n1 - j.n0);
  for (int r = 0; r < 16; ++r) rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  alignas(64) float out[16];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int64_t rem = j.m1 - m;
    const int RM = rem >= 4 ? 4 : rem >= 2 ? 2 : 1;
    const int NW = 16 / RM;
    for (int jt = 0; jt < nv; jt += NW) {
      if (RM == 4) ftile<WT, 4>(j, rows, m, jt, out);
      else if (RM == 2) ftile<WT, 2>(j, rows, m, jt, out);
      else ftile<WT, 1>(j, rows, m, jt, out);
      for (int i = 0; i < RM; ++i) {
        float* y = reinterpret_cast<float*>(j.y.row(m + i)) + j.n0 + jt;
        const int nj = nv - jt < NW ? nv - jt : NW;
        for (int jj = 0; jj < nj; ++jj) y[jj] = out[jj * RM + i];
      }
    }
    m += RM;
  }
}

}  // namespace

void qgemm_avx512(const QJob& j) {
  switch (j.wt) {
    case DType::Q4_0: qgemm_t<DType::Q4_0>(j); break;
    case DType::Q4_1: qgemm_t<DType::Q4_1>(j); break;
    case DType::Q8_0: qgemm_t<DType::Q8_0>(j); break;
    default: break;
  }
}

void fgemm_avx512(const FJob& j) {
  switch (j.wt) {
    case DType::F32: fgemm_t<DType::F32>(j); break;
    case DType::F16: fgemm_t<DType::F16>(j); break;
    case DType::BF16: fgemm_t<DType::BF16>(j); break;
    default: break;
  }
}

}  // namespace mm
}  // namespace pyfast

#else  // not x86: the dispatcher never selects avx512
#include "cpu/quant/quant.h"
namespace pyfast {
namespace mm {
void quant_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb) { quant_act_scalar(x, q, d, s, f, nb); }
void qgemm_avx512(const QJob& j) { qgemm_scalar(j); }
void fgemm_avx512(const FJob& j) { fgemm_scalar(j); }
}  // namespace mm
}  // namespace pyfast
#endif
