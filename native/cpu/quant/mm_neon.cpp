// NEON (aarch64) matmul kernels and activation quantizer. The arithmetic per output element is
// the one quant.h fixes, so the results are bit-identical to the scalar path (and to avx2 /
// avx512) for quantized weights, and to scalar / avx512 for float weights (16 lanes).
//
// Quantized weights: a micro-kernel computes RM activation rows x 4 * NV weight rows (16 pairs:
// RM = 4, 2, 1 with NV = 1, 2, 4). Per 32-block each weight row's block is decoded in registers
// to signed int8 codes (quant.h's c, for Q6_K the unscaled q - 32 of each half), multiplied with
// the int8 activations into 4 int32 partials per pair -- sdot (vdotq_s32, the dotprod extension)
// when the CPU has it, else vmull_s8 / vmlal_s8 into int16 (|two products| <= 2 * 128 * 127) and
// vpadalq_s16 -- and a pairwise-add transpose turns the partials of 4 weight rows into one int32x4
// of exact block sums. The float stage is one fma per block (plus one for the min) on those 4
// pairs, in block order, exactly as the scalar kernel does it per pair. A chunk with one
// activation row reads the fp16 block scales inside the kernel (32-block types); otherwise they are
// converted once per chunk into [block][row] tables, and with 8 or more activation rows the weight
// rows are also decoded once per chunk into int8 codes in the job's scratch.
//
// Float weights (F32 / F16 / BF16, widened exactly): 4 pairs per micro-kernel, each with quant.h's
// 16 lanes as 4 float32x4 fma accumulators (the last step zero-padded like the scalar kernel) and
// the same reduction tree, so results equal scalar and avx512 bit for bit.
//
// The dotprod kernels are compiled per function with a target attribute (the library is built for
// the baseline ARMv8-A) and chosen at run time (cpu_features().dotprod: HWCAP_ASIMDDP on Linux,
// sysctl on macOS); neon_use_dotprod(false) forces the plain NEON path (tests cover both).
#if defined(__aarch64__)
#include <arm_neon.h>

#include <atomic>
#include <cstring>

#include "cpu/quant/mm_common.h"
#include "cpu/quant/quant.h"

#if defined(__clang__)
#define PF_DOTPROD __attribute__((target("dotprod")))
#else  // GCC's arm_neon.h declares vdotq_s32 for arch=armv8.2-a+dotprod (the extension needs v8.2)
#define PF_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#define PF_INLINE inline __attribute__((always_inline))

namespace pyfast {
namespace mm {

// ----------------------------------------------------------------------------- activations

void quant_act_neon(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) {
  const float32x4_t lim = vdupq_n_f32(2147483648.0f);
  const int32x4_t hi = vdupq_n_s32(127), lo = vdupq_n_s32(-127);
  for (int64_t b = 0; b < nb; ++b, x += QK, q += QK) {
    float32x4_t v[8];
    for (int i = 0; i < 8; ++i) v[i] = vld1q_f32(x + 4 * i);
    // amax as the scalar loop takes it (a > amax ? a : amax from +0): NaN lanes never enter.
    float32x4_t mx = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; ++i) {
      const float32x4_t a = vabsq_f32(v[i]);
      mx = vbslq_f32(vcgtq_f32(a, mx), a, mx);
    }
    const float amax = vmaxvq_f32(mx);  // no NaN left: any max order gives the same value
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int32x4_t iv[8];
    for (int i = 0; i < 8; ++i) {
      const float32x4_t p = vmulq_n_f32(v[i], id);
      // scalar: round to nearest even; NaN / |p| >= 2^31 -> INT32_MIN, then clamp -> -127.
      const int32x4_t c = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(p), hi), lo);
      iv[i] = vbslq_s32(vcaltq_f32(p, lim), c, lo);
    }
    const int16x8_t p0 = vcombine_s16(vmovn_s32(iv[0]), vmovn_s32(iv[1]));
    const int16x8_t p1 = vcombine_s16(vmovn_s32(iv[2]), vmovn_s32(iv[3]));
    const int16x8_t p2 = vcombine_s16(vmovn_s32(iv[4]), vmovn_s32(iv[5]));
    const int16x8_t p3 = vcombine_s16(vmovn_s32(iv[6]), vmovn_s32(iv[7]));
    vst1q_s8(q, vcombine_s8(vmovn_s16(p0), vmovn_s16(p1)));
    vst1q_s8(q + 16, vcombine_s8(vmovn_s16(p2), vmovn_s16(p3)));
    const int32_t half = vaddvq_s32(vaddq_s32(vaddq_s32(iv[0], iv[1]), vaddq_s32(iv[2], iv[3])));
    const int32_t sum = half + vaddvq_s32(vaddq_s32(vaddq_s32(iv[4], iv[5]), vaddq_s32(iv[6], iv[7])));
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
  const int8_t* codes;      // PRE: the 16 rows decoded (decode<WT>), row r at codes + r * K
  int64_t nb, K;
};

