// AVX-512 (F/BW/VL/VNNI) matmul kernels. Compiled per function for the target; only called
// when the run-time ISA is avx512. The arithmetic per output element is the one quant.h fixes.
//
// Quantized weights: a micro-kernel computes 16 (activation row, weight row) pairs at once:
// RM activation rows x 16/RM weight rows (RM = 4, 2 or 1), lane p = j * RM + i. Per 32-block each
// pair's integer dot is formed in one 128-bit lane (4 int32 partials: vpdpbusd over the low and
// high 16 elements), four such lanes per register, and a 2-level transpose-add turns the four
// registers into one vector of 16 exact block sums. The float stage is then one FMA per block
// for all 16 pairs. That is the path for a single activation row (generation) and, as a fallback,
// for chunks whose rows are too far apart for 32-bit gather offsets. Two or more rows (prompt
// chunks, speculative-decoding verify batches) take the transposed path ("quantized, rows >= 2"
// below): the chunk's weight blocks are decoded once and shared by all rows, and a row costs
// eight vpdpbusd and a float stage per block and 16 weight rows.
#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* temporaries.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/kernels/lane_sums.h"
#include "cpu/quant/mm_common.h"
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

PF_AVX512 void quant_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) {
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
    const int32_t half = _mm512_reduce_add_epi32(i0);
    const int32_t sum = half + _mm512_reduce_add_epi32(i1);
    d[b * 4] = db;
    s[b * 4] = sum;
    f[b * 4] = db * (float)sum;
    h[b * 4] = half;
  }
}

namespace {

// ----------------------------------------------------------------------------- quantized

struct QCtx {
  const uint8_t* rows[16];  // weight rows of the chunk (clamped to the last valid one)
  const float* dwc;         // [nb][16] weight block scales (f32)
  const float* mwc;         // [nb][16] weight block mins (types with a min)
  const int32_t* slo;       // [nb][16] Q6_K sub-scales of each block's first / second half
  const int32_t* shi;
  int64_t nb, K;
  int bs;                   // weight block bytes (32-block types)
  __m512i offs;             // byte offsets of the rows from rows[0] (when span fits int32)
  __m256i offs_lo, offs_hi; // the same, rows 0..7 / 8..15
  __m512i* qh;              // Q5_K: the current super-block's qh, transposed (8 vectors, scratch)
  bool gather_ok;
  const uint8_t* pf;        // what is prefetched while this chunk runs (see qgemm_t)
  int64_t pf_step;          // bytes of it to prefetch per block
  const uint8_t* pk;        // packed weights (quant.h): the chunk
  int64_t rows_stride = 0;  // row-major: the bytes between rows when all 16 are distinct rows (else 0)
};

// 16 bytes at byte offset `off` of each of 4 rows, one row per 128-bit lane.
PF_AVX512 PF_INLINE __m512i load4(const uint8_t* const* r, int64_t off) {
  __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(r[0] + off)));
  a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r[1] + off)), 1);
  a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r[2] + off)), 2);
  return _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(r[3] + off)), 3);
}

PF_AVX512 PF_INLINE __m512i srl8(__m512i v, int sh) { return _mm512_srl_epi16(v, _mm_cvtsi32_si128(sh)); }

// Weight quad: block b of four weight rows (one per 128-bit lane), low and high 16 elements, as
// u8 codes (Q8_0: biased by +128). 32-block types only.
template <DType WT>
PF_AVX512 PF_INLINE void load_quad(const uint8_t* const* r, int64_t b, int bs, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (WT == DType::Q8_0) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);  // s8 -> u8 (+128)
    lo = _mm512_xor_si512(load4(r, b * bs + 2), bias);
    hi = _mm512_xor_si512(load4(r, b * bs + 18), bias);
  } else if constexpr (WT == DType::Q4_0 || WT == DType::Q4_1) {
    const __m512i a = load4(r, b * bs + (WT == DType::Q4_1 ? 4 : 2));
    lo = _mm512_and_si512(a, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
  } else if constexpr (WT == DType::Q5_0 || WT == DType::Q5_1) {
    constexpr int ho = WT == DType::Q5_1 ? 4 : 2;  // qh; qs follows it
    const __m512i a = load4(r, b * bs + ho + 4);
    uint64_t mlo = 0, mhi = 0;  // bit 4 of the codes: bit (16 L + k) = element k of row L's half
    for (int L = 0; L < 4; ++L) {
      uint32_t qh;
      std::memcpy(&qh, r[L] + b * bs + ho, 4);
      mlo |= (uint64_t)(qh & 0xFFFF) << (16 * L);
      mhi |= (uint64_t)(qh >> 16) << (16 * L);
    }
    const __m512i b4 = _mm512_set1_epi8(0x10);
    lo = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_maskz_mov_epi8(mlo, b4));
    hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_maskz_mov_epi8(mhi, b4));
  } else {
    static_assert(!kIsK<WT>, "K-quants load two blocks at a time (load_pair)");
  }
}

// K-quants: blocks b and b + 1 (b even) of four weight rows at once. Q4_K / Q5_K keep both in the
// same 32 bytes (low / high nibbles); Q6_K's two blocks share their high-bit bytes.
template <DType WT>
constexpr int kStep = kIsK<WT> ? 2 : 1;

template <DType WT>
PF_AVX512 PF_INLINE void load_pair(const uint8_t* const* r, int64_t b, __m512i* lo, __m512i* hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int j = (int)(b & 7);
  if constexpr (WT == DType::Q4_K || WT == DType::Q5_K) {
    constexpr int SB = kSuperBytes<WT>;
    const int64_t sb = (b >> 3) * SB;
    const int64_t qo = sb + (WT == DType::Q4_K ? 16 : 48) + 32 * (j >> 1);
    const __m512i a = load4(r, qo), c = load4(r, qo + 16);
    lo[0] = _mm512_and_si512(a, m4);
    hi[0] = _mm512_and_si512(c, m4);
    lo[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
    hi[1] = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
    if constexpr (WT == DType::Q5_K) {
      const __m512i qa = load4(r, sb + 16), qc = load4(r, sb + 32), b4 = _mm512_set1_epi8(0x10);
      for (int t = 0; t < 2; ++t) {
        const __m512i bit = _mm512_set1_epi8((char)(1 << (j + t)));
        lo[t] = _mm512_or_si512(lo[t], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qa, bit), b4));
        hi[t] = _mm512_or_si512(hi[t], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qc, bit), b4));
      }
    }
  } else {  // Q6_K
    const int64_t sb = (b >> 3) * 210;
    const int64_t qo = sb + 64 * (j >> 2), ho = sb + 128 + 32 * (j >> 2);
    const int s1 = 4 * ((j >> 1) & 1), s2 = 2 * (j & 3);
    const __m512i m2 = _mm512_set1_epi8(3);
    const __m512i ha = load4(r, ho), hc = load4(r, ho + 16);
    for (int t = 0; t < 2; ++t) {
      lo[t] = _mm512_or_si512(_mm512_and_si512(srl8(load4(r, qo + 32 * t), s1), m4),
                              _mm512_slli_epi16(_mm512_and_si512(srl8(ha, s2 + 2 * t), m2), 4));
      hi[t] = _mm512_or_si512(_mm512_and_si512(srl8(load4(r, qo + 32 * t + 16), s1), m4),
                              _mm512_slli_epi16(_mm512_and_si512(srl8(hc, s2 + 2 * t), m2), 4));
    }
  }
}

// lane 4L + q of the result = sum of the 4 int32 partials in 128-bit lane L of z[q].
PF_AVX512 PF_INLINE __m512i transpose_sum(const __m512i* z) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

// 16 pairs: RM activation rows starting at m (same group of 4), weight rows jt .. jt + 16/RM.
// GATHER (RM = 1 only, 32-block types): read the 16 rows' block scales in the loop instead of
// from c.dwc / c.mwc (the same values; for a single activation row a separate pass over the
// weights costs more).
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
  const int32_t* mh = a.h + g0;
  __m512 acc = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  // STEP blocks share their weight loads (K-quants: 2); they are then accumulated one by one, in
  // block order (the arithmetic of quant.h is unchanged).
  constexpr int STEP = kStep<WT>;
  for (int64_t b0 = 0; b0 < nb; b0 += STEP) {
   __m512i wlos[STEP][NQ], whis[STEP][NQ];
   for (int h = 0; h < NQ; ++h) {
     if constexpr (STEP == 2) {
       __m512i lo[2], hi[2];
       load_pair<WT>(wr + h * 4, b0, lo, hi);
       for (int t = 0; t < 2; ++t) {
         wlos[t][h] = lo[t];
         whis[t][h] = hi[t];
       }
     } else {
       load_quad<WT>(wr + h * 4, b0, bs, wlos[0][h], whis[0][h]);
     }
   }
   for (int st = 0; st < STEP; ++st) {
    const int64_t b = b0 + st;
    if (RM == 1)
      for (int64_t o = 0; o < c.pf_step; o += 64) _mm_prefetch((const char*)c.pf + b * c.pf_step + o, _MM_HINT_T1);
    const __m512i* wlo = wlos[st];
    const __m512i* whi = whis[st];
    __m512i r;
    if constexpr (WT == DType::Q6_K) {
      __m512i zl[4], zh[4];
      for (int i = 0; i < RM; ++i) {
        const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK)));
        const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK + 16)));
        for (int h = 0; h < NQ; ++h) {
          zl[h * RM + i] = _mm512_dpbusd_epi32(zero, wlo[h], xlo);
          zh[h * RM + i] = _mm512_dpbusd_epi32(zero, whi[h], xhi);
        }
      }
      const __m512i sx = _mm512_permutexvar_epi32(idx_i, _mm512_castsi128_si512(_mm_load_si128((const __m128i*)(ms + b * 4))));
      const __m512i hx = _mm512_permutexvar_epi32(idx_i, _mm512_castsi128_si512(_mm_load_si128((const __m128i*)(mh + b * 4))));
      const __m512i rl = _mm512_sub_epi32(transpose_sum(zl), _mm512_slli_epi32(hx, 5));
      const __m512i rh = _mm512_sub_epi32(transpose_sum(zh), _mm512_slli_epi32(_mm512_sub_epi32(sx, hx), 5));
      const __m512i sl = _mm512_permutexvar_epi32(idx_j, _mm512_load_si512(c.slo + b * 16));
      const __m512i sh = _mm512_permutexvar_epi32(idx_j, _mm512_load_si512(c.shi + b * 16));
      r = _mm512_add_epi32(_mm512_mullo_epi32(sl, rl), _mm512_mullo_epi32(sh, rh));
    } else {
      __m512i z[4];
      for (int i = 0; i < RM; ++i) {
        const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK)));
        const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xq[i] + b * QK + 16)));
        for (int h = 0; h < NQ; ++h)
          z[h * RM + i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, wlo[h], xlo), whi[h], xhi);
      }
      r = transpose_sum(z);
      if constexpr (WT == DType::Q8_0 || kOffsetShift<WT> > 0) {
        const __m512i sx = _mm512_permutexvar_epi32(idx_i, _mm512_castsi128_si512(_mm_load_si128((const __m128i*)(ms + b * 4))));
        r = _mm512_sub_epi32(r, _mm512_slli_epi32(sx, WT == DType::Q8_0 ? 7 : kOffsetShift<WT>));
      }
    }
    __m512 dw, mw;
    if constexpr (GATHER) {
      const __m512i g = _mm512_i32gather_epi32(c.offs, c.rows[0] + b * bs, 1);
      dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
      mw = kHasMin<WT> ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))) : dw;
    } else {
      dw = _mm512_permutexvar_ps(idx_j, _mm512_load_ps(c.dwc + b * 16));
      mw = kHasMin<WT> ? _mm512_permutexvar_ps(idx_j, _mm512_load_ps(c.mwc + b * 16)) : dw;
    }
    const __m512 dx = RM == 1 ? _mm512_set1_ps(md[b * 4 + ioff])
                              : _mm512_permutexvar_ps(idx_i, _mm512_castps128_ps512(_mm_load_ps(md + b * 4)));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(r), acc);
    if constexpr (kHasMin<WT>) {
      const __m512 fx = RM == 1 ? _mm512_set1_ps(mf[b * 4 + ioff])
                                : _mm512_permutexvar_ps(idx_i, _mm512_castps128_ps512(_mm_load_ps(mf + b * 4)));
      acc = _mm512_fmadd_ps(mw, fx, acc);
    }
   }
  }
  _mm512_storeu_ps(out, acc);
}

