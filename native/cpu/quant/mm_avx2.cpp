// AVX2 (+FMA, F16C; AVX-VNNI when present) matmul kernels. Same structure as mm_avx512.cpp with
// 8 pairs per micro-kernel: RM activation rows x 8/RM weight rows, lane p = j * RM + i, one
// weight block per 128-bit lane ("dual" = two weight rows in one ymm register); two or more
// activation rows take the transposed path ("quantized, rows >= 2"), per half chunk of 8 rows.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <atomic>
#include <cstring>

#include "cpu/quant/mm_common.h"
#include "cpu/quant/quant.h"

#define PF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PF_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define PF_INLINE inline __attribute__((always_inline))

namespace pyfast {
namespace mm {

// ----------------------------------------------------------------------------- activations

PF_AVX2 void quant_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) {
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
    const __m256i hv = _mm256_add_epi32(iv[0], iv[1]);
    const __m256i sv = _mm256_add_epi32(hv, _mm256_add_epi32(iv[2], iv[3]));
    // lanes 0..3: sums of sv, lanes 4..7: sums of hv
    __m256i t = _mm256_hadd_epi32(sv, hv);
    t = _mm256_hadd_epi32(t, t);
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    d[b * 4] = db;
    s[b * 4] = sum;
    f[b * 4] = db * (float)sum;
    h[b * 4] = _mm_extract_epi32(s4, 1);
  }
}

namespace {

// ----------------------------------------------------------------------------- quantized

struct QCtx {
  const uint8_t* rows[16];
  const float* dwc;  // [nb][16] (+16 floats of padding)
  const float* mwc;
  const int32_t* slo;  // Q6_K sub-scales of each block's halves, [nb][16]
  const int32_t* shi;
  alignas(32) int32_t offs[16];  // byte offsets of the rows from rows[0] (gather)
  const uint8_t* pf;             // the chunk after next, prefetched (into L2) while this one runs
  int64_t pf_step;               // bytes of it to prefetch per block
  int64_t nb, K;
  int bs;
};

// 16 bytes at byte offset `off` of two rows, one per 128-bit lane.
PF_AVX2 PF_INLINE __m256i load2(const uint8_t* r0, const uint8_t* r1, int64_t off) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(r0 + off))),
                                 _mm_loadu_si128((const __m128i*)(r1 + off)), 1);
}

PF_AVX2 PF_INLINE __m256i srl8(__m256i v, int sh) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(sh)); }

// 0x10 in byte k of lane L where bit k of `bits` (the lane's 16 bytes) is set: lane L reads
// bytes (2 * hi, 2 * hi + 1) of the 32-bit value in its lane.
PF_AVX2 PF_INLINE __m256i bits_to_b4(__m256i v, int hi) {
  const __m256i ctrl = hi ? _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                          : _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                             0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i bm = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i sel = _mm256_and_si256(_mm256_shuffle_epi8(v, ctrl), bm);
  return _mm256_and_si256(_mm256_cmpeq_epi8(sel, bm), _mm256_set1_epi8(0x10));
}

// Two weight blocks (block b of rows r0, r1; one per 128-bit lane), low / high 16 elements. For
// Q8_0 without VNNI the values stay signed (sign trick); with VNNI they are biased to u8 (+128).
// All other types give unsigned codes. 32-block types only.
template <DType WT, bool VNNI>
PF_AVX2 PF_INLINE void load_dual(const uint8_t* r0, const uint8_t* r1, int64_t b, int bs, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (WT == DType::Q8_0) {
    lo = load2(r0, r1, b * bs + 2);
    hi = load2(r0, r1, b * bs + 18);
    if constexpr (VNNI) {
      const __m256i bias = _mm256_set1_epi8((char)0x80);
      lo = _mm256_xor_si256(lo, bias);
      hi = _mm256_xor_si256(hi, bias);
    }
  } else if constexpr (WT == DType::Q4_0 || WT == DType::Q4_1) {
    const __m256i a = load2(r0, r1, b * bs + (WT == DType::Q4_1 ? 4 : 2));
    lo = _mm256_and_si256(a, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
  } else if constexpr (WT == DType::Q5_0 || WT == DType::Q5_1) {
    constexpr int ho = WT == DType::Q5_1 ? 4 : 2;
    const __m256i a = load2(r0, r1, b * bs + ho + 4);
    int32_t h0, h1;
    std::memcpy(&h0, r0 + b * bs + ho, 4);
    std::memcpy(&h1, r1 + b * bs + ho, 4);
    const __m256i qh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32(h0)), _mm_set1_epi32(h1), 1);
    lo = _mm256_or_si256(_mm256_and_si256(a, m4), bits_to_b4(qh, 0));
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), bits_to_b4(qh, 1));
  } else {
    static_assert(!kIsK<WT>, "K-quants load two blocks at a time (load_dual_pair)");
  }
}

// K-quants: blocks b and b + 1 (b even) of two weight rows at once. Q4_K / Q5_K keep both in the
// same 32 bytes (low / high nibbles); Q6_K's two blocks share their high-bit bytes.
template <DType WT>
constexpr int kStep = kIsK<WT> ? 2 : 1;