// Bytes of a 32-block (32-block types; wblock_bytes as a constant).
template <DType WT>
constexpr int kBlockBytes = WT == DType::Q4_0 ? 18 : WT == DType::Q4_1 ? 20 : WT == DType::Q5_0 ? 22
                          : WT == DType::Q5_1 ? 24 : WT == DType::Q8_0 ? 34 : 0;

PF_INLINE float32x4_t h2f4(const uint16_t* v) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(v))); }

// 0x10 in byte k where bit k of the 16-bit value (b0 | b1 << 8) is set.
PF_INLINE uint8x16_t bits_to_b4(uint8_t b0, uint8_t b1) {
  static const uint8_t kBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t v = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
  return vandq_u8(vtstq_u8(v, vld1q_u8(kBit)), vdupq_n_u8(0x10));
}

// Block b of a weight row as signed int8 codes: elements 0..15 (lo) and 16..31 (hi). quant.h's c
// for all types but Q6_K, which gives q - 32 (its sub-scales are applied to the half sums).
template <DType WT>
PF_INLINE void decode(const uint8_t* row, int64_t b, int8x16_t& lo, int8x16_t& hi) {
  const uint8x16_t m4 = vdupq_n_u8(0x0F);
  if constexpr (WT == DType::Q8_0) {
    const uint8_t* wb = row + b * 34 + 2;
    lo = vld1q_s8(reinterpret_cast<const int8_t*>(wb));
    hi = vld1q_s8(reinterpret_cast<const int8_t*>(wb + 16));
  } else if constexpr (WT == DType::Q4_0 || WT == DType::Q4_1) {
    const uint8x16_t a = vld1q_u8(row + b * kBlockBytes<WT> + (WT == DType::Q4_1 ? 4 : 2));
    uint8x16_t l = vandq_u8(a, m4), u = vshrq_n_u8(a, 4);
    if constexpr (WT == DType::Q4_0) {
      l = vsubq_u8(l, vdupq_n_u8(8));
      u = vsubq_u8(u, vdupq_n_u8(8));
    }
    lo = vreinterpretq_s8_u8(l);
    hi = vreinterpretq_s8_u8(u);
  } else if constexpr (WT == DType::Q5_0 || WT == DType::Q5_1) {
    constexpr int ho = WT == DType::Q5_1 ? 4 : 2;  // qh; qs follows it
    const uint8_t* wb = row + b * kBlockBytes<WT>;
    const uint8x16_t a = vld1q_u8(wb + ho + 4);
    uint8x16_t l = vorrq_u8(vandq_u8(a, m4), bits_to_b4(wb[ho], wb[ho + 1]));
    uint8x16_t u = vorrq_u8(vshrq_n_u8(a, 4), bits_to_b4(wb[ho + 2], wb[ho + 3]));
    if constexpr (WT == DType::Q5_0) {
      l = vsubq_u8(l, vdupq_n_u8(16));
      u = vsubq_u8(u, vdupq_n_u8(16));
    }
    lo = vreinterpretq_s8_u8(l);
    hi = vreinterpretq_s8_u8(u);
  } else if constexpr (WT == DType::Q4_K || WT == DType::Q5_K) {
    const uint8_t* sb = row + (b >> 3) * kSuperBytes<WT>;
    const int j = (int)(b & 7);
    const uint8_t* qs = sb + (WT == DType::Q4_K ? 16 : 48) + 32 * (j >> 1);
    const int8x16_t sh = vdupq_n_s8((int8_t)(-4 * (j & 1)));
    uint8x16_t l = vandq_u8(vshlq_u8(vld1q_u8(qs), sh), m4);
    uint8x16_t u = vandq_u8(vshlq_u8(vld1q_u8(qs + 16), sh), m4);
    if constexpr (WT == DType::Q5_K) {
      const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << j)), b4 = vdupq_n_u8(0x10);
      l = vorrq_u8(l, vandq_u8(vtstq_u8(vld1q_u8(sb + 16), bit), b4));
      u = vorrq_u8(u, vandq_u8(vtstq_u8(vld1q_u8(sb + 32), bit), b4));
    }
    lo = vreinterpretq_s8_u8(l);
    hi = vreinterpretq_s8_u8(u);
  } else {  // Q6_K
    static_assert(WT == DType::Q6_K, "weight type");
    const uint8_t* sb = row + (b >> 3) * 210;
    const int j = (int)(b & 7);
    const uint8_t* ql = sb + 64 * (j >> 2) + 32 * (j & 1);
    const uint8_t* qh = sb + 128 + 32 * (j >> 2);
    const int8x16_t s1 = vdupq_n_s8((int8_t)(-4 * ((j >> 1) & 1))), s2 = vdupq_n_s8((int8_t)(-2 * (j & 3)));
    const uint8x16_t m2 = vdupq_n_u8(3), o = vdupq_n_u8(32);
    const uint8x16_t l = vorrq_u8(vandq_u8(vshlq_u8(vld1q_u8(ql), s1), m4),
                                  vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(qh), s2), m2), 4));
    const uint8x16_t u = vorrq_u8(vandq_u8(vshlq_u8(vld1q_u8(ql + 16), s1), m4),
                                  vshlq_n_u8(vandq_u8(vshlq_u8(vld1q_u8(qh + 16), s2), m2), 4));
    lo = vreinterpretq_s8_u8(vsubq_u8(l, o));
    hi = vreinterpretq_s8_u8(vsubq_u8(u, o));
  }
}