// Lane r = the 4 bytes at rows[r] + off.
PF_AVX512 PF_INLINE __m512i gat(const QCtx& c, int64_t off) {
  return _mm512_i32gather_epi32(c.offs, c.rows[0] + off, 1);
}

// Lane r of t0 / t1 = the 4 bytes at rows[r] + off / off + 4 (two 8-byte gathers of 8 rows each).
PF_AVX512 PF_INLINE void gat2(const QCtx& c, int64_t off, __m512i& t0, __m512i& t1) {
  const __m512i a = _mm512_i32gather_epi64(c.offs_lo, c.rows[0] + off, 1);
  const __m512i b = _mm512_i32gather_epi64(c.offs_hi, c.rows[0] + off, 1);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  t0 = _mm512_permutex2var_epi32(a, even, b);
  t1 = _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
}

// Offset in a packed block of the field that starts at byte FOFF of the row-major block.
template <DType WT, int FOFF>
constexpr int packed_at() {
  constexpr PackFmt F = kPackFmt(WT);
  for (int i = 0; i < F.n_fields; ++i)
    if (F.f[i].off == FOFF) return F.f[i].at;
  return -1;
}

// The packed Q6_K super-block (kPackFmt): 16 rows' scales and d, then per half 8 steps of 192
// bytes (the 16 rows' dwords of ql low half, ql high half and qh side by side).
constexpr int64_t kQ6Head = 16 * (16 + 2), kQ6Step = 3 * 64, kQ6Half = 8 * kQ6Step;

// Lane r = row r's 4 bytes at byte FOFF + rel of (super-)block B of the row-major rows (FOFF:
// where a field starts): gathered from the rows, or (PK) one load from the packed chunk c.pk.
template <DType WT, bool PK, int FOFF>
PF_AVX512 PF_INLINE __m512i ldf(const QCtx& c, int64_t B, int64_t rel) {
  constexpr int bs = kPackFmt(WT).bs;
  if constexpr (PK && WT == DType::Q6_K && FOFF < 192) {
    // the interleaved code fields (kPackFmt): ql byte o -> half o / 64, vector (o % 32) / 4,
    // first or second 32 bytes of the half; qh byte 128 + o -> half o / 32, vector (o % 32) / 4
    const int64_t o = FOFF + rel;
    const int64_t at = o < 128 ? kQ6Head + (o >> 6) * kQ6Half + ((o & 31) >> 2) * kQ6Step + ((o >> 5) & 1) * 64
                               : kQ6Head + ((o - 128) >> 5) * kQ6Half + ((o & 31) >> 2) * kQ6Step + 128;
    return _mm512_loadu_si512(c.pk + B * 16 * bs + at);
  } else if constexpr (PK) {
    static_assert(packed_at<WT, FOFF>() >= 0, "FOFF must start a field of the block");
    return _mm512_loadu_si512(c.pk + B * 16 * bs + packed_at<WT, FOFF>() + 16 * rel);
  } else {
    return gat(c, B * bs + FOFF + rel);
  }
}

// ldf at rel and rel + 4.
template <DType WT, bool PK, int FOFF>
PF_AVX512 PF_INLINE void ldf2(const QCtx& c, int64_t B, int64_t rel, __m512i& t0, __m512i& t1) {
  if constexpr (PK) {
    t0 = ldf<WT, true, FOFF>(c, B, rel);
    t1 = ldf<WT, true, FOFF>(c, B, rel + 4);
  } else {
    gat2(c, B * kPackFmt(WT).bs + FOFF + rel, t0, t1);
  }
}

// The 16 rows' fp16 field at byte `off` of super-block B, widened.
template <DType WT, bool PK>
PF_AVX512 PF_INLINE __m512 ldh(const QCtx& c, int64_t B, int off) {
  constexpr PackFmt F = kPackFmt(WT);
  if constexpr (PK) {
    int at = 0;
    for (int i = 0; i < F.n_fields; ++i)
      if (F.f[i].off == off) at = F.f[i].at;
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c.pk + B * 16 * F.bs + at)));
  } else {
    // the 4 bytes from off (low half), or, at the end of the block, from off - 2 (high half):
    // a gather never reads past the row
    const bool at_end = off + 4 > F.bs;
    const __m512i g = gat(c, B * F.bs + off - (at_end ? 2 : 0));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(at_end ? _mm512_srli_epi32(g, 16) : g));
  }
}

// -v exactly (sign flip, as the scalar -(dmin * m); AVX-512F has no float xor).
PF_AVX512 PF_INLINE __m512 neg_ps(__m512 v) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

// fill_ktables_sb: super-block B only, its 8 blocks' entries at dwb / mwb / slb / shb ([8][16]).
template <DType WT, bool PK>
PF_AVX512 PF_INLINE void fill_ktables_sb(const QCtx& c, int64_t B, float* dwb, float* mwb, int32_t* slb, int32_t* shb) {
    if constexpr (WT == DType::Q6_K) {
      // scales[14], scales[15], d: the fp16 d is the high half (stays inside the block)
      const __m512 d = ldh<WT, PK>(c, B, 208);
      for (int k = 0; k < 4; ++k) {
        const __m512i g = ldf<WT, PK, 192>(c, B, 4 * k);  // scales[4k .. 4k+3]
        for (int t = 0; t < 2; ++t) {
          const int j = 2 * k + t;
          _mm512_store_ps(dwb + j * 16, d);
          _mm512_store_si512(slb + j * 16, _mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 16 * t), 24));
          _mm512_store_si512(shb + j * 16, _mm512_srai_epi32(_mm512_slli_epi32(g, 16 - 16 * t), 24));
        }
      }
    } else {
      const __m512 d = ldh<WT, PK>(c, B, 0);
      const __m512 dmin = ldh<WT, PK>(c, B, 2);
      const __m512i a = ldf<WT, PK, 4>(c, B, 0);  // scales[0..3]
      const __m512i b = ldf<WT, PK, 4>(c, B, 4);  // scales[4..7]
      const __m512i e = ldf<WT, PK, 4>(c, B, 8);  // scales[8..11]
      const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(0x30);
      for (int j = 0; j < 4; ++j) {
        const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(a, 8 * j), m6);
        const __m512i mn = _mm512_and_si512(_mm512_srli_epi32(b, 8 * j), m6);
        // j + 4: low 4 bits from scales[8 + j], high 2 bits from the top of scales[j] / scales[4 + j]
        const __m512i sc4 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(e, 8 * j), m4),
                                            _mm512_and_si512(_mm512_srli_epi32(a, 8 * j + 2), m2));
        const __m512i mn4 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(e, 8 * j + 4), m4),
                                            _mm512_and_si512(_mm512_srli_epi32(b, 8 * j + 2), m2));
        _mm512_store_ps(dwb + j * 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(mwb + j * 16, neg_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn))));
        _mm512_store_ps(dwb + (j + 4) * 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc4)));
        _mm512_store_ps(mwb + (j + 4) * 16, neg_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn4))));
      }
    }
}

// fill_ktables (mm_common.h) for the 16 rows at once: per super-block, gathers (or, packed,
// loads) of the scale bytes and fp16 scales of all rows, unpacked with vector bit operations.
template <DType WT, bool PK = false>
PF_AVX512 void fill_ktables_avx512(const QCtx& c, float* dw, float* mw, int32_t* slo, int32_t* shi) {
  for (int64_t B = 0; B < c.nb / 8; ++B)
    fill_ktables_sb<WT, PK>(c, B, dw + B * 128, mw + B * 128, slo + B * 128, shi + B * 128);
}