template <DType WT>
PF_AVX2 PF_INLINE void load_dual_pair(const uint8_t* r0, const uint8_t* r1, int64_t b, __m256i* lo, __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const int j = (int)(b & 7);
  if constexpr (WT == DType::Q4_K || WT == DType::Q5_K) {
    constexpr int SB = kSuperBytes<WT>;
    const int64_t sb = (b >> 3) * SB;
    const int64_t qo = sb + (WT == DType::Q4_K ? 16 : 48) + 32 * (j >> 1);
    const __m256i a = load2(r0, r1, qo), c = load2(r0, r1, qo + 16);
    lo[0] = _mm256_and_si256(a, m4);
    hi[0] = _mm256_and_si256(c, m4);
    lo[1] = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    hi[1] = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
    if constexpr (WT == DType::Q5_K) {
      const __m256i qa = load2(r0, r1, sb + 16), qc = load2(r0, r1, sb + 32), b4 = _mm256_set1_epi8(0x10);
      for (int t = 0; t < 2; ++t) {
        const __m256i bit = _mm256_set1_epi8((char)(1 << (j + t)));
        lo[t] = _mm256_or_si256(lo[t], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qa, bit), bit), b4));
        hi[t] = _mm256_or_si256(hi[t], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qc, bit), bit), b4));
      }
    }
  } else {  // Q6_K
    const int64_t sb = (b >> 3) * 210;
    const int64_t qo = sb + 64 * (j >> 2), ho = sb + 128 + 32 * (j >> 2);
    const int s1 = 4 * ((j >> 1) & 1), s2 = 2 * (j & 3);
    const __m256i m2 = _mm256_set1_epi8(3);
    const __m256i ha = load2(r0, r1, ho), hc = load2(r0, r1, ho + 16);
    for (int t = 0; t < 2; ++t) {
      lo[t] = _mm256_or_si256(_mm256_and_si256(srl8(load2(r0, r1, qo + 32 * t), s1), m4),
                              _mm256_slli_epi16(_mm256_and_si256(srl8(ha, s2 + 2 * t), m2), 4));
      hi[t] = _mm256_or_si256(_mm256_and_si256(srl8(load2(r0, r1, qo + 32 * t + 16), s1), m4),
                              _mm256_slli_epi16(_mm256_and_si256(srl8(hc, s2 + 2 * t), m2), 4));
    }
  }
}

PF_AVXVNNI PF_INLINE __m256i dot_vnni(__m256i w, __m256i x) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
}
PF_AVXVNNI PF_INLINE __m256i dot2_vnni(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wlo, xlo), whi, xhi);
}

// u8 codes (<= 63) x s8: pair sums fit int16 (<= 2 * 63 * 127).
PF_AVX2 PF_INLINE __m256i dot_u(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

template <DType WT>
PF_AVX2 PF_INLINE __m256i dot2_u(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (WT == DType::Q8_0) {
    const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wlo, wlo), _mm256_sign_epi8(xlo, wlo)), ones);
    const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(whi, whi), _mm256_sign_epi8(xhi, whi)), ones);
    return _mm256_add_epi32(a, b);
  } else {  // codes <= 31: four products per int16 lane, |sum| <= 4 * 31 * 127
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wlo, xlo), _mm256_maddubs_epi16(whi, xhi)), ones);
  }
}

// lane 4L + q of the result = sum of the 4 int32 partials in 128-bit lane L of z[q].
PF_AVX2 PF_INLINE __m256i transpose_sum(const __m256i* z) {
  const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(z[0], z[1]), _mm256_unpackhi_epi32(z[0], z[1]));
  const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(z[2], z[3]), _mm256_unpackhi_epi32(z[2], z[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}

PF_AVX2 PF_INLINE __m256i lanes_i(const int32_t* v4, __m256i idx_i) {
  return _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_load_si128((const __m128i*)v4)), idx_i);
}

// Exact block sums of the 8 pairs with the offset corrections (quant.h). zl / zh: the dots of the
// low / high halves (Q6_K) or z = zl, both halves (other types).
template <DType WT, bool VNNI>
PF_AVX2 PF_INLINE __m256i block_sums(const QCtx& c, int64_t b, int jt, const __m256i* zl, const __m256i* zh, const int32_t* sx4,
                                     const int32_t* hx4, __m256i idx_i, __m256i idx_j) {
  if constexpr (WT == DType::Q6_K) {
    const __m256i sx = lanes_i(sx4, idx_i), hx = lanes_i(hx4, idx_i);
    const __m256i rl = _mm256_sub_epi32(transpose_sum(zl), _mm256_slli_epi32(hx, 5));
    const __m256i rh = _mm256_sub_epi32(transpose_sum(zh), _mm256_slli_epi32(_mm256_sub_epi32(sx, hx), 5));
    const __m256i sl = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(c.slo + b * 16 + jt)), idx_j);
    const __m256i sh = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(c.shi + b * 16 + jt)), idx_j);
    return _mm256_add_epi32(_mm256_mullo_epi32(sl, rl), _mm256_mullo_epi32(sh, rh));
  } else {
    (void)zh;
    (void)hx4;
    (void)jt;
    (void)idx_j;
    __m256i r = transpose_sum(zl);
    if constexpr (kOffsetShift<WT> > 0 || (WT == DType::Q8_0 && VNNI))
      r = _mm256_sub_epi32(r, _mm256_slli_epi32(lanes_i(sx4, idx_i), WT == DType::Q8_0 ? 7 : kOffsetShift<WT>));
    return r;
  }
}

// The 8 lanes' weight scale (and min): lane p -> weight row jt + p / RM. GATHER (one activation
// row, 32-block types: lane p = row jt + p) reads them from the blocks instead of c.dwc / c.mwc.
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
    mw = kHasMin<WT> ? _mm256_permutevar8x32_ps(_mm256_loadu_ps(c.mwc + b * 16 + jt), idx_j) : dw;
  }
}

template <DType WT>
PF_AVX2 PF_INLINE __m256 float_stage(__m256 acc, __m256i r, const float* dx4, const float* fx4, __m256 dw, __m256 mw,
                                     __m256i idx_i) {
  const __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(dx4)), idx_i);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, dw), _mm256_cvtepi32_ps(r), acc);
  if constexpr (kHasMin<WT>) {
    const __m256 fx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(fx4)), idx_i);
    acc = _mm256_fmadd_ps(mw, fx, acc);
  }
  return acc;
}