// Integer dots: 4 int32 partials whose sum is the exact dot (lo . xl + hi . xh, or w . x).
PF_INLINE int32x4_t dot2_plain(int8x16_t wl, int8x16_t wh, int8x16_t xl, int8x16_t xh) {
  int16x8_t a = vmull_s8(vget_low_s8(wl), vget_low_s8(xl));
  a = vmlal_s8(a, vget_low_s8(wh), vget_low_s8(xh));
  int16x8_t c = vmull_high_s8(wl, xl);
  c = vmlal_high_s8(c, wh, xh);
  return vpadalq_s16(vpaddlq_s16(a), c);
}
PF_INLINE int32x4_t dot1_plain(int8x16_t w, int8x16_t x) {
  return vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x))), vmull_high_s8(w, x));
}
PF_DOTPROD PF_INLINE int32x4_t dot2_dp(int8x16_t wl, int8x16_t wh, int8x16_t xl, int8x16_t xh) {
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), wl, xl), wh, xh);
}
PF_DOTPROD PF_INLINE int32x4_t dot1_dp(int8x16_t w, int8x16_t x) { return vdotq_s32(vdupq_n_s32(0), w, x); }

// Lane q = sum of the 4 partials of z[q].
PF_INLINE int32x4_t reduce4(const int32x4_t* z) {
  return vpaddq_s32(vpaddq_s32(z[0], z[1]), vpaddq_s32(z[2], z[3]));
}

// How a micro-kernel gets the weights: kTab decodes blocks in registers and reads the block
// scales from the per-chunk tables; kGather (32-block types, one activation row) also reads the
// fp16 scales from the blocks; kPre reads codes decoded once per chunk (several activation rows).
constexpr int kTab = 0, kGather = 1, kPre = 2;

// The weight scales (and mins) of 4 weight rows at block b.
template <DType WT, bool GATHER>
PF_INLINE void wscales(const QCtx& c, const uint8_t* const* wr, int64_t b, int j0, float32x4_t& dw, float32x4_t& mw) {
  if constexpr (GATHER) {
    constexpr int bs = kBlockBytes<WT>;
    uint16_t dv[4], mv[4];
    for (int r = 0; r < 4; ++r) {
      std::memcpy(&dv[r], wr[r] + b * bs, 2);
      if constexpr (kHasMin<WT>) std::memcpy(&mv[r], wr[r] + b * bs + 2, 2);
    }
    dw = h2f4(dv);
    mw = kHasMin<WT> ? h2f4(mv) : dw;
  } else {
    dw = vld1q_f32(c.dwc + b * 16 + j0);
    mw = kHasMin<WT> ? vld1q_f32(c.mwc + b * 16 + j0) : dw;
  }
}