// ----------------------------------------------------------------------------- quantized, rows >= 2
//
// Several activation rows share each weight block, so a weight block of the chunk's 16 rows is
// decoded once into a transposed form: eight vectors W[g] whose lane r holds the u8 codes of
// elements 4g .. 4g+3 of weight row r (Q8_0: biased by +128). Per activation row, the block's 16
// exact integer sums are then eight vpdpbusd of W[g] with the broadcast dword g of the row's int8
// block (no per-pair reduction), followed by one float stage for the 16 pairs. The first pass over
// the blocks decodes (gathers) and computes up to kXtRows rows at once (kXtJoin when that leaves
// no single row behind); with more rows it also stores the decoded blocks in the scratch and later
// passes read them from there. The arithmetic
// per pair is the one quant.h fixes (the integer sums are exact, whatever their order).

template <DType WT>
constexpr int kXtRows = kIsK<WT> ? 4 : 8;  // activation rows per pass (accumulators in registers)
// Q6_K passes over the stored blocks go one block at a time (eight weight vectors in registers
// instead of sixteen), which leaves room for eight rows (bench_matmul, M = 512, 1B shapes: 1.11-1.13x;
// Q4_K / Q5_K were no faster that way).
template <DType WT>
constexpr int kXtLoadRows = WT == DType::Q6_K ? 8 : kXtRows<WT>;
// The most rows of one pass: a last single row joins the pass before it (32-block types: nine
// accumulators still fit in the registers). A pass of one row would decode the chunk's weights
// again for little work; verify batches of 8 and 16 drafted tokens are 9 and 17 rows.
template <DType WT>
constexpr int kXtJoin = kIsK<WT> ? kXtRows<WT> : kXtRows<WT> + 1;

// Rows of the next pass when `left` rows are still to be computed.
template <DType WT>
inline int xt_pass_rows(int64_t left) {
  return left == kXtJoin<WT> ? kXtJoin<WT> : left < kXtRows<WT> ? (int)left : kXtRows<WT>;
}
// The same for K-quant passes over the stored blocks (no ninth row: fewer registers are free).
template <DType WT>
inline int xt_load_rows(int64_t left) {
  if constexpr (!kIsK<WT>) return xt_pass_rows<WT>(left);
  return left < kXtLoadRows<WT> ? (int)left : kXtLoadRows<WT>;
}

// Byte t of lane r = 0x10 where bit (4 * g + t) of the 32-bit value in lane r of qh is set.
PF_AVX512 PF_INLINE __m512i qh_bits(__m512i qh, int g) {
  const int by = g >> 1;  // the byte holding bits 4g .. 4g+3
  const __m512i ctrl = _mm512_add_epi8(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0), _mm512_set1_epi8((char)by));
  const __m512i rep = _mm512_shuffle_epi8(qh, ctrl);  // each dword: its own byte `by`, 4 times
  const __m512i bit = _mm512_set1_epi32((g & 1) ? (int)0x80402010 : 0x08040201);
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(rep, bit), _mm512_set1_epi8(0x10));
}

// w | (v & 0x10 in every byte)
PF_AVX512 PF_INLINE __m512i or_b4(__m512i w, __m512i v) {
  return _mm512_ternarylogic_epi32(w, v, _mm512_set1_epi8(0x10), 0xF8);
}

// Decodes STEP blocks from b0 into w[st * 8 + g]; 32-block types also give the block's dw / mw.
template <DType WT, bool PK = false>
PF_AVX512 PF_INLINE void xt_decode(const QCtx& c, int64_t b0, __m512i* w, __m512& dw, __m512& mw) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (WT == DType::Q4_K || WT == DType::Q5_K) {
    constexpr int QS = WT == DType::Q4_K ? 16 : 48;  // qs
    const int64_t B = b0 >> 3;
    const int j = (int)(b0 & 7);
    const int64_t qo = 32 * (j >> 1);
    for (int g = 0; g < 8; g += 2) {
      __m512i t[2];
      ldf2<WT, PK, QS>(c, B, qo + 4 * g, t[0], t[1]);
      for (int u = 0; u < 2; ++u) {
        w[g + u] = _mm512_and_si512(t[u], m4);
        w[8 + g + u] = _mm512_and_si512(_mm512_srli_epi16(t[u], 4), m4);
      }
      if constexpr (WT == DType::Q5_K) {  // bit j of qh[l] = bit 4 of element l of block j
        // The super-block's qh (shared by its 8 blocks) is gathered with its first pair.
        __m512i h[2];
        if (j == 0) {
          ldf2<WT, PK, 16>(c, B, 4 * g, h[0], h[1]);
          _mm512_store_si512(c.qh + g, h[0]);
          _mm512_store_si512(c.qh + g + 1, h[1]);
        } else {
          h[0] = _mm512_load_si512(c.qh + g);
          h[1] = _mm512_load_si512(c.qh + g + 1);
        }
        for (int u = 0; u < 2; ++u)
          for (int st = 0; st < 2; ++st) {
            const int jb = j + st;
            const __m512i v = jb <= 4 ? _mm512_slli_epi32(h[u], 4 - jb) : _mm512_srli_epi32(h[u], jb - 4);
            w[st * 8 + g + u] = or_b4(w[st * 8 + g + u], v);
          }
      }
    }
    (void)dw;
    (void)mw;
  } else if constexpr (WT == DType::Q6_K) {
    // Block jj (0..3) of half h: low 4 bits in ql[64 h + 32 (jj & 1) + i] >> 4 (jj >> 1), high 2
    // bits in qh[32 h + i] >> 2 jj (i = element in the block).
    const int64_t B = b0 >> 3;
    const int j = (int)(b0 & 7), h = j >> 2, jj0 = j & 3;
    const int s1 = 4 * (jj0 >> 1);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    for (int g = 0; g < 8; g += 2) {
      __m512i qh[2];
      ldf2<WT, PK, 128>(c, B, 32 * h + 4 * g, qh[0], qh[1]);
      for (int st = 0; st < 2; ++st) {
        __m512i ql[2];
        ldf2<WT, PK, 0>(c, B, 64 * h + 32 * st + 4 * g, ql[0], ql[1]);
        const int s2 = 2 * (jj0 + st);
        for (int u = 0; u < 2; ++u) {
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(ql[u], s1), m4);
          const __m512i hi = s2 <= 4 ? _mm512_slli_epi32(qh[u], 4 - s2) : _mm512_srli_epi32(qh[u], s2 - 4);
          w[st * 8 + g + u] = _mm512_ternarylogic_epi32(lo, hi, m30, 0xF8);  // lo | (hi & 0x30)
        }
      }
    }
    (void)dw;
    (void)mw;
  } else {
    const int64_t o = b0 * c.bs;
    __m512i t[8];
    if constexpr (WT == DType::Q8_0) {
      const __m512i bias = _mm512_set1_epi8((char)0x80);
      for (int g = 0; g < 8; g += 2) gat2(c, o + 2 + 4 * g, t[g], t[g + 1]);
      for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(t[g], bias);
    } else {
      constexpr int qo = WT == DType::Q4_0 ? 2 : WT == DType::Q4_1 ? 4 : WT == DType::Q5_0 ? 6 : 8;
      gat2(c, o + qo, t[0], t[1]);
      gat2(c, o + qo + 8, t[2], t[3]);
      for (int g = 0; g < 4; ++g) {
        w[g] = _mm512_and_si512(t[g], m4);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(t[g], 4), m4);
      }
      if constexpr (WT == DType::Q5_0 || WT == DType::Q5_1) {
        const __m512i qh = gat(c, o + (WT == DType::Q5_1 ? 4 : 2));
        for (int g = 0; g < 8; ++g) w[g] = _mm512_or_si512(w[g], qh_bits(qh, g));
      }
    }
    const __m512i g = gat(c, o);
    dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    if constexpr (kHasMin<WT>) mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    else (void)mw;
  }
}

PF_AVX512 PF_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// vpdpbusd of w with the dword at p broadcast, as one instruction with an embedded {1to16}
// memory operand: given _mm512_set1_epi32 of a loaded dword, GCC 12 emits a separate
// vpbroadcastd for every vpdpbusd, an extra vector op per dot product.
PF_AVX512 PF_INLINE __m512i dpbusd_b4(__m512i z, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(z) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return z;
}

// One decoded block (eight weight vectors w) against one activation row's block x: the integer
// sums as two chains of four vpdpbusd (from z0 / z1), then the float stage quant.h fixes, into
// acc (mi: the row's meta index of the block). Every pass that goes row by row uses these two.
PF_AVX512 PF_INLINE void xt_block_dots(const __m512i* w, const int8_t* x, __m512i& z0, __m512i& z1) {
  for (int g = 0; g < 4; ++g) {
    z0 = dpbusd_b4(z0, w[g], x + 4 * g);
    z1 = dpbusd_b4(z1, w[g + 4], x + 16 + 4 * g);
  }
}
template <DType WT>
PF_AVX512 PF_INLINE void xt_block_out(__m512& acc, const ActQ& a, size_t mi, __m512 dw, __m512 mw, __m512i z0,
                                      __m512i z1) {
  const __m512 dxw = _mm512_mul_ps(_mm512_set1_ps(a.d[mi]), dw);
  acc = _mm512_fmadd_ps(dxw, _mm512_cvtepi32_ps(_mm512_add_epi32(z0, z1)), acc);
  if constexpr (kHasMin<WT>) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.f[mi]), acc);
  else (void)mw;
}

// The chunk's decoded blocks in the scratch and per-row integer offsets (see qgemm_xt).
struct XtBuf {
  __m512i* wt;         // [nb][8]
  float* dwt;          // [nb][16] block tables, row order
  float* mwt;
  const int32_t* slo;  // Q6_K sub-scales
  const int32_t* shi;
  const int32_t* o0;   // chain starts per (row, block) in ActQ meta order from row group m0 / 4
  const int32_t* o1;
  size_t obase;        // meta index of (m0 & ~3, block 0)
};

enum XtMode { kDecode = 0, kDecodeStore = 1, kLoad = 2, kPacked = 3 };