// 8 pairs: RM activation rows from m (same group of 4), weight rows jt .. jt + 8/RM. The body is
// shared by the plain AVX2 and the AVX-VNNI versions (a macro, since a function compiled for
// plain AVX2 cannot inline the VNNI intrinsic).
#define PF_QTILE_BODY(VNNI, DOT1, DOT2)                                                                 \
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
  const int32_t* mh = a.h + g0;                                                                         \
  __m256 acc = _mm256_setzero_ps();                                                                     \
  constexpr int STEP = kStep<WT>;                                                                       \
  for (int64_t b0 = 0; b0 < nb; b0 += STEP) {                                                           \
   __m256i wlos[STEP][ND], whis[STEP][ND];                                                              \
   for (int h = 0; h < ND; ++h) {                                                                       \
     if constexpr (STEP == 2) {                                                                         \
       __m256i lo2[2], hi2[2];                                                                          \
       load_dual_pair<WT>(wr[h * 2], wr[h * 2 + 1], b0, lo2, hi2);                                     \
       for (int t = 0; t < 2; ++t) {                                                                    \
         wlos[t][h] = lo2[t];                                                                           \
         whis[t][h] = hi2[t];                                                                           \
       }                                                                                                \
     } else {                                                                                           \
       load_dual<WT, VNNI>(wr[h * 2], wr[h * 2 + 1], b0, bs, wlos[0][h], whis[0][h]);                   \
     }                                                                                                  \
   }                                                                                                    \
   for (int st = 0; st < STEP; ++st) {                                                                  \
    const int64_t b = b0 + st;                                                                          \
    if (RM == 1)                                                                                        \
      for (int64_t o = 0; o < c.pf_step; o += 64)                                                       \
        _mm_prefetch((const char*)c.pf + b * c.pf_step + o, _MM_HINT_T1);                               \
    const __m256i* wlo = wlos[st];                                                                      \
    const __m256i* whi = whis[st];                                                                      \
    __m256i zl[4], zh[4];                                                                               \
    for (int i = 0; i < RM; ++i) {                                                                      \
      const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK)));      \
      const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK + 16))); \
      for (int h = 0; h < ND; ++h) {                                                                    \
        if constexpr (WT == DType::Q6_K) {                                                              \
          zl[h * RM + i] = DOT1(wlo[h], xlo);                                                           \
          zh[h * RM + i] = DOT1(whi[h], xhi);                                                           \
        } else {                                                                                        \
          zl[h * RM + i] = DOT2(wlo[h], whi[h], xlo, xhi);                                              \
        }                                                                                               \
      }                                                                                                 \
    }                                                                                                   \
    const __m256i r = block_sums<WT, VNNI>(c, b, jt, zl, zh, ms + b * 4, mh + b * 4, idx_i, idx_j);         \
    __m256 dwv, mwv;                                                                                    \
    weight_scales<WT, GATHER>(c, b, jt, idx_j, dwv, mwv);                                               \
    acc = float_stage<WT>(acc, r, md + b * 4, mf + b * 4, dwv, mwv, idx_i);                             \
   }                                                                                                    \
  }                                                                                                     \
  _mm256_storeu_ps(out, acc);

template <DType WT, int RM, bool GATHER = false>
PF_AVX2 void qtile(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  PF_QTILE_BODY(false, dot_u, dot2_u<WT>)
}
template <DType WT, int RM, bool GATHER = false>
PF_AVXVNNI void qtile_vnni(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  PF_QTILE_BODY(true, dot_vnni, dot2_vnni)
}
#undef PF_QTILE_BODY