// RM activation rows from m x 4 * NV weight rows from jt: out[(i * NV + v) * 4 + q] = y[m + i,
// row jt + 4 v + q]. DOT2 / DOT1 pick the integer dot (plain or dotprod); the body is a macro so
// the dotprod version can be compiled with its target attribute (see dot2_dp).
#define PF_NEON_QTILE(NAME, ATTR, DOT2, DOT1)                                                          \
  template <DType WT, int RM, int NV, int MODE>                                                        \
  ATTR void NAME(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {                        \
    const int64_t nb = c.nb;                                                                           \
    const int8_t* xq[RM];                                                                              \
    const float* xd[RM];                                                                               \
    const float* xf[RM];                                                                               \
    for (int i = 0; i < RM; ++i) {                                                                     \
      xq[i] = a.q + (m + i) * a.K;                                                                     \
      const size_t mi = a.meta(m + i, 0);                                                              \
      xd[i] = a.d + mi;                                                                                \
      xf[i] = a.f + mi;                                                                                \
    }                                                                                                  \
    const uint8_t* wr[4 * NV];                                                                         \
    for (int r = 0; r < 4 * NV; ++r) wr[r] = c.rows[jt + r];                                           \
    float32x4_t acc[RM][NV];                                                                           \
    for (int i = 0; i < RM; ++i)                                                                       \
      for (int v = 0; v < NV; ++v) acc[i][v] = vdupq_n_f32(0.0f);                                      \
    for (int64_t b = 0; b < nb; ++b) {                                                                 \
      int8x16_t xl[RM], xh[RM];                                                                        \
      for (int i = 0; i < RM; ++i) {                                                                   \
        xl[i] = vld1q_s8(xq[i] + b * QK);                                                              \
        xh[i] = vld1q_s8(xq[i] + b * QK + 16);                                                         \
      }                                                                                                \
      for (int v = 0; v < NV; ++v) {                                                                   \
        int32x4_t zl[RM][4], zh[RM][4];                                                                \
        for (int q = 0; q < 4; ++q) {                                                                  \
          int8x16_t wl, wh;                                                                            \
          if constexpr (MODE == kPre) {                                                                \
            const int8_t* cp = c.codes + (jt + 4 * v + q) * c.K + b * QK;                              \
            wl = vld1q_s8(cp);                                                                         \
            wh = vld1q_s8(cp + 16);                                                                    \
          } else {                                                                                     \
            decode<WT>(wr[4 * v + q], b, wl, wh);                                                      \
          }                                                                                            \
          for (int i = 0; i < RM; ++i) {                                                               \
            if constexpr (WT == DType::Q6_K) {                                                         \
              zl[i][q] = DOT1(wl, xl[i]);                                                              \
              zh[i][q] = DOT1(wh, xh[i]);                                                              \
            } else {                                                                                   \
              zl[i][q] = DOT2(wl, wh, xl[i], xh[i]);                                                   \
            }                                                                                          \
          }                                                                                            \
        }                                                                                              \
        float32x4_t dw, mw;                                                                            \
        wscales<WT, MODE == kGather>(c, wr + 4 * v, b, jt + 4 * v, dw, mw);                            \
        for (int i = 0; i < RM; ++i) {                                                                 \
          int32x4_t is = reduce4(zl[i]);                                                               \
          if constexpr (WT == DType::Q6_K) {                                                           \
            const int32x4_t sl = vld1q_s32(c.slo + b * 16 + jt + 4 * v);                               \
            const int32x4_t sh = vld1q_s32(c.shi + b * 16 + jt + 4 * v);                               \
            is = vmlaq_s32(vmulq_s32(sl, is), sh, reduce4(zh[i]));                                     \
          }                                                                                            \
          /* acc = fma(dx * dw, (float)isum, acc); acc = fma(mw, fx, acc) (quant.h) */                 \
          acc[i][v] = vfmaq_f32(acc[i][v], vmulq_n_f32(dw, xd[i][b * 4]), vcvtq_f32_s32(is));          \
          if constexpr (kHasMin<WT>) acc[i][v] = vfmaq_n_f32(acc[i][v], mw, xf[i][b * 4]);             \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    for (int i = 0; i < RM; ++i)                                                                       \
      for (int v = 0; v < NV; ++v) vst1q_f32(out + (i * NV + v) * 4, acc[i][v]);                       \
  }

PF_NEON_QTILE(qtile_plain, , dot2_plain, dot1_plain)
PF_NEON_QTILE(qtile_dp, PF_DOTPROD, dot2_dp, dot1_dp)
#undef PF_NEON_QTILE

// 4x4 transpose: c[q] lane r = r_[r] lane q.
PF_INLINE void transpose4(const float32x4_t* r, float32x4_t* c) {
  const float32x4x2_t t01 = vtrnq_f32(r[0], r[1]), t23 = vtrnq_f32(r[2], r[3]);
  c[0] = vcombine_f32(vget_low_f32(t01.val[0]), vget_low_f32(t23.val[0]));
  c[1] = vcombine_f32(vget_low_f32(t01.val[1]), vget_low_f32(t23.val[1]));
  c[2] = vcombine_f32(vget_high_f32(t01.val[0]), vget_high_f32(t23.val[0]));
  c[3] = vcombine_f32(vget_high_f32(t01.val[1]), vget_high_f32(t23.val[1]));
}

// The chunk's [b][16] tables: for 32-block types dw (and mw) from the fp16 fields; for the K-quants
// what fill_ktables (mm_common.h) gives, four rows at a time.
template <DType WT>
void fill_tables(const QCtx& c, float* dw, float* mw, int32_t* slo, int32_t* shi) {
  const int64_t nb = c.nb;
  if constexpr (!kIsK<WT>) {
    constexpr int bs = kBlockBytes<WT>;
    for (int64_t b = 0; b < nb; ++b)
      for (int g = 0; g < 4; ++g) {
        uint16_t dv[4], mv[4];
        for (int r = 0; r < 4; ++r) {
          std::memcpy(&dv[r], c.rows[4 * g + r] + b * bs, 2);
          if constexpr (kHasMin<WT>) std::memcpy(&mv[r], c.rows[4 * g + r] + b * bs + 2, 2);
        }
        vst1q_f32(dw + b * 16 + 4 * g, h2f4(dv));
        if constexpr (kHasMin<WT>) vst1q_f32(mw + b * 16 + 4 * g, h2f4(mv));
      }
  } else if constexpr (WT == DType::Q6_K) {
    for (int64_t B = 0; B < nb / 8; ++B)
      for (int g = 0; g < 4; ++g) {
        uint16_t dv[4];
        float32x4_t sl[2][4], sh[2][4];  // [half of the 8 blocks][row]: sub-scales as f32 bit patterns
        for (int r = 0; r < 4; ++r) {
          const uint8_t* sb = c.rows[4 * g + r] + B * 210;
          std::memcpy(&dv[r], sb + 208, 2);
          const int8x8x2_t sc = vld2_s8(reinterpret_cast<const int8_t*>(sb + 192));  // even / odd
          const int16x8_t e = vmovl_s8(sc.val[0]), o = vmovl_s8(sc.val[1]);
          sl[0][r] = vreinterpretq_f32_s32(vmovl_s16(vget_low_s16(e)));
          sl[1][r] = vreinterpretq_f32_s32(vmovl_high_s16(e));
          sh[0][r] = vreinterpretq_f32_s32(vmovl_s16(vget_low_s16(o)));
          sh[1][r] = vreinterpretq_f32_s32(vmovl_high_s16(o));
        }
        const float32x4_t d = h2f4(dv);
        for (int hf = 0; hf < 2; ++hf) {
          float32x4_t tl[4], th[4];
          transpose4(sl[hf], tl);
          transpose4(sh[hf], th);
          for (int q = 0; q < 4; ++q) {
            const int64_t i = (B * 8 + 4 * hf + q) * 16 + 4 * g;
            vst1q_f32(dw + i, d);
            vst1q_s32(slo + i, vreinterpretq_s32_f32(tl[q]));
            vst1q_s32(shi + i, vreinterpretq_s32_f32(th[q]));
          }
        }
      }
  } else {  // Q4_K / Q5_K: dw = d * sc_j, mw = -(dmin * m_j)
    constexpr int SB = kSuperBytes<WT>;
    static const uint8_t kLo4[8] = {0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0};
    const uint8x8_t lo4 = vld1_u8(kLo4), m63 = vdup_n_u8(63), m15 = vdup_n_u8(15);
    for (int64_t B = 0; B < nb / 8; ++B)
      for (int g = 0; g < 4; ++g) {
        float32x4_t dv[2][4], mv[2][4];  // [blocks 0..3 / 4..7][row]
        for (int r = 0; r < 4; ++r) {
          const uint8_t* sb = c.rows[4 * g + r] + B * SB;
          uint16_t hd[4] = {0, 0, 0, 0};
          std::memcpy(hd, sb, 4);
          const float32x4_t dd = h2f4(hd);
          const float d = vgetq_lane_f32(dd, 0), dmin = vgetq_lane_f32(dd, 1);
          const uint8x8_t a = vld1_u8(sb + 4);   // scales[0..7]
          const uint8x8_t e = vld1_u8(sb + 8);   // scales[4..11]
          // kscale_get: j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4: sc = (s[j + 4] & 15) |
          // (s[j - 4] >> 6) << 4, m = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
          const uint8x8_t sc_hi = vorr_u8(vand_u8(e, m15), vshl_n_u8(vshr_n_u8(vext_u8(a, a, 4), 6), 4));
          const uint8x8_t mn_hi = vorr_u8(vshr_n_u8(e, 4), vshl_n_u8(vshr_n_u8(a, 6), 4));
          const uint16x8_t sc = vmovl_u8(vbsl_u8(lo4, vand_u8(a, m63), sc_hi));
          const uint16x8_t mn = vmovl_u8(vbsl_u8(lo4, vand_u8(e, m63), mn_hi));
          dv[0][r] = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(sc))), d);
          dv[1][r] = vmulq_n_f32(vcvtq_f32_u32(vmovl_high_u16(sc)), d);
          mv[0][r] = vnegq_f32(vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(mn))), dmin));
          mv[1][r] = vnegq_f32(vmulq_n_f32(vcvtq_f32_u32(vmovl_high_u16(mn)), dmin));
        }
        for (int hf = 0; hf < 2; ++hf) {
          float32x4_t td[4], tm[4];
          transpose4(dv[hf], td);
          transpose4(mv[hf], tm);
          for (int q = 0; q < 4; ++q) {
            const int64_t i = (B * 8 + 4 * hf + q) * 16 + 4 * g;
            vst1q_f32(dw + i, td[q]);
            vst1q_f32(mw + i, tm[q]);
          }
        }
      }
  }
}