// xt_decode for a packed chunk (quant.h): the block's scales and transposed codes are in place.
// xt_unpack_at reads the packed block at p.
template <DType WT>
PF_AVX512 PF_INLINE void xt_unpack_at(const uint8_t* p, __m512i* w, __m512& dw, __m512& mw) {
  dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
  if constexpr (WT == DType::Q8_0) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(_mm512_loadu_si512(p + 32 + 64 * g), bias);
    (void)mw;
  } else {
    static_assert(WT == DType::Q4_0 || WT == DType::Q4_1, "packed: Q4_0, Q4_1, Q8_0");
    constexpr int qo = WT == DType::Q4_1 ? 64 : 32;
    if constexpr (WT == DType::Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
    else (void)mw;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m512i t = _mm512_loadu_si512(p + qo + 64 * g);
      w[g] = _mm512_and_si512(t, m4);
      w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(t, 4), m4);
    }
  }
}
template <DType WT>
PF_AVX512 PF_INLINE void xt_unpack(const QCtx& c, int64_t b, __m512i* w, __m512& dw, __m512& mw) {
  xt_unpack_at<WT>(c.pk + b * 16 * c.bs, w, dw, mw);
}

// RM activation rows from m: y[m + i][n0 + r] for r < nv.
template <DType WT, int RM, int MODE, bool PK = false>
PF_AVX512 void xt_pass(const QCtx& c, const XtBuf& xb, const ActQ& a, int64_t m, const RowView& yv, int64_t n0, int nv) {
  constexpr int STEP = MODE == kLoad && WT == DType::Q6_K ? 1 : kStep<WT>;
  constexpr bool kOff = WT == DType::Q8_0 || kOffsetShift<WT> > 0;
  // Issue the rows' integer sums interleaved (below) rather than row by row: measured for packed
  // Q4_1 only (bench_matmul, 2 threads, hot: 2-17 rows 3-15% faster). Q4_0 / Q8_0 packed were
  // no faster, Q4_1 / Q5_1 / Q4_K unpacked slower at some row counts, so they keep the row order.
  constexpr bool kIlv = MODE == kPacked && WT == DType::Q4_1 && RM >= 2;
  const int64_t nb = c.nb;
  const int8_t* xq[RM];
  size_t mo[RM];  // meta index of (row, block 0); stride 4 per block
  for (int i = 0; i < RM; ++i) {
    xq[i] = a.q + (m + i) * a.K;
    mo[i] = a.meta(m + i, 0);
  }
  __m512 acc[RM];
  for (int i = 0; i < RM; ++i) acc[i] = _mm512_setzero_ps();
  // K-quants in a single decoding pass: each super-block's scale tables are filled when the pass
  // reaches it, into this small buffer (stays in L1), not for the whole chunk beforehand.
  constexpr bool kSbTables = kIsK<WT> && MODE == kDecode;
  alignas(64) float sbt[kSbTables ? 4 * 128 : 1];
  for (int64_t b0 = 0; b0 < nb; b0 += STEP) {
    __m512i w[STEP * 8];
    __m512 dw0, mw0;
    if constexpr (kSbTables) {
      if ((b0 & 7) == 0)
        fill_ktables_sb<WT, PK>(c, b0 >> 3, sbt, sbt + 128, reinterpret_cast<int32_t*>(sbt + 256),
                                reinterpret_cast<int32_t*>(sbt + 384));
    }
    if constexpr (MODE == kLoad) {
      for (int k = 0; k < STEP * 8; ++k) w[k] = _mm512_load_si512(xb.wt + b0 * 8 + k);
    } else if constexpr (MODE == kPacked) {
      if constexpr (!kIsK<WT> && WT != DType::Q5_0 && WT != DType::Q5_1) {
        for (int64_t o = 0; o < c.pf_step; o += 64) _mm_prefetch((const char*)c.pf + b0 * c.pf_step + o, _MM_HINT_T1);
        xt_unpack<WT>(c, b0, w, dw0, mw0);
      }
    } else {
      // The chunk after next, into L2 while this one is decoded (its rows are read in an
      // interleaved order the hardware prefetchers do not follow).
      for (int64_t o = 0; o < STEP * c.pf_step; o += 64) _mm_prefetch((const char*)c.pf + b0 * c.pf_step + o, _MM_HINT_T1);
      xt_decode<WT, PK>(c, b0, w, dw0, mw0);
      if constexpr (MODE == kDecodeStore) {
        for (int k = 0; k < STEP * 8; ++k) _mm512_store_si512(xb.wt + b0 * 8 + k, w[k]);
        if constexpr (!kIsK<WT>) {
          _mm512_store_ps(xb.dwt + b0 * 16, dw0);
          if constexpr (kHasMin<WT>) _mm512_store_ps(xb.mwt + b0 * 16, mw0);
        }
      }
    }
    for (int st = 0; st < STEP; ++st) {
      const int64_t b = b0 + st;
      const __m512i* wb = w + st * 8;
      __m512 dw, mw;
      if (kSbTables) {
        dw = _mm512_load_ps(sbt + (b & 7) * 16);
        if constexpr (kHasMin<WT>) mw = _mm512_load_ps(sbt + 128 + (b & 7) * 16);
      } else if (kIsK<WT> || MODE == kLoad) {
        dw = _mm512_load_ps(xb.dwt + b * 16);
        if constexpr (kHasMin<WT>) mw = _mm512_load_ps(xb.mwt + b * 16);
      } else {
        dw = dw0;
        mw = mw0;
      }
      if constexpr (WT == DType::Q6_K) {
        const int32_t* slp = kSbTables ? reinterpret_cast<const int32_t*>(sbt + 256) + (b & 7) * 16 : xb.slo + b * 16;
        const int32_t* shp = kSbTables ? reinterpret_cast<const int32_t*>(sbt + 384) + (b & 7) * 16 : xb.shi + b * 16;
        const __m512 sl = _mm512_cvtepi32_ps(_mm512_load_si512(slp));
        const __m512 sh = _mm512_cvtepi32_ps(_mm512_load_si512(shp));
#pragma GCC unroll 9
        for (int i = 0; i < RM; ++i) {
          const int8_t* x = xq[i] + b * QK;
          const size_t mi = mo[i] + (size_t)b * 4;
          const __m512 dxw = _mm512_mul_ps(_mm512_set1_ps(a.d[mi]), dw);
          // isum = sl * (lo - 32 hx) + sh * (hi - 32 (sx - hx)); the chains start at the offsets.
          // Exact in float: |isum| < 2^24 and so is every partial product.
          __m512i z0 = _mm512_set1_epi32(xb.o0[mi - xb.obase]);
          __m512i z1 = _mm512_set1_epi32(xb.o1[mi - xb.obase]);
          for (int g = 0; g < 4; ++g) {
            z0 = dpbusd_b4(z0, wb[g], x + 4 * g);
            z1 = dpbusd_b4(z1, wb[g + 4], x + 16 + 4 * g);
          }
          const __m512 r = _mm512_fmadd_ps(sl, _mm512_cvtepi32_ps(z0), _mm512_mul_ps(sh, _mm512_cvtepi32_ps(z1)));
          acc[i] = _mm512_fmadd_ps(dxw, r, acc[i]);
        }
      } else if constexpr (kIlv) {
        // The block's integer sums of all RM rows, issued group by group across the rows: RM
        // independent chains (two per row below 4 rows), so consecutive vpdpbusd never wait on
        // each other (integer sums: any order is exact).
        constexpr int NC = RM >= 4 ? 1 : 2;
        __m512i z[RM][NC];
        for (int i = 0; i < RM; ++i) {
          const size_t mi = mo[i] + (size_t)b * 4;
          z[i][0] = kOff ? _mm512_set1_epi32(xb.o0[mi - xb.obase]) : _mm512_setzero_si512();
          if constexpr (NC == 2) z[i][1] = _mm512_setzero_si512();
        }
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < RM; ++i)
            z[i][g % NC] = dpbusd_b4(z[i][g % NC], wb[g], xq[i] + b * QK + 4 * g);
        for (int i = 0; i < RM; ++i) {
          const size_t mi = mo[i] + (size_t)b * 4;
          const __m512 dxw = _mm512_mul_ps(_mm512_set1_ps(a.d[mi]), dw);
          const __m512i zi = NC == 2 ? _mm512_add_epi32(z[i][0], z[i][NC - 1]) : z[i][0];
          acc[i] = _mm512_fmadd_ps(dxw, _mm512_cvtepi32_ps(zi), acc[i]);
          if constexpr (kHasMin<WT>) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.f[mi]), acc[i]);
        }
      } else {
        for (int i = 0; i < RM; ++i) {  // row by row
          const size_t mi = mo[i] + (size_t)b * 4;
          __m512i z0 = kOff ? _mm512_set1_epi32(xb.o0[mi - xb.obase]) : _mm512_setzero_si512();
          __m512i z1 = _mm512_setzero_si512();
          xt_block_dots(wb, xq[i] + b * QK, z0, z1);
          xt_block_out<WT>(acc[i], a, mi, dw, mw, z0, z1);
        }
      }
    }
  }
  const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
  for (int i = 0; i < RM; ++i) _mm512_mask_storeu_ps(reinterpret_cast<float*>(yv.row(m + i)) + n0, mk, acc[i]);
}

// Zero, computed from lane 0 of v by an `and` the CPU cannot see through: an address plus this
// waits for v.
PF_AVX512 PF_INLINE int64_t zero_after(__m512i v) {
  int64_t z = _mm_cvtsi128_si32(_mm512_castsi512_si128(v));
  asm("and $0, %0" : "+r"(z));
  return z;
}

// The one-row kernels' prefetch: n bytes from byte `at` of what c.pf points at; nothing when
// c.pf_step is 0. `after` (a zero_after) makes the prefetches wait for the value it was taken
// from. Non-temporal: a weight streamed for one row is read once per token, and on AMD the lines
// then leave L1 without being written into L2 and the L3 (a victim cache) on their way out, which
// frees that traffic for the reads. Against T1 (into L2), bench_matmul --cold, AMD EPYC (Zen 5),
// one build alternating the two per batch: median ratios 0.96-1.36x over Q4_0 / Q4_K / Q5_K /
// Q6_K / Q8_0 at 1 and 2 threads, most of them 1.03-1.2x.
PF_AVX512 PF_INLINE void prefetch_ahead(const QCtx& c, int64_t at, int64_t n, int64_t after) {
  if (!c.pf_step) return;
  const char* pf = (const char*)c.pf + after + at;
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(pf + o, _MM_HINT_NTA);
}