// fill_ktables (mm_common.h) eight rows at a time: per super-block, gathers of the packed scale
// bytes and fp16 scales, unpacked with vector bit operations.
template <DType WT>
PF_AVX2 void fill_ktables_avx2(const QCtx& c, float* dw, float* mw, int32_t* slo, int32_t* shi) {
  constexpr int SB = kSuperBytes<WT>;
  const __m256i m16 = _mm256_set1_epi32(0xFFFF);
  for (int hlf = 0; hlf < 2; ++hlf) {
    const __m256i vo = _mm256_load_si256((const __m256i*)(c.offs + 8 * hlf));
    for (int64_t B = 0; B < c.nb / 8; ++B) {
      const int* base = (const int*)(c.rows[0] + B * SB);
      const int64_t t0 = B * 8 * 16 + 8 * hlf;  // table index of (block 8B, row 8 hlf)
      if constexpr (WT == DType::Q6_K) {
        const __m256i dg = _mm256_srli_epi32(_mm256_i32gather_epi32((const int*)((const uint8_t*)base + 206), vo, 1), 16);
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(
            _mm256_permute4x64_epi64(_mm256_packus_epi32(dg, dg), _MM_SHUFFLE(3, 1, 2, 0))));
        for (int k = 0; k < 4; ++k) {
          const __m256i g = _mm256_i32gather_epi32((const int*)((const uint8_t*)base + 192 + 4 * k), vo, 1);
          for (int t = 0; t < 2; ++t) {
            const int64_t i = t0 + (2 * k + t) * 16;
            _mm256_storeu_ps(dw + i, d);
            _mm256_storeu_si256((__m256i*)(slo + i), _mm256_srai_epi32(_mm256_slli_epi32(g, 24 - 16 * t), 24));
            _mm256_storeu_si256((__m256i*)(shi + i), _mm256_srai_epi32(_mm256_slli_epi32(g, 16 - 16 * t), 24));
          }
        }
      } else {
        const __m256i dd = _mm256_i32gather_epi32(base, vo, 1);
        const __m256i pk = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(_mm256_and_si256(dd, m16), _mm256_srli_epi32(dd, 16)), _MM_SHUFFLE(3, 1, 2, 0));
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
        const __m256 dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1));
        const __m256i a = _mm256_i32gather_epi32((const int*)((const uint8_t*)base + 4), vo, 1);   // scales[0..3]
        const __m256i b = _mm256_i32gather_epi32((const int*)((const uint8_t*)base + 8), vo, 1);   // scales[4..7]
        const __m256i e = _mm256_i32gather_epi32((const int*)((const uint8_t*)base + 12), vo, 1);  // scales[8..11]
        const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15), m2 = _mm256_set1_epi32(0x30);
        const __m256 neg = _mm256_set1_ps(-0.0f);  // exact negation, as -(dmin * m)
        for (int j = 0; j < 4; ++j) {
          const __m256i sc = _mm256_and_si256(_mm256_srli_epi32(a, 8 * j), m6);
          const __m256i mn = _mm256_and_si256(_mm256_srli_epi32(b, 8 * j), m6);
          const __m256i sc4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(e, 8 * j), m4),
                                              _mm256_and_si256(_mm256_srli_epi32(a, 8 * j + 2), m2));
          const __m256i mn4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(e, 8 * j + 4), m4),
                                              _mm256_and_si256(_mm256_srli_epi32(b, 8 * j + 2), m2));
          _mm256_storeu_ps(dw + t0 + j * 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
          _mm256_storeu_ps(mw + t0 + j * 16, _mm256_xor_ps(neg, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn))));
          _mm256_storeu_ps(dw + t0 + (j + 4) * 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc4)));
          _mm256_storeu_ps(mw + t0 + (j + 4) * 16, _mm256_xor_ps(neg, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn4))));
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------- quantized, rows >= 2
//
// As in mm_avx512.cpp: each weight block of the chunk is decoded once into a transposed form,
// here per half chunk (8 weight rows): eight vectors W[g] whose lane r holds the u8 codes of
// elements 4g .. 4g+3 of weight row r (Q8_0: biased by +128 with AVX-VNNI, signed without). Per
// activation row a block's 8 exact integer sums are eight vpdpbusd (or maddubs / madd) of W[g]
// with the broadcast dword g of the row's int8 block, then one float stage for the 8 pairs. The
// first pass decodes and computes up to kXtRows2 rows; with more rows it stores the decoded
// blocks in the scratch for the later passes.

constexpr int kXtRows2 = 3;  // activation rows per pass (16 ymm registers)

// Lane r (0..7) of t[g] = dword g of the 16 bytes at r[i] + off (row i of the half).
PF_AVX2 PF_INLINE void tr8(const uint8_t* const* r, int64_t off, __m256i* t) {
  const __m256i v0 = load2(r[0], r[4], off), v1 = load2(r[1], r[5], off);
  const __m256i v2 = load2(r[2], r[6], off), v3 = load2(r[3], r[7], off);
  const __m256i a0 = _mm256_unpacklo_epi32(v0, v1), a1 = _mm256_unpackhi_epi32(v0, v1);
  const __m256i a2 = _mm256_unpacklo_epi32(v2, v3), a3 = _mm256_unpackhi_epi32(v2, v3);
  t[0] = _mm256_unpacklo_epi64(a0, a2);
  t[1] = _mm256_unpackhi_epi64(a0, a2);
  t[2] = _mm256_unpacklo_epi64(a1, a3);
  t[3] = _mm256_unpackhi_epi64(a1, a3);
}

// Lane r = the 4 bytes at rows[8 h + r] + off.
PF_AVX2 PF_INLINE __m256i gat8(const QCtx& c, int h, int64_t off) {
  return _mm256_i32gather_epi32((const int*)(c.rows[0] + off), _mm256_load_si256((const __m256i*)(c.offs + 8 * h)), 1);
}

// Byte t of lane r = 0x10 where bit (4 * g + t) of the 32-bit value in lane r of qh is set.
PF_AVX2 PF_INLINE __m256i qh_bits8(__m256i qh, int g) {
  const __m256i ctrl = _mm256_add_epi8(_mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C),
                                       _mm256_set1_epi8((char)(g >> 1)));
  const __m256i rep = _mm256_shuffle_epi8(qh, ctrl);  // each dword: its own byte g / 2, 4 times
  const __m256i bit = _mm256_set1_epi32((g & 1) ? (int)0x80402010 : 0x08040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(0x10));
}