template <DType WT, bool DP, int RM, int NV, int MODE>
PF_INLINE void qtile(const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  if constexpr (DP) qtile_dp<WT, RM, NV, MODE>(c, a, m, jt, out);
  else qtile_plain<WT, RM, NV, MODE>(c, a, m, jt, out);
}

// The chunk's 16 weight rows decoded to int8 codes (row r at codes + r * K).
template <DType WT>
void predecode(const QCtx& c, int8_t* codes) {
  for (int r = 0; r < 16; ++r)
    for (int64_t b = 0; b < c.nb; ++b) {
      int8x16_t lo, hi;
      decode<WT>(c.rows[r], b, lo, hi);
      vst1q_s8(codes + r * c.K + b * QK, lo);
      vst1q_s8(codes + r * c.K + b * QK + 16, hi);
    }
}

template <DType WT, bool DP, int MODE>
PF_INLINE void qtile_rm(int RM, const QCtx& c, const ActQ& a, int64_t m, int jt, float* out) {
  if (RM == 4) qtile<WT, DP, 4, 1, MODE>(c, a, m, jt, out);
  else if (RM == 2) qtile<WT, DP, 2, 2, MODE>(c, a, m, jt, out);
  else qtile<WT, DP, 1, 4, MODE>(c, a, m, jt, out);
}