// The 1-row K-quant kernels: prefetch_ahead for NB blocks from b0 of the chunk (a fixed count).
template <DType WT, int NB>
PF_AVX512 PF_INLINE void prefetch_blocks(const QCtx& c, int64_t b0, int64_t after) {
  constexpr int kBlock = 16 * kSuperBytes<WT> / 8;  // a 32-block's bytes of a packed chunk
  prefetch_ahead(c, b0 * kBlock, NB * kBlock, after);
}

// Q6_K, one activation row: a half super-block (four blocks) at a time. Its ql bytes hold two
// blocks each (low / high nibbles) and its qh bytes all four (two bits each), so every code byte
// is loaded once and the shifts are constants; the four blocks' dot chains run side by side.
// Same integer sums and float stage as xt_pass (bit-identical).
// Paced by its loads: the loads of each two steps (384 bytes of codes) wait for the previous two
// steps' last qh load, and every step prefetches its own share of the super-block (210 bytes,
// four lines at most) 12 KiB ahead once its qh has arrived. Small prefetch bursts and this short
// pacing go together: bench_matmul --cold, AMD EPYC (Zen 5), against pacing every quarter
// super-block on its sums with 840-byte prefetch bursts (both alternating per batch in one
// process): 1.02-1.19x at 1 thread and 1.14-1.24x at 2, from cache 1.05x; small bursts with the
// quarter pacing 0.80-0.97x; pacing every two steps on their sums 0.70x from cache; every step on
// its load 1.25-1.33x from DRAM but 0.72-0.78x from cache.
// The scales stay in registers: d once per super-block, each half's two scale vectors loaded with
// its codes and each block's pair shifted out where the float stage needs it. Filling a 2 KiB
// table per super-block on the stack (fill_ktables_sb) and reading it back instead cost 5-7% of
// the rate from cache, and 0-11% from DRAM, at 1 and 2 threads (bench_matmul, the two kernels
// alternating per batch in one process). Packed weights only (row-major: xt_q6k_row_rm).
PF_AVX512 void xt_q6k_row(const QCtx& c0, const XtBuf& xb, const ActQ& a, int64_t m, const RowView& yv, int64_t n0, int nv) {
  QCtx c = c0;  // c.pk carries the pacing zero
  const int64_t nb = c.nb;
  const int8_t* xq = a.q + m * a.K;
  const size_t mo = a.meta(m, 0);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t B = 0; B < nb / 8; ++B) {
    const __m512 d = ldh<DType::Q6_K, true>(c, B, 208);
    for (int h = 0; h < 2; ++h) {
      const int64_t b0 = B * 8 + 4 * h;
      const __m512i gs[2] = {ldf<DType::Q6_K, true, 192>(c, B, 8 * h), ldf<DType::Q6_K, true, 192>(c, B, 8 * h + 4)};
      __m512i z[4][2];
      for (int jj = 0; jj < 4; ++jj) {
        const size_t mi = mo + (size_t)(b0 + jj) * 4 - xb.obase;
        z[jj][0] = _mm512_set1_epi32(xb.o0[mi]);
        z[jj][1] = _mm512_set1_epi32(xb.o1[mi]);
      }
      const int8_t* x = xq + b0 * QK;
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        // step g of half h: the 16 rows' ql dwords (blocks 0 / 1 in the low nibbles, 2 / 3 in the
        // high ones) and qh dwords, side by side as ldf reads them; addressed directly, as ldf's
        // general arithmetic on 64 h + 4 g (h a loop variable) cost five scalar ops per load
        // (bench_matmul, 1 thread: 1.01-1.06x from cache, 1.04-1.05x from DRAM)
        const uint8_t* q = c.pk + B * 16 * kPackFmt(DType::Q6_K).bs + kQ6Head + h * kQ6Half + g * kQ6Step;
        const __m512i qa = _mm512_loadu_si512(q), qb = _mm512_loadu_si512(q + 64), qh = _mm512_loadu_si512(q + 128);
        const int64_t after = zero_after(qh);
        prefetch_ahead(c0, (B * 16 + 8 * h + g) * kSuperBytes<DType::Q6_K>, kSuperBytes<DType::Q6_K>, after);
        const __m512i w0 = _mm512_ternarylogic_epi32(_mm512_and_si512(qa, m4), _mm512_slli_epi32(qh, 4), m30, 0xF8);
        const __m512i w1 = _mm512_ternarylogic_epi32(_mm512_and_si512(qb, m4), _mm512_slli_epi32(qh, 2), m30, 0xF8);
        const __m512i w2 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(qa, 4), m4), qh, m30, 0xF8);
        const __m512i w3 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(qb, 4), m4), _mm512_srli_epi32(qh, 2), m30, 0xF8);
        const int k = g >> 2;
        z[0][k] = dpbusd_b4(z[0][k], w0, x + 4 * g);
        z[1][k] = dpbusd_b4(z[1][k], w1, x + QK + 4 * g);
        z[2][k] = dpbusd_b4(z[2][k], w2, x + 2 * QK + 4 * g);
        z[3][k] = dpbusd_b4(z[3][k], w3, x + 3 * QK + 4 * g);
        if (g & 1) c.pk = c0.pk + after;
      }
      for (int jj = 0; jj < 4; ++jj) {
        // block 4h + jj: its two 16-scales are bytes 2 (jj % 2) and 2 (jj % 2) + 1 of gs[jj / 2]
        const __m512i g = gs[jj >> 1];
        const int t = jj & 1;
        const size_t mi = mo + (size_t)(b0 + jj) * 4;
        const __m512 sl = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 16 * t), 24));
        const __m512 sh = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(g, 16 - 16 * t), 24));
        const __m512 dxw = _mm512_mul_ps(_mm512_set1_ps(a.d[mi]), d);
        const __m512 r = _mm512_fmadd_ps(sl, _mm512_cvtepi32_ps(z[jj][0]), _mm512_mul_ps(sh, _mm512_cvtepi32_ps(z[jj][1])));
        acc = _mm512_fmadd_ps(dxw, r, acc);
      }
    }
  }
  const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
  _mm512_mask_storeu_ps(reinterpret_cast<float*>(yv.row(m)) + n0, mk, acc);
}

// Sums of four dwords: lane L (128-bit) of the result holds, for the four rows of p[0..3], the
// sum of the four dwords of p[i]'s lane L (as dword i).
PF_AVX512 PF_INLINE __m512i sum4x4(const __m512i* p) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

// 128-bit lanes transposed across four vectors: v[k] lane g = u[g] lane k.
PF_AVX512 PF_INLINE void tr_lanes(const __m512i* u, __m512i* v) {
  const __m512i a = _mm512_shuffle_i32x4(u[0], u[1], 0x44), b = _mm512_shuffle_i32x4(u[0], u[1], 0xEE);
  const __m512i c = _mm512_shuffle_i32x4(u[2], u[3], 0x44), d = _mm512_shuffle_i32x4(u[2], u[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(a, c, 0x88);
  v[1] = _mm512_shuffle_i32x4(a, c, 0xDD);
  v[2] = _mm512_shuffle_i32x4(b, d, 0x88);
  v[3] = _mm512_shuffle_i32x4(b, d, 0xDD);
}

// xt_q6k_row for row-major weights (a mapped file), 16 rows c.rows_stride bytes apart. Row by
// row, a half super-block's 128 codes are two vectors in element order (ql's 64 bytes, low and
// high nibbles, with qh's 32 bytes broadcast to both halves and shifted per half), each multiplied
// against 64 contiguous activation bytes by one vpdpbusd: lane k (128-bit) then holds the four
// partial sums of 16-sub-block k. Summing those fours and turning rows into lanes (sum4x4,
// tr_lanes) gives each block's two 16-row vectors of sub-block sums, and from there the float
// stage is xt_q6k_row's (same integer sums, bit-identical results); d and the scales are gathered
// once per super-block (as fast as loading them with the codes). The rows are 16 streams: the
// chunk after next (c.pf) is prefetched into L2 at the pace this one is read, and each row three
// super-blocks ahead into L1. bench_matmul --cold, Zen 5, against the packed kernel: 1 thread
// 0.74x (2048 x 512) to 0.8-0.9x (8192 x 2048, 14336 x 4096), 2 threads 0.8-1.0x; the gathered
// 16 x 16 tiles it replaces read 5.7 GB/s per thread, and a variant loading four rows' 16 bytes
// per vector and transposing dwords (as the packed layout has them) ran 5-15% slower from L2.
PF_AVX512 void xt_q6k_row_rm(const QCtx& c0, const XtBuf& xb, const ActQ& a, int64_t m, const RowView& yv, int64_t n0,
                             int nv) {
  const int64_t nb = c0.nb, stride = c0.rows_stride;
  const int8_t* xq = a.q + m * a.K;
  const size_t mo = a.meta(m, 0);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  // qh's bits for elements 0..31 / 32..63 of a half (bits 0-1 / 2-3) to bits 4-5: << 4 / << 2;
  // for 64..95 / 96..127 (bits 4-5 / 6-7): >> 0 / >> 2
  const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  const char* pf = (const char*)c0.pf;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t B = 0; B < nb / 8; ++B) {
    const uint8_t* g = c0.rows[0] + B * 210;
    const __m512 d = ldh<DType::Q6_K, false>(c0, B, 208);
    __m512i sc[4];  // scales[4k .. 4k+3] of the 16 rows
    for (int k = 0; k < 4; ++k) sc[k] = ldf<DType::Q6_K, false, 192>(c0, B, 4 * k);
    for (int h = 0; h < 2; ++h) {
      const int64_t b0 = B * 8 + 4 * h;
      const int8_t* x = xq + b0 * QK;
      const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 64);
      for (int u = 0; u < 8 * 210; u += 64) _mm_prefetch(pf + (B * 16 + 8 * h) * 210 + u, _MM_HINT_T1);
      __m512i u0[4], u1[4];  // row group j: lane k = sub-block k (u0) / 4 + k (u1) of rows 4j .. 4j+3
      for (int j = 0; j < 4; ++j) {
        __m512i p0[4], p1[4];
        for (int i = 0; i < 4; ++i) {
          const uint8_t* w = g + (4 * j + i) * stride;
          // into L1, three super-blocks ahead in this row (the L1 prefetcher does not follow 16
          // streams; 2-4 ahead within 5%): 1.1-1.3x at 1 thread, bench_matmul --cold 14336 x 4096
          _mm_prefetch((const char*)w + 3 * 210 + 105 * h, _MM_HINT_T0);
          _mm_prefetch((const char*)w + 3 * 210 + 105 * h + 64, _MM_HINT_T0);
          const __m512i ql = _mm512_loadu_si512(w + 64 * h);
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + 128 + 32 * h)));
          const __m512i c0v = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, m4), _mm512_sllv_epi64(qh, shl), m30, 0xF8);
          const __m512i c1v = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                                        _mm512_srlv_epi64(qh, shr), m30, 0xF8);
          p0[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0v, x0);
          p1[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c1v, x1);
        }
        u0[j] = sum4x4(p0);
        u1[j] = sum4x4(p1);
      }
      __m512i v[8];  // v[s]: 16-sub-block s of the half, lane r = row r
      tr_lanes(u0, v);
      tr_lanes(u1, v + 4);
      for (int jj = 0; jj < 4; ++jj) {
        const size_t mi = mo + (size_t)(b0 + jj) * 4;
        const __m512i zl = _mm512_add_epi32(v[2 * jj], _mm512_set1_epi32(xb.o0[mi - xb.obase]));
        const __m512i zh = _mm512_add_epi32(v[2 * jj + 1], _mm512_set1_epi32(xb.o1[mi - xb.obase]));
        // block 4h + jj: its two 16-scales are bytes 2 (jj % 2) and 2 (jj % 2) + 1 of sc[2h + jj / 2]
        const __m512i gs = sc[2 * h + (jj >> 1)];
        const int t = jj & 1;
        const __m512 sl = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(gs, 24 - 16 * t), 24));
        const __m512 sh = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(gs, 16 - 16 * t), 24));
        const __m512 dxw = _mm512_mul_ps(_mm512_set1_ps(a.d[mi]), d);
        const __m512 rr = _mm512_fmadd_ps(sl, _mm512_cvtepi32_ps(zl), _mm512_mul_ps(sh, _mm512_cvtepi32_ps(zh)));
        acc = _mm512_fmadd_ps(dxw, rr, acc);
      }
    }
  }
  const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
  _mm512_mask_storeu_ps(reinterpret_cast<float*>(yv.row(m)) + n0, mk, acc);
}

