// AVX2 (+FMA, F16C; AVX-VNNI when present) matmul kernels. Same structure as mm_avx512.cpp with
// 8 pairs per micro-kernel: RM activation rows x 8/RM weight rows, lane p = j * RM + i, one
// weight block per 128-bit lane ("dual" = two weight rows in one ymm register).
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <atomic>
#include <cstring>

#include "cpu/quant/quant.h"

#define PF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PF_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define PF_INLINE inline __attribute__((always_inline))

namespace pyfast {
namespace mm {

// ----------------------------------------------------------------------------- activations

PF_AVX2 void quant_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b, x += QK, q += QK) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i iv[4];
    for (int i = 0; i < 4; ++i)
      iv[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid)), hi), lo);
    const __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]);
    const __m256i p23 = _mm256_packs_epi32(iv[2], iv[3]);
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
    _mm256_storeu_si256((__m256i*)q, p);
    __m256i sv = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sv), _mm256_extracti128_si256(sv, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    d[b * 4] = db;
    s[b * 4] = sum;
    f[b * 4] = db * (float)sum;
  }
}

namespace {

// ----------------------------------------------------------------------------- quantized

struct QCtx {
  const uint8_t* rows[16];
  const float* dwc;  // [nb][16] (+16 floats of padding)
  const float* mwc;
  alignas(32) int32_t offs[16];  // byte offsets of the rows from rows[0] (gather)
  const uint8_t* pf;             // the chunk after next, prefetched (into L2) while this one runs
  int64_t pf_step;               // bytes of it to prefetch per block
  int64_t nb, K;
  int bs;
};

// Two weight blocks (one per 128-bit lane), low / high 16 elements. For Q8_0 without VNNI the
// values stay signed (sign trick); with VNNI they are biased to u8 (+128).
template <DType WT, bool VNNI>
PF_AVX2 PF_INLINE void load_dual(const uint8_t* r0, const uint8_t* r1, __m256i& lo, __m256i& hi) {
  if constexpr (WT == DType::Q8_0) {
    lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(r0 + 2))),
                                 _mm_loadu_si128((const __m128i*)(r1 + 2)), 1);
    hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(r0 + 18))),
                                 _mm_loadu_si128((const __m128i*)(r1 + 18)), 1);
    if constexpr (VNNI) {
      const __m256i bias = _mm256_set1_epi8((char)0x80);
      lo = _mm256_xor_si256(lo, bias);
      hi = _mm256_xor_si256(hi, bias);
    }
  } else {
    constexpr int off = WT == DType::Q4_1 ? 4 : 2;
    const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(r0 + off))),
                                              _mm_loadu_si128((const __m128i*)(r1 + off)), 1);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(a, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
  }
}

template <DType WT>
PF_AVXVNNI PF_INLINE __m256i dot_dual_vnni(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wlo, xlo), whi, xhi);
}

template <DType WT>
PF_AVX2 PF_INLINE __m256i dot_dual(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (WT == DType::Q8_0) {
    const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wlo, wlo), _mm256_sign_epi8(xlo, wlo)), ones);
    const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(whi, whi), _mm256_sign_epi8(xhi, whi)), ones);
    return _mm256_add_epi32(a, b);
  } else {  // u4 x s8: |pair sums| <= 2 * 15 * 127, two of them fit int16
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wlo, xlo), _mm256_maddubs_epi16(whi, xhi)), ones);
  }
}