// Decodes STEP blocks from b0 for weight rows 8 h .. 8 h + 7 into w[st * 8 + g]; 32-block types
// also give the blocks' dw / mw.
template <DType WT, bool VNNI>
PF_AVX2 PF_INLINE void xt2_decode(const QCtx& c, __m256i* qhc, int h, int64_t b0, __m256i* w, __m256& dw, __m256& mw) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const uint8_t* const* r = c.rows + 8 * h;
  if constexpr (WT == DType::Q4_K || WT == DType::Q5_K) {
    constexpr int SB = kSuperBytes<WT>;
    const int64_t sb = (b0 >> 3) * SB;
    const int j = (int)(b0 & 7);
    const int64_t qo = sb + (WT == DType::Q4_K ? 16 : 48) + 32 * (j >> 1);
    __m256i t[8];
    tr8(r, qo, t);
    tr8(r, qo + 16, t + 4);
    for (int g = 0; g < 8; ++g) {
      w[g] = _mm256_and_si256(t[g], m4);
      w[8 + g] = _mm256_and_si256(_mm256_srli_epi16(t[g], 4), m4);
    }
    if constexpr (WT == DType::Q5_K) {  // bit j of qh[l] = bit 4 of element l of block j
      // The super-block's qh (shared by its 8 blocks) is transposed with its first pair.
      if (j == 0) {
        tr8(r, sb + 16, qhc);
        tr8(r, sb + 32, qhc + 4);
      }
      const __m256i b4 = _mm256_set1_epi8(0x10);
      for (int g = 0; g < 8; ++g) {
        const __m256i hv = _mm256_load_si256(qhc + g);
        for (int st = 0; st < 2; ++st) {
          const int jb = j + st;
          const __m256i v = jb <= 4 ? _mm256_slli_epi32(hv, 4 - jb) : _mm256_srli_epi32(hv, jb - 4);
          w[st * 8 + g] = _mm256_or_si256(w[st * 8 + g], _mm256_and_si256(v, b4));
        }
      }
    }
    (void)dw;
    (void)mw;
  } else if constexpr (WT == DType::Q6_K) {
    // Block jj (0..3) of half hh: low 4 bits in ql[64 hh + 32 (jj & 1) + i] >> 4 (jj >> 1), high
    // 2 bits in qh[32 hh + i] >> 2 jj (i = element in the block).
    const int64_t sb = (b0 >> 3) * 210;
    const int j = (int)(b0 & 7), hh = j >> 2, jj0 = j & 3;
    const int s1 = 4 * (jj0 >> 1);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    __m256i qh[8];
    tr8(r, sb + 128 + 32 * hh, qh);
    tr8(r, sb + 128 + 32 * hh + 16, qh + 4);
    for (int st = 0; st < 2; ++st) {
      __m256i ql[8];
      tr8(r, sb + 64 * hh + 32 * st, ql);
      tr8(r, sb + 64 * hh + 32 * st + 16, ql + 4);
      const int s2 = 2 * (jj0 + st);
      for (int g = 0; g < 8; ++g) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(ql[g], s1), m4);
        const __m256i hi = s2 <= 4 ? _mm256_slli_epi32(qh[g], 4 - s2) : _mm256_srli_epi32(qh[g], s2 - 4);
        w[st * 8 + g] = _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
      }
    }
    (void)dw;
    (void)mw;
  } else {
    const int64_t o = b0 * c.bs;
    if constexpr (WT == DType::Q8_0) {
      tr8(r, o + 2, w);
      tr8(r, o + 18, w + 4);
      if constexpr (VNNI)
        for (int g = 0; g < 8; ++g) w[g] = _mm256_xor_si256(w[g], _mm256_set1_epi8((char)0x80));
    } else {
      constexpr int qo = WT == DType::Q4_0 ? 2 : WT == DType::Q4_1 ? 4 : WT == DType::Q5_0 ? 6 : 8;
      __m256i t[4];
      tr8(r, o + qo, t);
      for (int g = 0; g < 4; ++g) {
        w[g] = _mm256_and_si256(t[g], m4);
        w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(t[g], 4), m4);
      }
      if constexpr (WT == DType::Q5_0 || WT == DType::Q5_1) {
        const __m256i qh = gat8(c, h, o + (WT == DType::Q5_1 ? 4 : 2));
        for (int g = 0; g < 8; ++g) w[g] = _mm256_or_si256(w[g], qh_bits8(qh, g));
      }
    }
    const __m256i g = gat8(c, h, o);
    const __m256i pk = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(g, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(g, 16)), _MM_SHUFFLE(3, 1, 2, 0));
    dw = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
    if constexpr (kHasMin<WT>) mw = _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1));
    else (void)mw;
  }
}

PF_AVX2 PF_INLINE __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The exact block sums of one activation row (x: its block) with the decoded block w: z (Q6_K:
// z = first half, zh = second half), each starting from its chain offset.
template <DType WT>
PF_AVXVNNI PF_INLINE void xdot_vnni(const __m256i* w, const int8_t* x, __m256i i0, __m256i i1, __m256i& z, __m256i& zh) {
  __m256i z0 = i0, z1 = i1;
  for (int g = 0; g < 4; ++g) {
    z0 = _mm256_dpbusd_avx_epi32(z0, w[g], bcast4(x + 4 * g));
    z1 = _mm256_dpbusd_avx_epi32(z1, w[g + 4], bcast4(x + 16 + 4 * g));
  }
  if constexpr (WT == DType::Q6_K) {
    z = z0;
    zh = z1;
  } else {
    z = _mm256_add_epi32(z0, z1);
    (void)zh;
  }
}

template <DType WT>
PF_AVX2 PF_INLINE void xdot_plain(const __m256i* w, const int8_t* x, __m256i i0, __m256i i1, __m256i& z, __m256i& zh) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (WT == DType::Q8_0) {  // signed codes: |w| * sign(x, w), pair sums fit int16
    __m256i acc = i0;
    for (int g = 0; g < 8; ++g) {
      const __m256i xv = bcast4(x + 4 * g);
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w[g], w[g]), _mm256_sign_epi8(xv, w[g])), ones));
    }
    z = acc;
    (void)i1;
    (void)zh;
  } else if constexpr (WT == DType::Q4_0 || WT == DType::Q4_1 || WT == DType::Q4_K) {
    // codes <= 15: all 16 products of an int16 lane fit (16 * 15 * 127 < 2^15)
    __m256i s = _mm256_maddubs_epi16(w[0], bcast4(x));
    for (int g = 1; g < 8; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], bcast4(x + 4 * g)));
    z = _mm256_add_epi32(i0, _mm256_madd_epi16(s, ones));
    (void)i1;
    (void)zh;
  } else if constexpr (WT == DType::Q6_K) {
    // codes <= 63: sums of two maddubs fit int16 (4 * 63 * 127 < 2^15)
    __m256i p[4];
    for (int q = 0; q < 4; ++q)
      p[q] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w[2 * q], bcast4(x + 8 * q)),
                                                _mm256_maddubs_epi16(w[2 * q + 1], bcast4(x + 8 * q + 4))),
                               ones);
    z = _mm256_add_epi32(_mm256_add_epi32(i0, p[0]), p[1]);
    zh = _mm256_add_epi32(_mm256_add_epi32(i1, p[2]), p[3]);
  } else {  // codes <= 31: four maddubs per int16 sum (8 * 31 * 127 < 2^15)
    __m256i s0 = _mm256_maddubs_epi16(w[0], bcast4(x)), s1 = _mm256_maddubs_epi16(w[4], bcast4(x + 16));
    for (int g = 1; g < 4; ++g) {
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[g], bcast4(x + 4 * g)));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[g + 4], bcast4(x + 16 + 4 * g)));
    }
    z = _mm256_add_epi32(i0, _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones)));
    (void)i1;
    (void)zh;
  }
}