template <DType WT, bool DP>
void qgemm_t(const QJob& j) {
  QCtx c;
  const int nv = (int)(j.n1 - j.n0);
  for (int r = 0; r < 16; ++r) c.rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  c.nb = j.a.nb;
  c.K = j.a.K;
  // Scratch: the decoded codes (16 x K bytes, kPre) then four [nb][16] tables (+16 padding each).
  int8_t* codes = reinterpret_cast<int8_t*>(j.scratch);
  c.codes = codes;
  const int64_t tab = c.nb * 16 + 16;  // one [nb][16] table (+ padding)
  float* tabs = j.scratch + 4 * c.K;   // 16 * K bytes
  float* dwc = tabs;
  float* mwc = tabs + tab;
  int32_t* slo = reinterpret_cast<int32_t*>(tabs + 2 * tab);
  int32_t* shi = reinterpret_cast<int32_t*>(tabs + 3 * tab);
  c.dwc = dwc;
  c.mwc = mwc;
  c.slo = slo;
  c.shi = shi;
  // One activation row with a 32-block type reads the block scales inside the kernel; otherwise
  // they are converted once per chunk. With 8 or more activation rows the weights are decoded
  // once per chunk too (each block is otherwise decoded again for every 4-row tile).
  const bool single = !kIsK<WT> && j.m1 - j.m0 == 1;
  const bool pre = j.m1 - j.m0 >= 8;
  if (!single) fill_tables<WT>(c, dwc, mwc, slo, shi);
  if (pre) predecode<WT>(c, codes);
  alignas(16) float out[16];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int64_t rem = j.m1 - m;
    const int RM = rem >= 4 ? 4 : rem >= 2 ? 2 : 1;
    const int NW = 16 / RM;  // weight rows per tile
    for (int jt = 0; jt < nv; jt += NW) {
      if (pre) qtile_rm<WT, DP, kPre>(RM, c, j.a, m, jt, out);
      else if (single) qtile<WT, DP, 1, 4, kIsK<WT> ? kTab : kGather>(c, j.a, m, jt, out);
      else qtile_rm<WT, DP, kTab>(RM, c, j.a, m, jt, out);
      const int nj = nv - jt < NW ? nv - jt : NW;
      for (int i = 0; i < RM; ++i) {
        float* y = reinterpret_cast<float*>(j.y.row(m + i)) + j.n0 + jt;
        const float* o = out + i * NW;
        if (nj == NW) std::memcpy(y, o, (size_t)NW * sizeof(float));
        else
          for (int q = 0; q < nj; ++q) y[q] = o[q];
      }
    }
    m += RM;
  }
}