// 8 pairs: RM activation rows from m (same group of 4), weight rows jt .. jt + 8/RM. The body is
// shared by the plain AVX2 and the AVX-VNNI versions (a macro, since a function compiled for
// plain AVX2 cannot inline the VNNI intrinsic).
#define PF_QTILE_BODY(VNNI, DOT)                                                                        \
  constexpr int ND = 4 / RM; /* weight duals */                                                         \
  const int64_t nb = c.nb, K = c.K;                                                                     \
  const int bs = c.bs;                                                                                  \
  const int8_t* xq[RM];                                                                                 \
  for (int i = 0; i < RM; ++i) xq[i] = a.q + (m + i) * K;                                               \
  const uint8_t* wr[2 * ND]; /* dual h, lane L -> weight row jt + L * ND + h */                         \
  for (int h = 0; h < ND; ++h)                                                                          \
    for (int L = 0; L < 2; ++L) wr[h * 2 + L] = c.rows[jt + L * ND + h];                                \
  const int ioff = (int)(m & 3);                                                                        \
  alignas(32) int32_t ii[8], jj[8];                                                                     \
  for (int p = 0; p < 8; ++p) {                                                                         \
    ii[p] = ioff + p % RM;                                                                              \
    jj[p] = p / RM;                                                                                     \
  }                                                                                                     \
  const __m256i idx_i = _mm256_load_si256((const __m256i*)ii);                                          \
  const __m256i idx_j = _mm256_load_si256((const __m256i*)jj);                                          \
  const size_t g0 = (size_t)((m >> 2) * nb) * 4;                                                        \
  const float* md = a.d + g0;                                                                           \
  const int32_t* ms = a.s + g0;                                                                         \
  const float* mf = a.f + g0;                                                                           \
  __m256 acc = _mm256_setzero_ps();                                                                     \
  for (int64_t b = 0; b < nb; ++b) {                                                                    \
    const int64_t wo = b * bs;                                                                          \
    if (RM == 1)                                                                                        \
      for (int64_t o = 0; o < c.pf_step; o += 64)                                                       \
        _mm_prefetch((const char*)c.pf + b * c.pf_step + o, _MM_HINT_T1);                               \
    __m256i wlo[ND], whi[ND];                                                                           \
    for (int h = 0; h < ND; ++h) load_dual<WT, VNNI>(wr[h * 2] + wo, wr[h * 2 + 1] + wo, wlo[h], whi[h]); \
    __m256i z[4];                                                                                       \
    for (int i = 0; i < RM; ++i) {                                                                      \
      const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK)));      \
      const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK + 16))); \
      for (int h = 0; h < ND; ++h) z[h * RM + i] = DOT(wlo[h], whi[h], xlo, xhi);                       \
    }                                                                                                   \
    const __m256i r = block_sums<WT, VNNI>(z, ms + b * 4, idx_i);                                       \
    __m256 dwv, mwv;                                                                                    \
    weight_scales<WT, GATHER>(c, b, jt, idx_j, dwv, mwv);                                               \
    acc = float_stage<WT>(acc, r, md + b * 4, mf + b * 4, dwv, mwv, idx_i);                             \
  }                                                                                                     \
  _mm256_storeu_ps(out, acc);

// Exact block sums of the 8 pairs (lane 4L + q = 128-bit lane L of z[q]), with the Q4_0 / biased
// Q8_0 correction.
template <DType WT, bool VNNI>
PF_AVX2 PF_INLINE __m256i block_sums(const __m256i* z, const int32_t* sx4, __m256i idx_i) {
  const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(z[0], z[1]), _mm256_unpackhi_epi32(z[0], z[1]));
  const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(z[2], z[3]), _mm256_unpackhi_epi32(z[2], z[3]));
  __m256i r = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
  if constexpr (WT == DType::Q4_0 || (WT == DType::Q8_0 && VNNI)) {
    const __m256i sx = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_load_si128((const __m128i*)sx4)), idx_i);
    r = _mm256_sub_epi32(r, _mm256_slli_epi32(sx, WT == DType::Q8_0 ? 7 : 3));
  }
  return r;
}

// The 8 lanes' weight scale (and Q4_1 min): lane p -> weight row jt + p / RM. GATHER (one
// activation row: lane p = row jt + p) reads them from the blocks instead of c.dwc / c.mwc.
template <DType WT, bool GATHER>
PF_AVX2 PF_INLINE void weight_scales(const QCtx& c, int64_t b, int jt, __m256i idx_j, __m256& dw, __m256& mw) {
  if constexpr (GATHER) {
    const __m256i g = _mm256_i32gather_epi32((const int*)(c.rows[0] + b * c.bs),
                                             _mm256_load_si256((const __m256i*)(c.offs + jt)), 1);
    const __m256i pk = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(g, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(g, 16)),
        _MM_SHUFFLE(3, 1, 2, 0));
    dw = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
    mw = _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1));
  } else {
    dw = _mm256_permutevar8x32_ps(_mm256_loadu_ps(c.dwc + b * 16 + jt), idx_j);
    mw = WT == DType::Q4_1 ? _mm256_permutevar8x32_ps(_mm256_loadu_ps(c.mwc + b * 16 + jt), idx_j) : dw;
  }
}

template <DType WT>
PF_AVX2 PF_INLINE __m256 float_stage(__m256 acc, __m256i r, const float* dx4, const float* fx4, __m256 dw, __m256 mw,
                                     __m256i idx_i) {
  const __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(dx4)), idx_i);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, dw), _mm256_cvtepi32_ps(r), acc);
  if constexpr (WT == DType::Q4_1) {
    const __m256 fx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(fx4)), idx_i);
    acc = _mm256_fmadd_ps(mw, fx, acc);
  }
  return acc;
}