// The chunk's decoded blocks in the scratch and per-row integer offsets (see qgemm_xt2).
struct XtBuf2 {
  __m256i* wt;         // [2][nb][8]
  float* dwt;          // [nb][16] block tables, row order
  float* mwt;
  const int32_t* slo;  // Q6_K sub-scales
  const int32_t* shi;
  const int32_t* o0;   // chain starts per (row, block) in ActQ meta order from row group m0 / 4
  const int32_t* o1;
  size_t obase;        // meta index of (m0 & ~3, block 0)
  __m256i* qhc;        // Q5_K: transposed qh of the current super-block
};

enum XtMode2 { kDecode2 = 0, kDecodeStore2 = 1, kLoad2 = 2 };

// RM activation rows from m, weight rows 8 h .. 8 h + 7 of the chunk: y[m + i][n0 + 8 h + r].
#define PF_XT2_BODY(VNNI, DOT)                                                                        \
  constexpr int STEP = kStep<WT>;                                                                     \
  constexpr bool kOff = (WT == DType::Q8_0 && VNNI) || kOffsetShift<WT> > 0 || WT == DType::Q6_K;     \
  const int64_t nb = c.nb;                                                                            \
  const int8_t* xq[RM];                                                                               \
  size_t mo[RM];                                                                                      \
  for (int i = 0; i < RM; ++i) {                                                                      \
    xq[i] = a.q + (m + i) * a.K;                                                                      \
    mo[i] = a.meta(m + i, 0);                                                                         \
  }                                                                                                   \
  __m256 acc[RM];                                                                                     \
  for (int i = 0; i < RM; ++i) acc[i] = _mm256_setzero_ps();                                          \
  __m256i* wt = xb.wt + h * nb * 8;                                                                   \
  for (int64_t b0 = 0; b0 < nb; b0 += STEP) {                                                         \
    __m256i w[STEP * 8];                                                                              \
    __m256 dw0, mw0;                                                                                  \
    if constexpr (MODE == kLoad2) {                                                                   \
      for (int k = 0; k < STEP * 8; ++k) w[k] = _mm256_load_si256(wt + b0 * 8 + k);                   \
    } else {                                                                                          \
      if (h == 0) /* the chunk after next, into L2 (rows are read interleaved) */                     \
        for (int64_t o = 0; o < STEP * c.pf_step; o += 64)                                            \
          _mm_prefetch((const char*)c.pf + b0 * c.pf_step + o, _MM_HINT_T1);                          \
      xt2_decode<WT, VNNI>(c, xb.qhc, h, b0, w, dw0, mw0);                                            \
      if constexpr (MODE == kDecodeStore2) {                                                          \
        for (int k = 0; k < STEP * 8; ++k) _mm256_store_si256(wt + b0 * 8 + k, w[k]);                 \
        if constexpr (!kIsK<WT>) {                                                                    \
          _mm256_store_ps(xb.dwt + b0 * 16 + 8 * h, dw0);                                             \
          if constexpr (kHasMin<WT>) _mm256_store_ps(xb.mwt + b0 * 16 + 8 * h, mw0);                  \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
    for (int st = 0; st < STEP; ++st) {                                                               \
      const int64_t b = b0 + st;                                                                      \
      const __m256i* wb = w + st * 8;                                                                 \
      __m256 dw, mw, sl, sh;                                                                          \
      if (kIsK<WT> || MODE == kLoad2) {                                                               \
        dw = _mm256_load_ps(xb.dwt + b * 16 + 8 * h);                                                 \
        if constexpr (kHasMin<WT>) mw = _mm256_load_ps(xb.mwt + b * 16 + 8 * h);                      \
      } else {                                                                                        \
        dw = dw0;                                                                                     \
        mw = mw0;                                                                                     \
      }                                                                                               \
      if constexpr (WT == DType::Q6_K) {                                                              \
        sl = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(xb.slo + b * 16 + 8 * h)));        \
        sh = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(xb.shi + b * 16 + 8 * h)));        \
      }                                                                                               \
      for (int i = 0; i < RM; ++i) {                                                                  \
        const size_t mi = mo[i] + (size_t)b * 4;                                                      \
        const __m256i i0 = kOff ? _mm256_set1_epi32(xb.o0[mi - xb.obase]) : _mm256_setzero_si256();   \
        const __m256i i1 = WT == DType::Q6_K ? _mm256_set1_epi32(xb.o1[mi - xb.obase]) : _mm256_setzero_si256(); \
        __m256i z, zh;                                                                                \
        DOT<WT>(wb, xq[i] + b * QK, i0, i1, z, zh);                                                   \
        const __m256 dxw = _mm256_mul_ps(_mm256_set1_ps(a.d[mi]), dw);                                \
        if constexpr (WT == DType::Q6_K) {                                                            \
          /* exact in float: |isum| < 2^24 and so is every partial product */                         \
          const __m256 rr = _mm256_fmadd_ps(sl, _mm256_cvtepi32_ps(z), _mm256_mul_ps(sh, _mm256_cvtepi32_ps(zh))); \
          acc[i] = _mm256_fmadd_ps(dxw, rr, acc[i]);                                                  \
        } else {                                                                                      \
          acc[i] = _mm256_fmadd_ps(dxw, _mm256_cvtepi32_ps(z), acc[i]);                               \
          if constexpr (kHasMin<WT>) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.f[mi]), acc[i]);   \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
  const int nj = nv - 8 * h < 8 ? nv - 8 * h : 8;                                                     \
  const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(nj), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); \
  for (int i = 0; i < RM; ++i)                                                                        \
    _mm256_maskstore_ps(reinterpret_cast<float*>(yv.row(m + i)) + n0 + 8 * h, mk, acc[i]);