// Q4_K, one activation row: a block pair shares its 32 code bytes (low / high nibbles). The
// high nibbles go into vpdpbusd in place (16 x the code), and the odd block's scale is taken / 16
// to match: exact (|16 z| < 2^24, and the scaling by 16 changes no rounding), so the sums and the
// float stage give xt_pass's results bit for bit with one shift less per code vector.
// The one-row Q4_K / Q5_K kernels' scale tables for super-block B (both types keep d, dmin and
// the 12 scale bytes at the same offsets): dw[t] = d * sc_t (odd t: / 16, see xt_q4k_row) and
// mw[t] = -(dmin * m_t), [8][16]. Values as fill_ktables_sb gives them, with fewer vector ops:
// each scale byte is moved to the bottom of its dword by one vpshufb, and -dmin is formed once
// (-(dmin * m) == (-dmin) * m exactly).
template <DType WT, bool PK>
PF_AVX512 PF_INLINE void k45_row_tables(const QCtx& c, int64_t B, float* dw, float* mw) {
  static_assert(WT == DType::Q4_K || WT == DType::Q5_K, "Q4_K / Q5_K scales");
  const __m512 d = ldh<WT, PK>(c, B, 0);
  const __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(1.0f / 16.0f));
  const __m512 nd = neg_ps(ldh<WT, PK>(c, B, 2));
  const __m512i a = ldf<WT, PK, 4>(c, B, 0);  // scales[0..3]
  const __m512i b = ldf<WT, PK, 4>(c, B, 4);  // scales[4..7]
  const __m512i e = ldf<WT, PK, 4>(c, B, 8);  // scales[8..11]
  const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(0x30);
  for (int j = 0; j < 4; ++j) {
    // byte j of each dword to its bottom byte, the other bytes zero (vpshufb indexes its 128-bit lane)
    const __m512i sel = _mm512_set4_epi32((int)(0x8080800Cu + j), (int)(0x80808008u + j), (int)(0x80808004u + j),
                                          (int)(0x80808000u + j));
    const __m512i aj = _mm512_shuffle_epi8(a, sel), bj = _mm512_shuffle_epi8(b, sel), ej = _mm512_shuffle_epi8(e, sel);
    const __m512i sc = _mm512_and_si512(aj, m6), mn = _mm512_and_si512(bj, m6);
    // j + 4: low 4 bits from scales[8 + j], high 2 bits from the top of scales[j] / scales[4 + j]
    const __m512i sc4 = _mm512_ternarylogic_epi32(ej, _mm512_srli_epi32(aj, 2), m4, 0xE4);  // m4 ? ej : aj >> 2
    const __m512i mn4 = _mm512_ternarylogic_epi32(_mm512_srli_epi32(ej, 4), _mm512_srli_epi32(bj, 2), m2, 0xF8);
    _mm512_store_ps(dw + j * 16, _mm512_mul_ps(j & 1 ? d16 : d, _mm512_cvtepi32_ps(sc)));
    _mm512_store_ps(mw + j * 16, _mm512_mul_ps(nd, _mm512_cvtepi32_ps(mn)));
    _mm512_store_ps(dw + (j + 4) * 16, _mm512_mul_ps(j & 1 ? d16 : d, _mm512_cvtepi32_ps(sc4)));
    _mm512_store_ps(mw + (j + 4) * 16, _mm512_mul_ps(nd, _mm512_cvtepi32_ps(mn4)));
  }
}

// The float stage of a block pair (blocks b0, b0 + 1 = super-block blocks t0, t0 + 1) of the
// one-row Q4_K / Q5_K kernels: integer sums ze / zo (the odd one 16 x, see xt_q4k_row) against
// the tables of k45_row_tables, in xt_pass's order.
PF_AVX512 PF_INLINE void k45_pair_out(__m512& acc, const ActQ& a, size_t mo, int64_t b0, int t0, const float* sbt,
                                      __m512i ze, __m512i zo) {
  for (int st = 0; st < 2; ++st) {
    const int t = t0 + st;
    const size_t mi = mo + (size_t)(b0 + st) * 4;
    const __m512 dxw = _mm512_mul_ps(_mm512_set1_ps(a.d[mi]), _mm512_load_ps(sbt + t * 16));
    acc = _mm512_fmadd_ps(dxw, _mm512_cvtepi32_ps(st ? zo : ze), acc);
    acc = _mm512_fmadd_ps(_mm512_load_ps(sbt + 128 + t * 16), _mm512_set1_ps(a.f[mi]), acc);
  }
}

// xt_q4k_row (described above k45_row_tables) is paced by its loads, as xt_q6k_row: the loads
// of each half block pair (256 bytes of codes) wait for the previous half's last load, and each
// half prefetches one block's bytes (288) 12 KiB ahead once that load has arrived. bench_matmul
// --cold, AMD EPYC (Zen 5), against pacing by block pair on its sums with one 576-byte prefetch
// per pair (alternating per batch in one process): 1.06-1.14x at 2 threads (0.99-1.00x in a
// run whose reads met 74-78 GB/s), 0.98-1.02x at 1, from cache 1.01x; pacing by pair on its
// loads 0.89-0.92x at 1 thread (the sums pacing had given 36.2-39.3 GB/s against 31.7-36.1
// unpaced there).
template <bool PK>
PF_AVX512 void xt_q4k_row(const QCtx& c0, const XtBuf& xb, const ActQ& a, int64_t m, const RowView& yv, int64_t n0, int nv) {
  (void)xb;
  QCtx c = c0;  // c.pk carries the pacing zero
  const int64_t nb = c.nb;
  const int8_t* xq = a.q + m * a.K;
  const size_t mo = a.meta(m, 0);
  const __m512i m4 = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8((char)0xF0);
  __m512 acc = _mm512_setzero_ps();
  alignas(64) float sbt[2 * 128];
  for (int64_t B = 0; B < nb / 8; ++B) {
    k45_row_tables<DType::Q4_K, PK>(c, B, sbt, sbt + 128);
    for (int p = 0; p < 4; ++p) {
      const int64_t b0 = B * 8 + 2 * p;
      const int8_t* x = xq + b0 * QK;
      __m512i z0 = _mm512_setzero_si512(), z1 = z0, z2 = z0, z3 = z0;
#pragma GCC unroll 8
      for (int g = 0; g < 8; g += 2) {
        __m512i q[2];
        ldf2<DType::Q4_K, PK, 16>(c, B, 32 * p + 4 * g, q[0], q[1]);
        if (g == 2 || g == 6) {
          const int64_t after = zero_after(q[1]);
          prefetch_blocks<DType::Q4_K, 1>(c0, b0 + (g == 6), after);
          c.pk = c0.pk + after;
        }
        z0 = dpbusd_b4(z0, _mm512_and_si512(q[0], m4), x + 4 * g);
        z1 = dpbusd_b4(z1, _mm512_and_si512(q[0], mf0), x + QK + 4 * g);
        z2 = dpbusd_b4(z2, _mm512_and_si512(q[1], m4), x + 4 * g + 4);
        z3 = dpbusd_b4(z3, _mm512_and_si512(q[1], mf0), x + QK + 4 * g + 4);
      }
      const __m512i ze = _mm512_add_epi32(z0, z2), zo = _mm512_add_epi32(z1, z3);
      k45_pair_out(acc, a, mo, b0, 2 * p, sbt, ze, zo);
    }
  }
  const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
  _mm512_mask_storeu_ps(reinterpret_cast<float*>(yv.row(m)) + n0, mk, acc);
}