template <DType WT, int RM, bool GATHER = false>
PF_AVX2 void qtile(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  PF_QTILE_BODY(false, dot_dual<WT>)
}
template <DType WT, int RM, bool GATHER = false>
PF_AVXVNNI void qtile_vnni(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  PF_QTILE_BODY(true, dot_dual_vnni<WT>)
}
#undef PF_QTILE_BODY

template <DType WT>
PF_AVX2 void qgemm_t(const QJob& j, bool vnni) {
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
  const int64_t span = (int64_t)(c.rows[15] - c.rows[0]);
  const bool gather_ok = span <= INT32_MAX && span >= INT32_MIN;
  for (int r = 0; r < 16; ++r) c.offs[r] = gather_ok ? (int32_t)(c.rows[r] - c.rows[0]) : 0;
  // A single activation row reads the block scales inside the kernel; otherwise they are
  // converted once per chunk into [b][row] tables.
  const bool single = j.m1 - j.m0 == 1 && gather_ok;
  if (single) {
    // nothing to precompute
  } else if (gather_ok) {
    const __m256i vo0 = _mm256_load_si256((const __m256i*)c.offs), vo1 = _mm256_load_si256((const __m256i*)(c.offs + 8));
    const __m256i m16 = _mm256_set1_epi32(0xFFFF);
    for (int64_t b = 0; b < c.nb; ++b) {
      const int* base = (const int*)(c.rows[0] + b * c.bs);
      for (int hlf = 0; hlf < 2; ++hlf) {
        const __m256i g = _mm256_i32gather_epi32(base, hlf ? vo1 : vo0, 1);
        // [d0..3, m0..3 | d4..7, m4..7] -> [d0..7 | m0..7]
        const __m256i pk = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(_mm256_and_si256(g, m16), _mm256_srli_epi32(g, 16)), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_ps(dwc + b * 16 + hlf * 8, _mm256_cvtph_ps(_mm256_castsi256_si128(pk)));
        if (WT == DType::Q4_1) _mm256_storeu_ps(mwc + b * 16 + hlf * 8, _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1)));
      }
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
  alignas(32) float out[8];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int64_t rem = j.m1 - m;
    const int RM = (rem >= 4 && (m & 3) == 0) ? 4 : (rem >= 2 && (m & 3) <= 2) ? 2 : 1;
    const int NW = 8 / RM;
    for (int jt = 0; jt < nv; jt += NW) {
      if (vnni) {
        if (RM == 4) qtile_vnni<WT, 4>(c, j.a, m, jt, out);
        else if (RM == 2) qtile_vnni<WT, 2>(c, j.a, m, jt, out);
        else if (single) qtile_vnni<WT, 1, true>(c, j.a, m, jt, out);
        else qtile_vnni<WT, 1>(c, j.a, m, jt, out);
      } else {
        if (RM == 4) qtile<WT, 4>(c, j.a, m, jt, out);
        else if (RM == 2) qtile<WT, 2>(c, j.a, m, jt, out);
        else if (single) qtile<WT, 1, true>(c, j.a, m, jt, out);
        else qtile<WT, 1>(c, j.a, m, jt, out);
      }
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
PF_AVX2 PF_INLINE __m256 loadw(const uint8_t* row, int64_t k) {
  if constexpr (WT == DType::F32) return _mm256_loadu_ps((const float*)row + k);
  else if constexpr (WT == DType::F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + k)));
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + k))), 16));
}

// Sum of each of 8 vectors: lane p = g0 + g1 of v[p], g = (a0 + a2) + (a1 + a3).
PF_AVX2 PF_INLINE __m256 reduce8(const __m256* v) {
  __m256 u[4];
  for (int q = 0; q < 4; ++q)
    u[q] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * q], v[2 * q + 1]), _mm256_unpackhi_ps(v[2 * q], v[2 * q + 1]));
  __m256 w[2];
  for (int t = 0; t < 2; ++t) {
    const __m256d a = _mm256_castps_pd(u[2 * t]), b = _mm256_castps_pd(u[2 * t + 1]);
    w[t] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
}