template <DType WT, int RM, int MODE>
PF_AVX2 void xt2_pass(const QCtx& c, const XtBuf2& xb, const ActQ& a, int64_t m, int h, const RowView& yv, int64_t n0, int nv) {
  PF_XT2_BODY(false, xdot_plain)
}
template <DType WT, int RM, int MODE>
PF_AVXVNNI void xt2_pass_vnni(const QCtx& c, const XtBuf2& xb, const ActQ& a, int64_t m, int h, const RowView& yv, int64_t n0,
                              int nv) {
  PF_XT2_BODY(true, xdot_vnni)
}
#undef PF_XT2_BODY

template <DType WT, int MODE>
PF_AVX2 void xt2_rows(const QCtx& c, const XtBuf2& xb, const ActQ& a, int64_t m, int rm, int h, const RowView& yv, int64_t n0,
                      int nv, bool vnni) {
  switch (rm) {
#define PF_XT2_CASE(R)                                                        \
  case R:                                                                     \
    if constexpr (R <= kXtRows2) {                                            \
      if (vnni) xt2_pass_vnni<WT, R, MODE>(c, xb, a, m, h, yv, n0, nv);       \
      else xt2_pass<WT, R, MODE>(c, xb, a, m, h, yv, n0, nv);                 \
    }                                                                         \
    break;
    PF_XT2_CASE(1) PF_XT2_CASE(2) PF_XT2_CASE(3) PF_XT2_CASE(4)
#undef PF_XT2_CASE
    default: break;
  }
}

// Scratch: decoded blocks (2 * nb * 8 ymm), four [nb][16] tables (+16), the offset tables, the
// Q5_K qh cache.
template <DType WT>
PF_AVX2 void qgemm_xt2(const QJob& j, const QCtx& c, int nv, bool vnni) {
  const int64_t nb = c.nb;
  const ActQ& a = j.a;
  XtBuf2 xb;
  xb.wt = reinterpret_cast<__m256i*>(j.scratch);
  float* tabs = j.scratch + nb * 128;
  const int64_t tab = nb * 16 + 16;
  xb.dwt = tabs;
  xb.mwt = tabs + tab;
  int32_t* slo = reinterpret_cast<int32_t*>(tabs + 2 * tab);
  int32_t* shi = reinterpret_cast<int32_t*>(tabs + 3 * tab);
  xb.slo = slo;
  xb.shi = shi;
  if constexpr (kIsK<WT>) fill_ktables_avx2<WT>(c, xb.dwt, xb.mwt, slo, shi);
  // Integer offsets the dot chains start from, in ActQ's meta order (groups of 4 rows):
  // Q4_0 / Q5_0 / Q8_0 (AVX-VNNI, biased codes): -(offset * sx); Q6_K: -32 hx and -32 (sx - hx).
  const int64_t g0 = j.m0 >> 2, g1 = (j.m1 + 3) >> 2;
  xb.obase = (size_t)(g0 * nb) * 4;
  const int64_t n_meta = (g1 - g0) * nb * 4;  // a multiple of 4
  int32_t* o0 = reinterpret_cast<int32_t*>(tabs + 4 * tab);
  int32_t* o1 = o0 + ((n_meta + 15) & ~(int64_t)15);
  xb.o0 = o0;
  xb.o1 = o1;
  xb.qhc = reinterpret_cast<__m256i*>(((uintptr_t)(o1 + ((n_meta + 15) & ~(int64_t)15)) + 63) & ~(uintptr_t)63);
  const int32_t* sx = a.s + xb.obase;
  if constexpr (WT == DType::Q6_K) {
    const int32_t* hx = a.h + xb.obase;
    for (int64_t k = 0; k < n_meta; k += 4) {
      const __m128i s = _mm_loadu_si128((const __m128i*)(sx + k)), h = _mm_loadu_si128((const __m128i*)(hx + k));
      _mm_storeu_si128((__m128i*)(o0 + k), _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(h, 5)));
      _mm_storeu_si128((__m128i*)(o1 + k), _mm_slli_epi32(_mm_sub_epi32(h, s), 5));
    }
  } else if constexpr (WT == DType::Q8_0 || kOffsetShift<WT> > 0) {
    if (WT != DType::Q8_0 || vnni) {
      const int sh = WT == DType::Q8_0 ? 7 : kOffsetShift<WT>;
      for (int64_t k = 0; k < n_meta; k += 4) {
        const __m128i s = _mm_loadu_si128((const __m128i*)(sx + k));
        _mm_storeu_si128((__m128i*)(o0 + k), _mm_sub_epi32(_mm_setzero_si128(), _mm_sll_epi32(s, _mm_cvtsi32_si128(sh))));
      }
    }
  }
  const int64_t M = j.m1 - j.m0;
  for (int h = 0; h < 2 && 8 * h < nv; ++h) {
    if (M <= kXtRows2) {
      xt2_rows<WT, kDecode2>(c, xb, a, j.m0, (int)M, h, j.y, j.n0, nv, vnni);
      continue;
    }
    if (vnni) xt2_pass_vnni<WT, kXtRows2, kDecodeStore2>(c, xb, a, j.m0, h, j.y, j.n0, nv);
    else xt2_pass<WT, kXtRows2, kDecodeStore2>(c, xb, a, j.m0, h, j.y, j.n0, nv);
    for (int64_t m = j.m0 + kXtRows2; m < j.m1; m += kXtRows2) {
      const int rm = j.m1 - m < kXtRows2 ? (int)(j.m1 - m) : kXtRows2;
      xt2_rows<WT, kLoad2>(c, xb, a, m, rm, h, j.y, j.n0, nv, vnni);
    }
  }
}