// Q5_K, one activation row: as xt_q4k_row for the four bits of a block pair (high nibbles in
// place, the odd block's scale / 16), and the fifth bits as their own vpdpbusd chains: the qh
// byte of an element holds bit j for block j, so (qh & 2^j) against the block's activations sums
// 2^j * (the activations whose bit is set), which a shift brings to 16 x (odd block: 256 x). The
// integer sums equal xt_pass's (odd block: 16 x them, exact as in xt_q4k_row), so the results are
// bit-identical, with no per-block bit extraction.
template <bool PK>
PF_AVX512 void xt_q5k_row(const QCtx& c, const XtBuf& xb, const ActQ& a, int64_t m, const RowView& yv, int64_t n0, int nv) {
  (void)xb;
  const int64_t nb = c.nb;
  const int8_t* xq = a.q + m * a.K;
  const size_t mo = a.meta(m, 0);
  const __m512i m4 = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8((char)0xF0);
  __m512 acc = _mm512_setzero_ps();
  alignas(64) float sbt[2 * 128];
  for (int64_t B = 0; B < nb / 8; ++B) {
    k45_row_tables<DType::Q5_K, PK>(c, B, sbt, sbt + 128);
    // the super-block's fifth bits, read once in memory order (reading them again before each
    // pair's codes sends the hardware prefetchers astray: 7 against 20 GB/s from DRAM, 1 thread)
    __m512i qh[8];
    for (int g = 0; g < 8; g += 2) ldf2<DType::Q5_K, PK, 16>(c, B, 4 * g, qh[g], qh[g + 1]);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const int64_t b0 = B * 8 + 2 * p;
      prefetch_blocks<DType::Q5_K, 2>(c, b0, 0);
      const int8_t* x = xq + b0 * QK;
      const __m512i be = _mm512_set1_epi8((char)(1 << (2 * p))), bo = _mm512_set1_epi8((char)(2 << (2 * p)));
      __m512i z0 = _mm512_setzero_si512(), z1 = z0, z2 = z0, z3 = z0, h0 = z0, h1 = z0, h2 = z0, h3 = z0;
#pragma GCC unroll 8
      for (int g = 0; g < 8; g += 2) {
        __m512i q[2];
        ldf2<DType::Q5_K, PK, 48>(c, B, 32 * p + 4 * g, q[0], q[1]);
        const __m512i xe0 = bcast4(x + 4 * g), xo0 = bcast4(x + QK + 4 * g);
        const __m512i xe1 = bcast4(x + 4 * g + 4), xo1 = bcast4(x + QK + 4 * g + 4);
        z0 = _mm512_dpbusd_epi32(z0, _mm512_and_si512(q[0], m4), xe0);
        z1 = _mm512_dpbusd_epi32(z1, _mm512_and_si512(q[0], mf0), xo0);
        z2 = _mm512_dpbusd_epi32(z2, _mm512_and_si512(q[1], m4), xe1);
        z3 = _mm512_dpbusd_epi32(z3, _mm512_and_si512(q[1], mf0), xo1);
        h0 = _mm512_dpbusd_epi32(h0, _mm512_and_si512(qh[g], be), xe0);
        h1 = _mm512_dpbusd_epi32(h1, _mm512_and_si512(qh[g], bo), xo0);
        h2 = _mm512_dpbusd_epi32(h2, _mm512_and_si512(qh[g + 1], be), xe1);
        h3 = _mm512_dpbusd_epi32(h3, _mm512_and_si512(qh[g + 1], bo), xo1);
      }
      // even block 2p: + 16 / 2^(2p) x its bit sums; odd block: + 256 / 2^(2p+1) x (exact: the
      // sums are multiples of 2^j, and the right shift of p = 3 drops only zero bits)
      const __m512i he = _mm512_add_epi32(h0, h2), ho = _mm512_add_epi32(h1, h3);
      const __m512i hes = p < 2 ? _mm512_slli_epi32(he, 4 - 2 * p) : p == 2 ? he : _mm512_srai_epi32(he, 2);
      const __m512i ze = _mm512_add_epi32(_mm512_add_epi32(z0, z2), hes);
      const __m512i zo = _mm512_add_epi32(_mm512_add_epi32(z1, z3), _mm512_slli_epi32(ho, 7 - 2 * p));
      k45_pair_out(acc, a, mo, b0, 2 * p, sbt, ze, zo);
    }
  }
  const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
  _mm512_mask_storeu_ps(reinterpret_cast<float*>(yv.row(m)) + n0, mk, acc);
}

// Packed Q4_0 / Q4_1 / Q8_0, one activation row: two blocks at a time, their four dot chains side
// by side. Left free, this loop runs far ahead of its data when the weights come from DRAM and
// streams less than the slower K-quant kernels (Q8_0 18-20 GB/s against Q4_K's 25-29 at one
// thread). So it is paced: a step's loads wait for the previous step's sums, and its prefetches
// (12 KiB ahead) for its own codes, through addresses offset by zero_after. Whole model, 1 thread,
// against the generic pass: llama-1b Q8_0 tg 1.21-1.25x, Q4_0 1.16-1.27x. A step is two blocks
// (Q4_0 576 bytes, Q4_1 640), or one for Q8_0 (544): on a Zen 5 host, llama-1b Q8_0 tg64 gained
// 1.18x at 1 thread and 1.25x at 2 over two-block steps, while one-block steps cost Q4_0 a quarter
// of its cold rate. Each block goes through xt_block_dots / xt_block_out as in
// xt_pass<WT, 1, kPacked> (bit-identical).
template <DType WT>
PF_AVX512 void xt_q32_row(const QCtx& c, const XtBuf& xb, const ActQ& a, int64_t m, const RowView& yv, int64_t n0, int nv) {
  constexpr bool kOff = WT == DType::Q8_0 || kOffsetShift<WT> > 0;
  const int64_t nb = c.nb;
  const int64_t blk = 16 * c.bs;  // packed bytes per block
  const int8_t* xq = a.q + m * a.K;
  const size_t mo = a.meta(m, 0);
  auto start = [&](int64_t b) PF_AVX512 {
    return kOff ? _mm512_set1_epi32(xb.o0[mo + (size_t)b * 4 - xb.obase]) : _mm512_setzero_si512();
  };
  __m512 acc = _mm512_setzero_ps();
  int64_t pace = 0;  // zero_after(the previous step's sums)
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i w[8], v[8];
    __m512 dw0, mw0, dw1, mw1;
    const uint8_t* p = c.pk + b * blk + pace;
    const int8_t* x = xq + b * QK;
    __m512i z0 = start(b), z1 = _mm512_setzero_si512(), z2 = start(b + 1), z3 = _mm512_setzero_si512();
    xt_unpack_at<WT>(p, w, dw0, mw0);
    if constexpr (WT == DType::Q8_0) {  // the second block's loads wait for the first one's sums
      prefetch_ahead(c, b * blk, blk, zero_after(w[7]));
      xt_block_dots(w, x, z0, z1);
      xt_unpack_at<WT>(p + blk + zero_after(z1), v, dw1, mw1);
      prefetch_ahead(c, (b + 1) * blk, blk, zero_after(v[7]));
    } else {
      xt_unpack_at<WT>(p + blk, v, dw1, mw1);
      prefetch_ahead(c, b * blk, 2 * blk, zero_after(v[7]));
      xt_block_dots(w, x, z0, z1);
    }
    xt_block_dots(v, x + QK, z2, z3);
    xt_block_out<WT>(acc, a, mo + (size_t)b * 4, dw0, mw0, z0, z1);
    xt_block_out<WT>(acc, a, mo + (size_t)(b + 1) * 4, dw1, mw1, z2, z3);
    pace = zero_after(z3);
  }
  if (b < nb) {  // an odd last block
    __m512i w[8];
    __m512 dw0, mw0;
    xt_unpack_at<WT>(c.pk + b * blk + pace, w, dw0, mw0);
    const int8_t* x = xq + b * QK;
    __m512i z0 = start(b), z1 = _mm512_setzero_si512();
    xt_block_dots(w, x, z0, z1);
    xt_block_out<WT>(acc, a, mo + (size_t)b * 4, dw0, mw0, z0, z1);
  }
  const __mmask16 mk = (__mmask16)((1u << nv) - 1u);
  _mm512_mask_storeu_ps(reinterpret_cast<float*>(yv.row(m)) + n0, mk, acc);
}

template <DType WT, int MODE, bool PK = false>
PF_AVX512 void xt_rows(const QCtx& c, const XtBuf& xb, const ActQ& a, int64_t m, int rm, const RowView& yv, int64_t n0,
                       int nv) {
  switch (rm) {
#define PF_XT_CASE(R) \
  case R: \
    if constexpr (WT == DType::Q6_K && MODE == kDecode && R == 1) { \
      if constexpr (PK) xt_q6k_row(c, xb, a, m, yv, n0, nv); \
      else xt_q6k_row_rm(c, xb, a, m, yv, n0, nv); /* qgemm_t sends only evenly spaced rows */ \
    } \
    else if constexpr (WT == DType::Q4_K && MODE == kDecode && R == 1) xt_q4k_row<PK>(c, xb, a, m, yv, n0, nv); \
    else if constexpr (WT == DType::Q5_K && MODE == kDecode && R == 1) xt_q5k_row<PK>(c, xb, a, m, yv, n0, nv); \
    else if constexpr ((WT == DType::Q4_0 || WT == DType::Q4_1 || WT == DType::Q8_0) && MODE == kPacked && R == 1) \
      xt_q32_row<WT>(c, xb, a, m, yv, n0, nv); \
    else if constexpr (R <= (MODE == kLoad && kIsK<WT> ? kXtLoadRows<WT> : kXtJoin<WT>)) xt_pass<WT, R, MODE, PK>(c, xb, a, m, yv, n0, nv); \
    break;
    PF_XT_CASE(1) PF_XT_CASE(2) PF_XT_CASE(3) PF_XT_CASE(4) PF_XT_CASE(5) PF_XT_CASE(6) PF_XT_CASE(7) PF_XT_CASE(8)
    PF_XT_CASE(9)
#undef PF_XT_CASE
    default: break;
  }
}