template <DType WT, int RM>
PF_AVX2 void ftile(const FJob& j, const uint8_t* const* rows, int64_t m, int jt, float* out) {
  constexpr int NW = 8 / RM;
  const int64_t K = j.K;
  const float* xr[RM];
  for (int i = 0; i < RM; ++i) xr[i] = reinterpret_cast<const float*>(j.x.row(m + i));
  const uint8_t* wr[NW];
  for (int jj = 0; jj < NW; ++jj) wr[jj] = rows[jt + jj];
  __m256 acc[8];
  for (int p = 0; p < 8; ++p) acc[p] = _mm256_setzero_ps();
  // One activation row, short weight rows: prefetch the chunk after next (into L2).
  const uint8_t* pf = j.w + (j.n0 + 32) * j.w_stride;
  const int64_t pf_step = RM == 1 && K >= 8 && j.w_stride <= 2048 ? ((128 * j.w_stride / K) + 63) & ~(int64_t)63 : 0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (RM == 1)
      for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch((const char*)pf + (k >> 3) * pf_step + o, _MM_HINT_T1);
    __m256 xv[RM];
    for (int i = 0; i < RM; ++i) xv[i] = _mm256_loadu_ps(xr[i] + k);
    for (int jj = 0; jj < NW; ++jj) {
      const __m256 wv = loadw<WT>(wr[jj], k);
      for (int i = 0; i < RM; ++i) acc[jj * RM + i] = _mm256_fmadd_ps(xv[i], wv, acc[jj * RM + i]);
    }
  }
  if (k < K) {  // zero-padded last step
    const int n = (int)(K - k);
    alignas(32) float xt[RM][8], wt[8];
    __m256 xv[RM];
    for (int i = 0; i < RM; ++i) {
      for (int l = 0; l < 8; ++l) xt[i][l] = l < n ? xr[i][k + l] : 0.0f;
      xv[i] = _mm256_load_ps(xt[i]);
    }
    for (int jj = 0; jj < NW; ++jj) {
      for (int l = 0; l < 8; ++l) {
        if (l >= n) { wt[l] = 0.0f; continue; }
        if (WT == DType::F32) std::memcpy(&wt[l], wr[jj] + (k + l) * 4, 4);
        else {
          uint16_t hv;
          std::memcpy(&hv, wr[jj] + (k + l) * 2, 2);
          wt[l] = WT == DType::F16 ? _cvtsh_ss(hv) : bf16_to_fp32(hv);
        }
      }
      const __m256 wv = _mm256_load_ps(wt);
      for (int i = 0; i < RM; ++i) acc[jj * RM + i] = _mm256_fmadd_ps(xv[i], wv, acc[jj * RM + i]);
    }
  }
  _mm256_storeu_ps(out, reduce8(acc));
}

template <DType WT>
PF_AVX2 void fgemm_t(const FJob& j) {
  const uint8_t* rows[16];
  const int nv = (int)(j.n1 - j.n0);
  for (int r = 0; r < 16; ++r) rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  alignas(32) float out[8];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int64_t rem = j.m1 - m;
    const int RM = rem >= 4 ? 4 : rem >= 2 ? 2 : 1;
    const int NW = 8 / RM;
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

namespace {
std::atomic<int> g_vnni{-1};  // -1: use the CPU's AVX-VNNI when present
}

void avx2_use_vnni(bool on) { g_vnni.store(on && cpu_features().avxvnni ? 1 : 0); }
bool avx2_uses_vnni() {
  const int v = g_vnni.load(std::memory_order_relaxed);
  return v < 0 ? cpu_features().avxvnni : v == 1;
}

void qgemm_avx2(const QJob& j) {
  const bool vnni = avx2_uses_vnni();
  switch (j.wt) {
    case DType::Q4_0: qgemm_t<DType::Q4_0>(j, vnni); break;
    case DType::Q4_1: qgemm_t<DType::Q4_1>(j, vnni); break;
    case DType::Q8_0: qgemm_t<DType::Q8_0>(j, vnni); break;
    default: break;
  }
}

void fgemm_avx2(const FJob& j) {
  switch (j.wt) {
    case DType::F32: fgemm_t<DType::F32>(j); break;
    case DType::F16: fgemm_t<DType::F16>(j); break;
    case DType::BF16: fgemm_t<DType::BF16>(j); break;
    default: break;
  }
}

}  // namespace mm
}  // namespace pyfast

#else
#include "cpu/quant/quant.h"
namespace pyfast {
namespace mm {
void quant_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb) { quant_act_scalar(x, q, d, s, f, nb); }
void qgemm_avx2(const QJob& j) { qgemm_scalar(j); }
void avx2_use_vnni(bool) {}
bool avx2_uses_vnni() { return false; }
void fgemm_avx2(const FJob& j) { fgemm_scalar(j); }
}  // namespace mm
}  // namespace pyfast
#endif