template <DType WT>
PF_AVX2 void qgemm_t(const QJob& j, bool vnni) {
  QCtx c;
  const int nv = (int)(j.n1 - j.n0);
  for (int r = 0; r < 16; ++r) c.rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  c.nb = j.a.nb;
  c.K = j.a.K;
  c.bs = wblock_bytes(WT);
  const int64_t tab = c.nb * 16 + 16;  // one [nb][16] table (+ padding)
  float* dwc = j.scratch;
  float* mwc = j.scratch + tab;
  int32_t* slo = reinterpret_cast<int32_t*>(j.scratch + 2 * tab);
  int32_t* shi = reinterpret_cast<int32_t*>(j.scratch + 3 * tab);
  c.dwc = dwc;
  c.mwc = mwc;
  c.slo = slo;
  c.shi = shi;
  c.pf = j.w + (j.n0 + 32) * j.w_stride;
  // The chunk after next is prefetched at the pace this one is read, whatever the row length: the
  // 16 rows are 16 streams the hardware prefetchers do not keep up with. Rows over 2 KiB, 14336 x
  // 4096, bench_matmul --cold, Zen 5, 1 / 2 threads: avx512 Q4_0 1.6x / 1.1x, Q8_0 1.4x / 1.15x,
  // Q4_K and Q5_K 2.9-3.0x / 2.3-2.4x; avx2 Q4_0 1.3x, Q4_K 4.0x / 3.7x, Q6_K 2.9x / 2.7x.
  c.pf_step = ((16 * j.w_stride + c.nb - 1) / c.nb + 63) & ~(int64_t)63;
  const int64_t span = (int64_t)(c.rows[15] - c.rows[0]);
  const bool gather_ok = span <= INT32_MAX && span >= INT32_MIN;
  for (int r = 0; r < 16; ++r) c.offs[r] = gather_ok ? (int32_t)(c.rows[r] - c.rows[0]) : 0;
  // Two rows of Q5_K are cheaper in the tiles below (its transposed decode costs more).
  if (gather_ok && j.m1 - j.m0 >= (WT == DType::Q5_K ? 3 : 2)) {
    qgemm_xt2<WT>(j, c, nv, vnni);
    return;
  }
  // A single activation row reads the block scales inside the kernel (32-block types);
  // otherwise they are converted once per chunk into [b][row] tables.
  const bool single = !kIsK<WT> && j.m1 - j.m0 == 1 && gather_ok;
  if constexpr (kIsK<WT>) {
    if (gather_ok) fill_ktables_avx2<WT>(c, dwc, mwc, slo, shi);
    else fill_ktables<WT>(c.rows, c.nb, dwc, mwc, slo, shi);
  } else if (single) {
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
        if (kHasMin<WT>) _mm256_storeu_ps(mwc + b * 16 + hlf * 8, _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1)));
      }
    }
  } else {
    for (int64_t b = 0; b < c.nb; ++b)
      for (int r = 0; r < 16; ++r) {
        uint16_t v[2];
        std::memcpy(v, c.rows[r] + b * c.bs, 4);
        dwc[b * 16 + r] = fp16_to_fp32(v[0]);
        if (kHasMin<WT>) mwc[b * 16 + r] = fp16_to_fp32(v[1]);
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
        else if (single) qtile_vnni<WT, 1, !kIsK<WT>>(c, j.a, m, jt, out);
        else qtile_vnni<WT, 1>(c, j.a, m, jt, out);
      } else {
        if (RM == 4) qtile<WT, 4>(c, j.a, m, jt, out);
        else if (RM == 2) qtile<WT, 2>(c, j.a, m, jt, out);
        else if (single) qtile<WT, 1, !kIsK<WT>>(c, j.a, m, jt, out);
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
    case DType::Q5_0: qgemm_t<DType::Q5_0>(j, vnni); break;
    case DType::Q5_1: qgemm_t<DType::Q5_1>(j, vnni); break;
    case DType::Q4_K: qgemm_t<DType::Q4_K>(j, vnni); break;
    case DType::Q5_K: qgemm_t<DType::Q5_K>(j, vnni); break;
    case DType::Q6_K: qgemm_t<DType::Q6_K>(j, vnni); break;
    default: qgemm_scalar(j); break;
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
void quant_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) { quant_act_scalar(x, q, d, s, f, h, nb); }
void qgemm_avx2(const QJob& j) { qgemm_scalar(j); }
void avx2_use_vnni(bool) {}
bool avx2_uses_vnni() { return false; }
void fgemm_avx2(const FJob& j) { fgemm_scalar(j); }
}  // namespace mm
}  // namespace pyfast
#endif