// Rows j.m0 .. j.m1: one decoding pass (storing the decoded blocks when more passes follow),
// then passes over the stored blocks.
template <DType WT, bool PK>
PF_AVX512 void xt_decoded_passes(const QJob& j, const QCtx& c, const XtBuf& xb, int nv) {
  constexpr int RX = kXtRows<WT>;
  const int64_t M = j.m1 - j.m0;
  if (j.reuse) {  // decoded by an earlier item of this thread: every row from the scratch
    for (int64_t m = j.m0, rm; m < j.m1; m += rm) {
      rm = xt_load_rows<WT>(j.m1 - m);
      xt_rows<WT, kLoad>(c, xb, j.a, m, (int)rm, j.y, j.n0, nv);
    }
    if (j.stored) *j.stored = true;
    return;
  }
  if (M <= RX || M == kXtJoin<WT>) {
    xt_rows<WT, kDecode, PK>(c, xb, j.a, j.m0, (int)M, j.y, j.n0, nv);
    return;
  }
  xt_pass<WT, RX, kDecodeStore, PK>(c, xb, j.a, j.m0, j.y, j.n0, nv);
  if (j.stored) *j.stored = true;
  for (int64_t m = j.m0 + RX, rm; m < j.m1; m += rm) {
    rm = xt_load_rows<WT>(j.m1 - m);
    xt_rows<WT, kLoad>(c, xb, j.a, m, (int)rm, j.y, j.n0, nv);
  }
}

// Scratch: decoded blocks (nb * 8 vectors), four [nb][16] tables (+16), then the offset tables.
template <DType WT>
PF_AVX512 void qgemm_xt(const QJob& j, QCtx& c, int nv) {
  const int64_t nb = c.nb;
  const ActQ& a = j.a;
  XtBuf xb;
  xb.wt = reinterpret_cast<__m512i*>(j.scratch);
  float* tabs = j.scratch + nb * 128;
  const int64_t tab = nb * 16 + 16;
  xb.dwt = tabs;
  xb.mwt = tabs + tab;
  int32_t* slo = reinterpret_cast<int32_t*>(tabs + 2 * tab);
  int32_t* shi = reinterpret_cast<int32_t*>(tabs + 3 * tab);
  xb.slo = slo;
  xb.shi = shi;
  if constexpr (kIsK<WT>) {  // a single decoding pass fills them per super-block (xt_pass)
    const int64_t M = j.m1 - j.m0;
    if (!j.reuse && !(M <= kXtRows<WT> || M == kXtJoin<WT>)) {
      if (j.packed) fill_ktables_avx512<WT, true>(c, xb.dwt, xb.mwt, slo, shi);
      else fill_ktables_avx512<WT>(c, xb.dwt, xb.mwt, slo, shi);
    }
  }
  // Integer offsets the dot chains start from, in ActQ's meta order (groups of 4 rows):
  // Q4_0 / Q5_0 / Q8_0: -(offset * sx); Q6_K: -32 hx and -32 (sx - hx).
  const int64_t g0 = j.m0 >> 2, g1 = (j.m1 + 3) >> 2;
  xb.obase = (size_t)(g0 * nb) * 4;
  const int64_t n_meta = (g1 - g0) * nb * 4;
  int32_t* o0 = reinterpret_cast<int32_t*>(tabs + 4 * tab);
  int32_t* o1 = o0 + ((n_meta + 15) & ~(int64_t)15);
  xb.o0 = o0;
  xb.o1 = o1;
  c.qh = reinterpret_cast<__m512i*>(((uintptr_t)(o1 + ((n_meta + 15) & ~(int64_t)15)) + 63) & ~(uintptr_t)63);
  if constexpr (WT == DType::Q6_K) {
    const int32_t* sx = a.s + xb.obase;
    const int32_t* hx = a.h + xb.obase;
    for (int64_t k = 0; k < n_meta; k += 16) {
      const __mmask16 mk = n_meta - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n_meta - k)) - 1u);
      const __m512i s = _mm512_maskz_loadu_epi32(mk, sx + k), h = _mm512_maskz_loadu_epi32(mk, hx + k);
      _mm512_mask_storeu_epi32(o0 + k, mk, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(h, 5)));
      _mm512_mask_storeu_epi32(o1 + k, mk, _mm512_slli_epi32(_mm512_sub_epi32(h, s), 5));
    }
  } else if constexpr (WT == DType::Q8_0 || kOffsetShift<WT> > 0) {
    const int32_t* sx = a.s + xb.obase;
    constexpr int sh = WT == DType::Q8_0 ? 7 : kOffsetShift<WT>;
    for (int64_t k = 0; k < n_meta; k += 16) {
      const __mmask16 mk = n_meta - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n_meta - k)) - 1u);
      const __m512i s = _mm512_maskz_loadu_epi32(mk, sx + k);
      _mm512_mask_storeu_epi32(o0 + k, mk, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, sh)));
    }
  }
  if (j.packed && !kIsK<WT>) {  // every pass reads the packed chunk (unpacking it costs less than a scratch copy)
    if constexpr (!kIsK<WT> && WT != DType::Q5_0 && WT != DType::Q5_1) {
      for (int64_t m = j.m0, rm; m < j.m1; m += rm) {
        rm = xt_pass_rows<WT>(j.m1 - m);
        xt_rows<WT, kPacked>(c, xb, a, m, (int)rm, j.y, j.n0, nv);
        c.pf_step = 0;  // the first pass prefetched the chunk after next
      }
    }
    return;
  }
  // K-quants, packed or not: the first pass decodes (from the packed chunk: plain loads), the
  // later ones read the decoded blocks back from the scratch.
  if (j.packed) xt_decoded_passes<WT, true>(j, c, xb, nv);
  else xt_decoded_passes<WT, false>(j, c, xb, nv);
}

template <DType WT>
PF_AVX512 void qgemm_t(const QJob& j) {
  QCtx c;
  const int nv = (int)(j.n1 - j.n0);
  if (j.packed) {  // (packable types only; n0 % 16 == 0 and nv == 16)
    c.nb = j.a.nb;
    c.K = j.a.K;
    c.bs = wblock_bytes(WT);
    c.pk = j.w + j.n0 * j.w_stride;
    // What the kernels prefetch while they read block b: the block at the same place of the chunk
    // after next (into L2), or, for one activation row, the bytes 12 KiB ahead of the block (the
    // packed chunks of a matmul are one forward stream; non-temporal, see prefetch_ahead).
    // 1B-class files, 2 threads, against the chunk after next: tg 1.03-1.10x (Q4_K_M 1.10, Q6_K
    // 1.06, Q4_0 1.05, Q8_0 1.03); 4 KiB ahead was 0.91x, 32 KiB 1.00x.
    constexpr int64_t kAheadBytes = 12 << 10;
    c.pf = j.m1 - j.m0 == 1 ? c.pk + kAheadBytes : c.pk + 32 * j.w_stride;
    c.pf_step = 16 * (kIsK<WT> ? kSuperBytes<WT> / 8 : c.bs);  // the chunk's bytes per 32-block
    qgemm_xt<WT>(j, c, nv);
    return;
  }
  for (int r = 0; r < 16; ++r) c.rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  c.nb = j.a.nb;
  c.K = j.a.K;
  c.bs = wblock_bytes(WT);
  c.rows_stride = nv == 16 ? j.w_stride : 0;
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
  // Block scales of the 16 rows, [b][row] (one gather of the d (and m) fields per block); a
  // single activation row reads them inside the kernel instead (32-block types).
  const int64_t span = (int64_t)(c.rows[15] - c.rows[0]);
  c.gather_ok = span <= INT32_MAX && span >= INT32_MIN;
  if (c.gather_ok) {
    alignas(64) int32_t off[16];
    for (int r = 0; r < 16; ++r) off[r] = (int32_t)(c.rows[r] - c.rows[0]);
    c.offs = _mm512_load_si512(off);
    c.offs_lo = _mm512_castsi512_si256(c.offs);
    c.offs_hi = _mm512_extracti64x4_epi64(c.offs, 1);
  }
  // Two rows of Q5_K are cheaper in the tiles below (its transposed decode costs more).
  if (c.gather_ok && (j.m1 - j.m0 >= (WT == DType::Q5_K ? 3 : 2) || (WT == DType::Q6_K && c.rows_stride > 0))) {
    qgemm_xt<WT>(j, c, nv);
    return;
  }
  const bool single = !kIsK<WT> && j.m1 - j.m0 == 1 && c.gather_ok;
  if constexpr (kIsK<WT>) {
    if (c.gather_ok) fill_ktables_avx512<WT>(c, dwc, mwc, slo, shi);
    else fill_ktables<WT>(c.rows, c.nb, dwc, mwc, slo, shi);
  } else if (single) {
    // nothing to precompute
  } else if (c.gather_ok) {
    for (int64_t b = 0; b < c.nb; ++b) {
      const __m512i g = _mm512_i32gather_epi32(c.offs, c.rows[0] + b * c.bs, 1);
      _mm512_store_ps(dwc + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
      if (kHasMin<WT>)
        _mm512_store_ps(mwc + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
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
  alignas(64) float out[16];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int64_t rem = j.m1 - m;
    const int RM = (rem >= 4 && (m & 3) == 0) ? 4 : (rem >= 2 && (m & 3) <= 2) ? 2 : 1;
    const int NW = 16 / RM;
    for (int jt = 0; jt < nv; jt += NW) {
      if (RM == 4) qtile<WT, 4>(c, j.a, m, jt, out);
      else if (RM == 2) qtile<WT, 2>(c, j.a, m, jt, out);
      else if (single) qtile<WT, 1, !kIsK<WT>>(c, j.a, m, jt, out);
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
  _mm512_storeu_ps(out, lane_sums16(acc));
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
    case DType::Q5_0: qgemm_t<DType::Q5_0>(j); break;
    case DType::Q5_1: qgemm_t<DType::Q5_1>(j); break;
    case DType::Q4_K: qgemm_t<DType::Q4_K>(j); break;
    case DType::Q5_K: qgemm_t<DType::Q5_K>(j); break;
    case DType::Q6_K: qgemm_t<DType::Q6_K>(j); break;
    default: qgemm_scalar(j); break;
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
void quant_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) { quant_act_scalar(x, q, d, s, f, h, nb); }
void qgemm_avx512(const QJob& j) { qgemm_scalar(j); }
void fgemm_avx512(const FJob& j) { fgemm_scalar(j); }
}  // namespace mm
}  // namespace pyfast
#endif