// ----------------------------------------------------------------------------- float weights

template <DType WT>
PF_INLINE float32x4_t loadw(const uint8_t* row, int64_t k) {
  if constexpr (WT == DType::F32) return vld1q_f32(reinterpret_cast<const float*>(row) + k);
  else if constexpr (WT == DType::F16) return h2f4(reinterpret_cast<const uint16_t*>(row) + k);
  else return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(row) + k), 16));
}

// RM activation rows x NW weight rows (4 pairs, p = i * NW + jj), 16 lanes each: lane k % 16 of
// pair p is lane k % 4 of acc[p][(k % 16) / 4]. Returns lane p = the pair's sum with quant.h's tree.
template <DType WT, int RM, int NW>
float32x4_t ftile(const FJob& j, const uint8_t* const* rows, int64_t m, int jt) {
  static_assert(RM * NW == 4, "4 pairs per tile");
  const int64_t K = j.K;
  const float* xr[RM];
  for (int i = 0; i < RM; ++i) xr[i] = reinterpret_cast<const float*>(j.x.row(m + i));
  const uint8_t* wr[NW];
  for (int jj = 0; jj < NW; ++jj) wr[jj] = rows[jt + jj];
  float32x4_t acc[4][4];
  for (int p = 0; p < 4; ++p)
    for (int q = 0; q < 4; ++q) acc[p][q] = vdupq_n_f32(0.0f);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int q = 0; q < 4; ++q) {
      float32x4_t xv[RM];
      for (int i = 0; i < RM; ++i) xv[i] = vld1q_f32(xr[i] + k + 4 * q);
      for (int jj = 0; jj < NW; ++jj) {
        const float32x4_t wv = loadw<WT>(wr[jj], k + 4 * q);
        for (int i = 0; i < RM; ++i) acc[i * NW + jj][q] = vfmaq_f32(acc[i * NW + jj][q], xv[i], wv);
      }
    }
  }
  if (k < K) {  // the zero-padded last step (as the scalar kernel pads it)
    const int n = (int)(K - k);
    alignas(16) float xt[RM][16], wt[16];
    for (int i = 0; i < RM; ++i)
      for (int l = 0; l < 16; ++l) xt[i][l] = l < n ? xr[i][k + l] : 0.0f;
    for (int jj = 0; jj < NW; ++jj) {
      for (int l = 0; l < 16; ++l) {
        if (l >= n) {
          wt[l] = 0.0f;
          continue;
        }
        if (WT == DType::F32) std::memcpy(&wt[l], wr[jj] + (k + l) * 4, 4);
        else {
          uint16_t hv;
          std::memcpy(&hv, wr[jj] + (k + l) * 2, 2);
          wt[l] = WT == DType::F16 ? fp16_to_fp32(hv) : bf16_to_fp32(hv);
        }
      }
      for (int q = 0; q < 4; ++q) {
        const float32x4_t wv = vld1q_f32(wt + 4 * q);
        for (int i = 0; i < RM; ++i)
          acc[i * NW + jj][q] = vfmaq_f32(acc[i * NW + jj][q], vld1q_f32(xt[i] + 4 * q), wv);
      }
    }
  }
  // Per 4-lane group c of pair p: g = (a0 + a2) + (a1 + a3); then (g0 + g1) + (g2 + g3).
  float32x4_t g[4];
  for (int q = 0; q < 4; ++q) {
    float32x2_t hp[4];
    for (int p = 0; p < 4; ++p) hp[p] = vadd_f32(vget_low_f32(acc[p][q]), vget_high_f32(acc[p][q]));
    g[q] = vpaddq_f32(vcombine_f32(hp[0], hp[1]), vcombine_f32(hp[2], hp[3]));
  }
  return vaddq_f32(vaddq_f32(g[0], g[1]), vaddq_f32(g[2], g[3]));
}

template <DType WT>
void fgemm_t(const FJob& j) {
  const uint8_t* rows[16];
  const int nv = (int)(j.n1 - j.n0);
  for (int r = 0; r < 16; ++r) rows[r] = j.w + (j.n0 + (r < nv ? r : nv - 1)) * j.w_stride;
  alignas(16) float out[4];
  int64_t m = j.m0;
  while (m < j.m1) {
    const int RM = j.m1 - m >= 2 ? 2 : 1;
    const int NW = 4 / RM;
    for (int jt = 0; jt < nv; jt += NW) {
      vst1q_f32(out, RM == 2 ? ftile<WT, 2, 2>(j, rows, m, jt) : ftile<WT, 1, 4>(j, rows, m, jt));
      const int nj = nv - jt < NW ? nv - jt : NW;
      for (int i = 0; i < RM; ++i) {
        float* y = reinterpret_cast<float*>(j.y.row(m + i)) + j.n0 + jt;
        for (int jj = 0; jj < nj; ++jj) y[jj] = out[i * NW + jj];
      }
    }
    m += RM;
  }
}

std::atomic<int> g_dotprod{-1};  // -1: use the CPU's dotprod extension when present

}  // namespace

void neon_use_dotprod(bool on) { g_dotprod.store(on && cpu_features().dotprod ? 1 : 0); }
bool neon_uses_dotprod() {
  const int v = g_dotprod.load(std::memory_order_relaxed);
  return v < 0 ? cpu_features().dotprod : v == 1;
}

void qgemm_neon(const QJob& j) {
  const bool dp = neon_uses_dotprod();
#define PF_Q(T) \
  case DType::T: dp ? qgemm_t<DType::T, true>(j) : qgemm_t<DType::T, false>(j); break;
  switch (j.wt) {
    PF_Q(Q4_0) PF_Q(Q4_1) PF_Q(Q5_0) PF_Q(Q5_1) PF_Q(Q8_0) PF_Q(Q4_K) PF_Q(Q5_K) PF_Q(Q6_K)
    default: qgemm_scalar(j); break;
  }
#undef PF_Q
}

void fgemm_neon(const FJob& j) {
  switch (j.wt) {
    case DType::F32: fgemm_t<DType::F32>(j); break;
    case DType::F16: fgemm_t<DType::F16>(j); break;
    case DType::BF16: fgemm_t<DType::BF16>(j); break;
    default: fgemm_scalar(j); break;
  }
}

}  // namespace mm
}  // namespace pyfast

#else
// Not aarch64: the neon entry points exist (dispatch tables name them) and forward to scalar;
// cpu_isa() is never neon here.
#include "cpu/quant/quant.h"
namespace pyfast {
namespace mm {
void quant_act_neon(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb) {
  quant_act_scalar(x, q, d, s, f, h, nb);
}
void qgemm_neon(const QJob& j) { qgemm_scalar(j); }
void fgemm_neon(const FJob& j) { fgemm_scalar(j); }
void neon_use_dotprod(bool) {}
bool neon_uses_dotprod() { return false; }
}  // namespace mm
}  // namespace pyfast
#endif
