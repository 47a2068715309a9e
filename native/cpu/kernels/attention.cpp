// Fused attention (flash-attention style, online softmax) with grouped-query heads.
//
// Batch invariance: each query row walks the KV cells one at a time in a fixed order (the
// `order` input, or cell order), skipping masked cells entirely, so its result depends only
// on the cells it may see and their order - not on the batch, the padding of n_kv, or how
// cells of other sequences are interleaved. Query rows of one KV head are processed in
// tiles that share each K/V row conversion, with exactly the per-row arithmetic of a tile of 1.
//
// Two definitions of a row's arithmetic, chosen by ISA and head sizes alone (never by the batch):
// - scalar / AVX2: cell by cell, online softmax rescaled whenever a cell raises the maximum;
// - AVX-512 (D % 16 == 0, Dv 16, 32, 64 or 128): blocks of 16 of the row's visible cells,
//   counted along the walk (so a block holds the same cells whatever else is in the cache); per
//   block the 16 scores (each a fixed FMA chain over D, then a fixed lane tree), one rescale to
//   the block's maximum, the 16 weights as one exp, and the V rows accumulated in walk order. The
//   rows of a tile (up to 16) whose visible cells are prefixes of one list share every K/V
//   conversion and work as a small matrix product (scores of a row for 16 cells at once, V rows
//   loaded once for 6 rows). Tiles of 12 or more rows (speculative verify batches; 0 / -inf
//   masks, D <= 128) put the rows in vector lanes instead (attend_lanes_avx512): the same adds,
//   multiplies and exps in the same order per row, so the result is bit for bit that of a row
//   alone, without the per-row cross-lane reductions.
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__)
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* temporaries.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include "cpu/kernels/common.h"
#include "cpu/kernels/lane_sums.h"
#include "cpu/kernels/vexp.h"

namespace pyfast {

namespace {

constexpr int kTile = 8;    // query rows per tile (scalar / AVX2)
constexpr int kTileMax = 16;  // the same, AVX-512 path (all per-tile arrays are this long)
constexpr int kCells = 32;  // KV cells per block (blocked path)

// Dot product with a fixed 8-lane order; the AVX2 and scalar versions differ only in speed
// (they are separate ISAs and need not agree bit for bit).
inline float dot_scalar(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

inline void axpy_scale_scalar(float* acc, float c, const float* v, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] * c + w * v[i];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  for (; i < n; ++i) t[i & 7] += a[i] * b[i];
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

// dot_avx2 of each of the NT query rows q + r * D (D % 8 == 0) with b, into s[r]: the same
// per-lane FMA sequence and the same reduction tree per row, done for the rows together.
// s[r] = the sum of acc[r]'s 8 lanes in dot_avx2's order: x = (t0 + t4, t1 + t5, t2 + t6, t3 + t7),
// then ((x0 + x1) + (x2 + x3)) by two hadds, four rows at a time.
template <int NT>
__attribute__((target("avx2,fma,f16c"))) inline void row_sums_avx2(const __m256* acc, float* s) {
  __m128 x[(NT + 3) & ~3];
  for (int r = 0; r < NT; ++r) x[r] = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
  for (int r = NT; r < ((NT + 3) & ~3); ++r) x[r] = _mm_setzero_ps();
  alignas(16) float t[(NT + 3) & ~3];
  for (int r = 0; r < NT; r += 4)
    _mm_store_ps(t + r, _mm_hadd_ps(_mm_hadd_ps(x[r], x[r + 1]), _mm_hadd_ps(x[r + 2], x[r + 3])));
  for (int r = 0; r < NT; ++r) s[r] = t[r];
}

template <int NT>
__attribute__((target("avx2,fma,f16c"))) inline void dots_avx2(const float* q, const float* b, int64_t D, float* s) {
  __m256 acc[NT];
  for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 bv = _mm256_loadu_ps(b + i);
    for (int r = 0; r < NT; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + i), bv, acc[r]);
  }
  row_sums_avx2<NT>(acc, s);
}

// The scores of a block of nc cells with F16 K rows (kp[c]) for NT query rows, into s[c * kTile
// + r]: dots_avx2 on the widened rows, bit for bit (widening is exact), but widened in registers
// and with the loop over cells inside (no per-cell call, no K row buffer).
template <int NT>
__attribute__((target("avx2,fma,f16c"))) void block_scores_f16(const float* q, const uint16_t* const* kp, int nc,
                                                                int64_t D, float* s) {
  for (int c = 0; c < nc; ++c) {
    const uint16_t* k = kp[c];
    __m256 acc[NT];
    for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 bv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i)));
      for (int r = 0; r < NT; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + i), bv, acc[r]);
    }
    row_sums_avx2<NT>(acc, s + c * kTile);
  }
}

__attribute__((target("avx2,fma,f16c"))) void block_scores_f16_any(const float* q, int nt, const uint16_t* const* kp,
                                                                    int nc, int64_t D, float* s) {
  switch (nt) {
    case 1: block_scores_f16<1>(q, kp, nc, D, s); break;
    case 2: block_scores_f16<2>(q, kp, nc, D, s); break;
    case 3: block_scores_f16<3>(q, kp, nc, D, s); break;
    case 4: block_scores_f16<4>(q, kp, nc, D, s); break;
    case 5: block_scores_f16<5>(q, kp, nc, D, s); break;
    case 6: block_scores_f16<6>(q, kp, nc, D, s); break;
    case 7: block_scores_f16<7>(q, kp, nc, D, s); break;
    default: block_scores_f16<8>(q, kp, nc, D, s); break;
  }
}

// Widen nc F16 V rows (vp[c], Dv % 8 == 0) into out[c * Dv ..].
__attribute__((target("avx2,fma,f16c"))) void block_widen_f16(const uint16_t* const* vp, int nc, int64_t Dv, float* out) {
  for (int c = 0; c < nc; ++c)
    for (int64_t i = 0; i < Dv; i += 8)
      _mm256_storeu_ps(out + c * Dv + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vp[c] + i))));
}

__attribute__((target("avx2,fma,f16c"))) void dots_any_avx2(const float* q, int nt, const float* b, int64_t D, float* s) {
  switch (nt) {
    case 1: dots_avx2<1>(q, b, D, s); break;
    case 2: dots_avx2<2>(q, b, D, s); break;
    case 3: dots_avx2<3>(q, b, D, s); break;
    case 4: dots_avx2<4>(q, b, D, s); break;
    case 5: dots_avx2<5>(q, b, D, s); break;
    case 6: dots_avx2<6>(q, b, D, s); break;
    case 7: dots_avx2<7>(q, b, D, s); break;
    default: dots_avx2<8>(q, b, D, s); break;
  }
}

// One query row's online-softmax updates over a block of nc cells (cells c: score s[c * kTile]
// before the mask, V row v + c * Dv, mask mk[c]), with the row's accumulator (NV * 8 = Dv
// floats) in registers: per cell exactly the steps of the cell-by-cell loop (running max m,
// weight e = exp(m - s) when s raises the max, else exp(s - m)). The running maxima only need
// compares, so they are found first and all of the block's exponentials are then taken eight at
// a time (exp_f32x8 equals the loop's exp_f32 bit for bit).
template <int NV>
__attribute__((target("avx2,fma,f16c"))) void row_update_avx2(float* acc, float& m, float& l, const float* s,
                                                               const float* mk, const float* v, int nc) {
  constexpr int Dv = NV * 8;
  const float ninf = -std::numeric_limits<float>::infinity();
  alignas(32) float arg[kCells + 8], e[kCells + 8];
  int cell[kCells];
  bool up[kCells];
  int n = 0;
  float mm = m;
  for (int c = 0; c < nc; ++c) {
    if (mk[c] == ninf) continue;
    const float sc = s[c * kTile] + mk[c];
    up[n] = sc > mm;
    arg[n] = up[n] ? mm - sc : sc - mm;  // -inf on the first cell: weight 0
    if (up[n]) mm = sc;
    cell[n++] = c;
  }
  for (int k = 0; k < n; k += 8) _mm256_store_ps(e + k, exp_f32x8(_mm256_load_ps(arg + k)));
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int k = 0; k < n; ++k) {
    const float* vr = v + cell[k] * Dv;
    const __m256 ve = _mm256_set1_ps(e[k]);
    if (up[k]) {
      l = l * e[k] + 1.0f;
      for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(one, _mm256_loadu_ps(vr + 8 * i), _mm256_mul_ps(a[i], ve));
    } else {
      l += e[k];
      for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(ve, _mm256_loadu_ps(vr + 8 * i), a[i]);
    }
  }
  m = mm;
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

__attribute__((target("avx2,fma,f16c"))) void axpy_scale_avx2(float* acc, float c, const float* v, float w, int64_t n) {
  const __m256 vc = _mm256_set1_ps(c), vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_loadu_ps(acc + i), vc)));
  for (; i < n; ++i) acc[i] = acc[i] * c + w * v[i];
}

// axpy_scale_avx2 with c = 1 (acc * 1 is acc exactly, so the product is skipped).
__attribute__((target("avx2,fma,f16c"))) void axpy_avx2(float* acc, const float* v, float w, int64_t n) {
  const __m256 vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  for (; i < n; ++i) acc[i] = acc[i] + w * v[i];
}

__attribute__((target("avx2,fma,f16c"))) void f16_to_f32_avx2(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) d[i] = fp16_to_fp32(s[i]);
}
#endif

#if defined(__x86_64__)
#define PF_A512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

constexpr int kBlk = 16;  // visible cells per block (AVX-512 path)

// The sum of a block's 16 weights by one fixed tree, spelled out (attend_lanes_avx512 repeats it
// on whole vectors, so it must not be left to a compiler's _mm512_reduce_add_ps): lanes i + i+8,
// then i + i+4, then i + i+2, then the last two.
PF_A512 inline float sum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                                 _mm512_castps512_ps256(v));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

// Scores of one (scaled) query row with the 16 K rows kf[c * D] (f32): per cell the products of
// the 16-float slices summed lane-wise in order over D, then lane_sums16.
template <int ND>
PF_A512 inline __m512 scores16(const float* q, const float* kf) {
  constexpr int D = ND * 16;
  __m512 a[kBlk];
  if constexpr (ND <= 8) {
    __m512 qv[ND];
    for (int i = 0; i < ND; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
    for (int c = 0; c < kBlk; ++c) {
      a[c] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kf + c * D));
      for (int i = 1; i < ND; ++i) a[c] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kf + c * D + 16 * i), a[c]);
    }
  } else {
    for (int c = 0; c < kBlk; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kf + c * D));
    for (int i = 1; i < ND; ++i) {
      const __m512 qi = _mm512_loadu_ps(q + 16 * i);
      for (int c = 0; c < kBlk; ++c) a[c] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(kf + c * D + 16 * i), a[c]);
    }
  }
  return lane_sums16(a);
}

PF_A512 inline __m512 scores16_any(const float* q, const float* kf, int64_t D) {
  switch (D / 16) {
    case 1: return scores16<1>(q, kf);
    case 2: return scores16<2>(q, kf);
    case 3: return scores16<3>(q, kf);
    case 4: return scores16<4>(q, kf);
    case 5: return scores16<5>(q, kf);
    case 6: return scores16<6>(q, kf);
    case 7: return scores16<7>(q, kf);
    case 8: return scores16<8>(q, kf);
    case 12: return scores16<12>(q, kf);
    default: return scores16<16>(q, kf);
  }
}

// acc[r] = acc[r] * corr[r] + sum over cells c < nc (in order) of p[r][c] * V row c, for R rows
// (accumulators in registers; each V row is loaded once for all of them).
// p[r][c * PS]: a row's weights are contiguous (PS = 1) or one per 16 floats (PS = 16, the
// rows-in-lanes layout of attend_lanes_avx512).
template <int NV, int R, int PS = 1>
PF_A512 inline void pv_rows(float* const* acc, const float* const* p, const float* corr, const float* vf, int nc) {
  constexpr int Dv = NV * 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * i), cr);
  }
  for (int c = 0; c < nc; ++c) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = _mm512_loadu_ps(vf + c * Dv + 16 * i);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r][c * PS]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(w, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[r] + 16 * i, a[r][i]);
}

template <int NV, int PS = 1>
PF_A512 void pv_all(float* const* acc, const float* const* p, const float* corr, const float* vf, int nc, int n) {
  constexpr int RM = NV <= 2 ? 8 : NV == 4 ? 6 : 2;
  int r = 0;
  for (; r + RM <= n; r += RM) pv_rows<NV, RM, PS>(acc + r, p + r, corr + r, vf, nc);
  // the rest together (one row alone is a chain of nc dependent FMAs per accumulator)
  switch (n - r) {
    case 0: break;
    case 1: pv_rows<NV, 1, PS>(acc + r, p + r, corr + r, vf, nc); break;
    case 2: if constexpr (RM > 2) pv_rows<NV, 2, PS>(acc + r, p + r, corr + r, vf, nc); break;
    case 3: if constexpr (RM > 3) pv_rows<NV, 3, PS>(acc + r, p + r, corr + r, vf, nc); break;
    case 4: if constexpr (RM > 4) pv_rows<NV, 4, PS>(acc + r, p + r, corr + r, vf, nc); break;
    case 5: if constexpr (RM > 5) pv_rows<NV, 5, PS>(acc + r, p + r, corr + r, vf, nc); break;
    case 6: if constexpr (RM > 6) pv_rows<NV, 6, PS>(acc + r, p + r, corr + r, vf, nc); break;
    default: if constexpr (RM > 7) pv_rows<NV, 7, PS>(acc + r, p + r, corr + r, vf, nc); break;
  }
}

// A Q8_0 row (blocks of 32: d (f16) then 32 int8) widened as x = d * q, the value row_to_f32
// gives. Kept out of line so that widen_row's F16 / F32 body stays as small as before.
PF_A512 __attribute__((noinline)) void widen_row_q8_0(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const uint8_t* blk = src + 34 * b;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    for (int h = 0; h < 2; ++h) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h));
      _mm512_storeu_ps(dst + 32 * b + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
    }
  }
}

PF_A512 inline void widen_row(const Node* t, const uint8_t* src, float* dst, int64_t n) {
  if (t->dtype == DType::F16) {
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i))));
  } else if (t->dtype == DType::F32) {
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(reinterpret_cast<const float*>(src) + i));
  } else {
    widen_row_q8_0(src, dst, n);
  }
}

// One group of query rows (of KV head hk) whose visible cells are the first len[r] entries of
// the walk list U[0..nU): the blocked AVX-512 arithmetic described at the top of the file.
// q: the rows' scaled queries [n][D]; acc [n][Dv], m, l: the rows' state (started at 0, -inf, 0).
PF_A512 void attend_group_avx512(const Node* K, const Node* V, int64_t hk, const int32_t* U, int64_t nU, int n,
                                 const float* q, const int64_t* len, const float* const* mrow, bool soft, int64_t D,
                                 int64_t Dv, float* kf, float* vf, float* pbuf, float* acc, float* m, float* l) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b0 = 0; b0 < nU; b0 += kBlk) {
    const int nc = (int)std::min<int64_t>(kBlk, nU - b0);
    for (int c = 0; c < nc; ++c) {
      const int64_t j = U[b0 + c];
      widen_row(K, K->data + j * K->shape.strides[0] + hk * K->shape.strides[1], kf + c * D, D);
      widen_row(V, V->data + j * V->shape.strides[0] + hk * V->shape.strides[1], vf + c * Dv, Dv);
    }
    for (int c = nc; c < kBlk; ++c) std::memset(kf + c * D, 0, (size_t)D * 4);
    float* accp[kTileMax];
    const float* pp[kTileMax];
    float corr[kTileMax];
    int na = 0;
    for (int r = 0; r < n; ++r) {
      if (len[r] <= b0) continue;  // no visible cell left: no update at all
      const int nv = (int)std::min<int64_t>(kBlk, len[r] - b0);
      const __mmask16 vis = (__mmask16)((1u << nv) - 1u);
      __m512 s = scores16_any(q + r * D, kf, D);
      if (soft) {
        alignas(64) float mk[kBlk] = {};
        for (int c = 0; c < nv; ++c) mk[c] = mrow[r][U[b0 + c]];
        s = _mm512_add_ps(s, _mm512_load_ps(mk));
      }
      s = _mm512_mask_mov_ps(_mm512_set1_ps(ninf), vis, s);
      const float mn = std::max(m[r], _mm512_reduce_max_ps(s));
      const __m512 w = exp_f32x16(_mm512_sub_ps(s, _mm512_set1_ps(mn)));
      const float cr = m[r] == mn ? 1.0f : exp_f32(m[r] - mn);  // exp_f32(0) is 1; 0 on the first block
      l[r] = std::fma(l[r], cr, sum16(w));
      m[r] = mn;
      _mm512_storeu_ps(pbuf + r * kBlk, w);
      accp[na] = acc + r * Dv;
      pp[na] = pbuf + r * kBlk;
      corr[na++] = cr;
    }
    switch (Dv / 16) {
      case 1: pv_all<1>(accp, pp, corr, vf, nc, na); break;
      case 2: pv_all<2>(accp, pp, corr, vf, nc, na); break;
      case 4: pv_all<4>(accp, pp, corr, vf, nc, na); break;
      default: pv_all<8>(accp, pp, corr, vf, nc, na); break;
    }
  }
}

// attend_group_avx512 for up to 16 rows at once with row r in lane r: the same arithmetic per row,
// bit for bit, laid out so that nothing is reduced across lanes. (0 / -inf masks only.)
// - Scores: lane l of scores16's accumulator for cell c is a chain over i of q[16i + l] * k[16i + l];
//   here A_l (one vector: the rows) is that chain with the rows' queries transposed (qt[d][16]) and
//   k[d] broadcast. lane_sums16 adds the 16 lanes as ((g0 + g1) + (g2 + g3)) with
//   g_k = (A_4k + A_4k+2) + (A_4k+1 + A_4k+3): the same adds, done on whole vectors.
// - Softmax: the block maximum over cells is a max over 16 vectors (max is exact in any order);
//   the weights' sum follows sum16's tree (halves, then quarters, then pairs); the
//   rescale exp_f32x16 equals exp_f32 lane for lane.
// - V: pv_rows with the weights read at a stride of 16 (P^T, cell-major).
// Rows whose visible cells end before a block take no part in it (as in attend_group_avx512).
// Scratch: qt [D][16], pb [8][16][16] pair sums, pt [16][16] weights (cell-major).
template <int ND, int NV>
PF_A512 void attend_lanes_avx512(const Node* K, const Node* V, int64_t hk, const int32_t* U, int64_t nU, int n,
                                 const float* q, const int64_t* len, float* kf, float* vf, float* qt, float* pb,
                                 float* pt, float* acc, float* m, float* l) {
  constexpr int D = ND * 16, Dv = NV * 16;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __mmask16 live = (__mmask16)((1u << n) - 1u);
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < 16; ++r) qt[d * 16 + r] = r < n ? q[r * D + d] : 0.0f;
  alignas(64) int32_t lens[16];
  for (int r = 0; r < 16; ++r) lens[r] = r < n ? (int32_t)len[r] : 0;
  const __m512i lenv = _mm512_load_si512(lens);
  __m512 mv = _mm512_mask_loadu_ps(ninf, live, m);
  __m512 lv = _mm512_maskz_loadu_ps(live, l);
  for (int64_t b0 = 0; b0 < nU; b0 += kBlk) {
    const int nc = (int)std::min<int64_t>(kBlk, nU - b0);
    const __mmask16 act = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32((int32_t)b0)) & live;
    if (!act) continue;
    for (int c = 0; c < nc; ++c) {
      const int64_t j = U[b0 + c];
      widen_row(K, K->data + j * K->shape.strides[0] + hk * K->shape.strides[1], kf + c * D, D);
      widen_row(V, V->data + j * V->shape.strides[0] + hk * V->shape.strides[1], vf + c * Dv, Dv);
    }
    // pair sums pb[(2k + h) * 256 + c * 16] = A_{4k+h} + A_{4k+h+2} of cell c (h = 0, 1)
    for (int k = 0; k < 4; ++k) {
      for (int h = 0; h < 2; ++h) {
        const int l0 = 4 * k + h, l1 = l0 + 2;
        __m512 q0[ND], q1[ND];
        for (int i = 0; i < ND; ++i) {
          q0[i] = _mm512_loadu_ps(qt + (16 * i + l0) * 16);
          q1[i] = _mm512_loadu_ps(qt + (16 * i + l1) * 16);
        }
        float* out = pb + (2 * k + h) * 256;
        for (int c = 0; c < nc; ++c) {
          const float* kc = kf + c * D;
          __m512 a0 = _mm512_mul_ps(q0[0], _mm512_set1_ps(kc[l0]));
          __m512 a1 = _mm512_mul_ps(q1[0], _mm512_set1_ps(kc[l1]));
          for (int i = 1; i < ND; ++i) {
            a0 = _mm512_fmadd_ps(q0[i], _mm512_set1_ps(kc[16 * i + l0]), a0);
            a1 = _mm512_fmadd_ps(q1[i], _mm512_set1_ps(kc[16 * i + l1]), a1);
          }
          _mm512_storeu_ps(out + c * 16, _mm512_add_ps(a0, a1));
        }
      }
    }
    __m512 S[kBlk];
    __mmask16 vis[kBlk];
    __m512 mx = ninf;
    for (int c = 0; c < kBlk; ++c) {
      if (c >= nc) { S[c] = ninf; vis[c] = 0; continue; }
      __m512 g[4];
      for (int k = 0; k < 4; ++k)
        g[k] = _mm512_add_ps(_mm512_loadu_ps(pb + (2 * k) * 256 + c * 16), _mm512_loadu_ps(pb + (2 * k + 1) * 256 + c * 16));
      const __m512 sc = _mm512_add_ps(_mm512_add_ps(g[0], g[1]), _mm512_add_ps(g[2], g[3]));
      vis[c] = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32((int32_t)(b0 + c))) & act;
      S[c] = _mm512_mask_mov_ps(ninf, vis[c], sc);
      mx = _mm512_max_ps(mx, S[c]);
    }
    // std::max(m, block max); inactive lanes keep m
    const __m512 mn = _mm512_mask_mov_ps(mv, _mm512_cmp_ps_mask(mv, mx, _CMP_LT_OQ) & act, mx);
    // masked lanes: exp(-inf) is 0; they take exp(0) and are zeroed instead (an underflowing exp
    // costs a microcode assist per lane)
    __m512 w[kBlk];
    for (int c = 0; c < kBlk; ++c) {
      w[c] = _mm512_maskz_mov_ps(vis[c], exp_f32x16(_mm512_maskz_sub_ps(vis[c], S[c], mn)));
      // stored here: as a loop of its own after this one, GCC made it a memcpy from the stack
      // (rep movsq; storing here made 17-row tiles about 7% faster)
      _mm512_storeu_ps(pt + c * 16, w[c]);
    }
    __m512 t3[8], t6[4];
    for (int i = 0; i < 8; ++i) t3[i] = _mm512_add_ps(w[i + 8], w[i]);
    for (int i = 0; i < 4; ++i) t6[i] = _mm512_add_ps(t3[i + 4], t3[i]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
    // cr = 1 where m == mn, else exp(m - mn) (0 on a row's first block: m = -inf)
    const __mmask16 resc = act & _mm512_cmp_ps_mask(mv, mn, _CMP_NEQ_UQ);
    const __mmask16 first = resc & _mm512_cmp_ps_mask(mv, ninf, _CMP_EQ_OQ);
    const __mmask16 live_r = resc & ~first;
    __m512 cr = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), live_r, exp_f32x16(_mm512_maskz_sub_ps(live_r, mv, mn)));
    cr = _mm512_mask_mov_ps(cr, first, _mm512_setzero_ps());
    lv = _mm512_mask_mov_ps(lv, act, _mm512_fmadd_ps(lv, cr, sum));
    mv = _mm512_mask_mov_ps(mv, act, mn);
    alignas(64) float crs[16];
    _mm512_store_ps(crs, cr);
    float* accp[kTileMax];
    const float* pp[kTileMax];
    float corr[kTileMax];
    int na = 0;
    for (int r = 0; r < n; ++r) {
      if (!((act >> r) & 1u)) continue;
      accp[na] = acc + r * Dv;
      pp[na] = pt + r;
      corr[na++] = crs[r];
    }
    pv_all<NV, 16>(accp, pp, corr, vf, nc, na);
  }
  _mm512_mask_storeu_ps(m, live, mv);
  _mm512_mask_storeu_ps(l, live, lv);
}

template <int ND>
PF_A512 void attend_lanes_nd(const Node* K, const Node* V, int64_t hk, const int32_t* U, int64_t nU, int n,
                             const float* q, const int64_t* len, int64_t Dv, float* kf, float* vf, float* qt, float* pb,
                             float* pt, float* acc, float* m, float* l) {
  switch (Dv / 16) {
    case 1: attend_lanes_avx512<ND, 1>(K, V, hk, U, nU, n, q, len, kf, vf, qt, pb, pt, acc, m, l); break;
    case 2: attend_lanes_avx512<ND, 2>(K, V, hk, U, nU, n, q, len, kf, vf, qt, pb, pt, acc, m, l); break;
    case 4: attend_lanes_avx512<ND, 4>(K, V, hk, U, nU, n, q, len, kf, vf, qt, pb, pt, acc, m, l); break;
    default: attend_lanes_avx512<ND, 8>(K, V, hk, U, nU, n, q, len, kf, vf, qt, pb, pt, acc, m, l); break;
  }
}

// The rows-in-lanes form exists for D / 16 <= 8 (its pair chains keep 2 * D / 16 query vectors in
// registers); it pays once a tile has this many rows (a tile's cost is nearly that of 16 rows).
constexpr int kLanesMinRows = 12;
inline bool lanes_ok(int64_t D) { return D / 16 >= 1 && D / 16 <= 8; }

PF_A512 void attend_lanes(const Node* K, const Node* V, int64_t hk, const int32_t* U, int64_t nU, int n, const float* q,
                          const int64_t* len, int64_t D, int64_t Dv, float* kf, float* vf, float* qt, float* pb,
                          float* pt, float* acc, float* m, float* l) {
  switch (D / 16) {
    case 1: attend_lanes_nd<1>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    case 2: attend_lanes_nd<2>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    case 3: attend_lanes_nd<3>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    case 4: attend_lanes_nd<4>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    case 5: attend_lanes_nd<5>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    case 6: attend_lanes_nd<6>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    case 7: attend_lanes_nd<7>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
    default: attend_lanes_nd<8>(K, V, hk, U, nU, n, q, len, Dv, kf, vf, qt, pb, pt, acc, m, l); break;
  }
}
#endif

struct Kern {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float*, float, const float*, float, int64_t);
  bool avx2;
};

inline void load_row(const Node* t, const uint8_t* p, float* out, int64_t n, bool avx2) {
  if (t->dtype == DType::F32) { std::memcpy(out, p, (size_t)n * 4); return; }
  if (t->dtype == DType::Q8_0) { row_to_f32(t->dtype, p, out, n); return; }
#if defined(__x86_64__)
  if (avx2) { f16_to_f32_avx2(reinterpret_cast<const uint16_t*>(p), out, n); return; }
#endif
  (void)avx2;
  const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(s[i]);
}

}  // namespace

namespace {
// The AVX-512 path's walk list of a tile (cells visible to any of its tokens, in walk order) is
// the same for every KV head and every layer of one plan run: the mask and order inputs are
// shared. Each thread keeps the lists it made in this run, keyed by the tile's tokens.
struct WalkEntry {
  uint64_t run_id = 0;
  const void* mask = nullptr;
  const void* order = nullptr;
  int64_t n_kv = -1, tok0 = -1, tok1 = -1;
  int64_t nU = 0;
  bool compat = false, soft = false;
  int64_t ulen[kTileMax] = {};
  std::vector<int32_t> list;
};
constexpr int kWalkCache = 16;
thread_local WalkEntry t_walks[kWalkCache];
thread_local unsigned t_walk_next = 0;  // round-robin victim once every slot holds this run's lists

// The rows-in-lanes path's scratch (attend_lanes_avx512): qt [D][16], pb [8][16][16], pt [16][16].
constexpr int64_t kLanesFloats(int64_t D) { return D * 16 + 8 * 256 + 256 + 16; }

// Floats of one thread's scratch: kCells K rows, kCells V rows, kTileMax accumulators, kTileMax query
// copies, the [kCells][kTile] scores and kCells mask values of a block. The AVX-512 path also keeps
// the walk list of a tile (n_kv int32), kTileMax x 16 weights and the rows-in-lanes scratch.
inline size_t per_thread_floats(int64_t D, int64_t Dv, int64_t n_kv) {
  return (size_t)(kCells * (D + Dv) + kTileMax * Dv + kTileMax * D + kCells * kTile + kCells + 64 + n_kv + kTileMax * 16 + 16 +
                  kLanesFloats(D));
}
}  // namespace

size_t cpu_attention_work_size(const Node& dst, const Node* const* src, int nth) {
  (void)dst;
  const int64_t D = src[0]->shape.dims[2], Dv = src[2]->shape.dims[2];
  return (size_t)nth * per_thread_floats(D, Dv, src[1]->shape.dims[0]) * sizeof(float);
}

void cpu_attention(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* Q = src[0];
  const Node* K = src[1];
  const Node* V = src[2];
  const Node* M = src[3];
  const Node* O = dst.n_src > 4 ? src[4] : nullptr;
  const float scale = dst.params.f[0];
  const int64_t T = Q->shape.dims[0], Hq = Q->shape.dims[1], D = Q->shape.dims[2];
  const int64_t n_kv = K->shape.dims[0], Hkv = K->shape.dims[1], Dv = V->shape.dims[2];
  const int64_t group = Hq / Hkv;

  Kern kern{dot_scalar, axpy_scale_scalar, false};
#if defined(__x86_64__)
  if (p.isa != CpuIsa::scalar) kern = Kern{dot_avx2, axpy_scale_avx2, true};
#endif

  float* w = reinterpret_cast<float*>(p.wdata) + (size_t)p.ith * per_thread_floats(D, Dv, n_kv);
  float* krow = w;                      // [kCells][D]
  float* vrow = krow + kCells * D;      // [kCells][Dv]
  float* acc = vrow + kCells * Dv;      // [kTileMax][Dv]
  float* qbuf = acc + kTileMax * Dv;    // [kTileMax][D]
  float* sbuf = qbuf + kTileMax * D;    // [kCells][kTile]
  float* mkb = sbuf + kCells * kTile;   // [kCells]
  float* pbuf = mkb + kCells + 64;      // [kTileMax][16] (AVX-512 path)
  int32_t* ulist = reinterpret_cast<int32_t*>(pbuf + kTileMax * 16 + 16);  // [n_kv] (AVX-512 path)
  float* lanes = reinterpret_cast<float*>(ulist + n_kv);  // kLanesFloats(D) (AVX-512 rows-in-lanes path)

  // AVX-512 path: see the top of the file (its own arithmetic, so it is chosen by ISA and
  // shapes only).
  const bool a512 = p.isa == CpuIsa::avx512 && D % 16 == 0 && D <= 256 && (D / 16 <= 8 || D / 16 == 12 || D / 16 == 16) &&
                    (Dv == 16 || Dv == 32 || Dv == 64 || Dv == 128) &&
                    (K->dtype == DType::F16 || K->dtype == DType::F32 || K->dtype == DType::Q8_0) &&
                    (V->dtype == DType::F16 || V->dtype == DType::F32 || V->dtype == DType::Q8_0);
  // Work items: (kv head, tile of query rows); query rows are (token, head in group). Tiles are
  // smaller than kTile (kTileMax on the AVX-512 path) when that is needed for at least 3 items per thread (a short batch has
  // few rows per head); results do not depend on the tiling.
  const int64_t rows_per_head = T * group;
  const int64_t want = 3 * (int64_t)p.nth;
  int64_t tile = (rows_per_head * Hkv + want - 1) / want;
  const int64_t tile_cap = a512 ? kTileMax : kTile;
  tile = tile < 1 ? 1 : tile > tile_cap ? tile_cap : tile;
  const int64_t tiles_per_head = (rows_per_head + tile - 1) / tile;
  const int64_t n_items = Hkv * tiles_per_head;
  // Items are head-major (item = head * tiles_per_head + tile) and the last tile of a head may be
  // short, so the threads' contiguous ranges balance rows (+1 per item for its walk and K/V
  // conversion) rather than item counts: e.g. a 1-row decode with 3 query heads per KV head has
  // tiles of 2 and 1 rows. (The +1 overstates a thread's cost where it owns consecutive items of
  // one head: the loop below runs those as one tile.)
  int64_t it0 = 0, it1 = 0;
  {
    auto w = [&](int64_t item) { return std::min<int64_t>(tile, rows_per_head - (item % tiles_per_head) * tile) + 1; };
    int64_t W = 0;
    for (int64_t i = 0; i < n_items; ++i) W += w(i);
    int64_t cum = 0;
    bool started = false;
    for (int64_t i = 0; i < n_items; ++i) {
      const int64_t wi = w(i);
      const int64_t owner = std::min<int64_t>(p.nth - 1, (2 * cum + wi) * p.nth / (2 * W));  // by midpoint
      cum += wi;
      if (owner == p.ith) {
        if (!started) { it0 = i; started = true; }
        it1 = i + 1;
      }
    }
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  // Blocked path (AVX2, D % 8 == 0, Dv = 32 / 64 / 128): per block of up to kCells visible
  // cells, the K / V rows are converted once, the tile's scores computed together (dots_avx2),
  // then each row runs its updates over the block with its accumulator in registers. Per row
  // and cell the arithmetic and its order are those of the cell-by-cell loop below.
  const bool blocked = !a512 && kern.avx2 && D % 8 == 0 && (Dv == 32 || Dv == 64 || Dv == 128);

  for (int64_t item = it0; item < it1;) {
    // Consecutive items of one KV head that this thread owns run as one tile (up to tile_cap
    // rows): its K / V rows are read and converted once, not once per item. The items only
    // spread the work over the threads; a row's arithmetic does not depend on its tile.
    const int64_t hk = item / tiles_per_head;
    const int64_t r0 = (item % tiles_per_head) * tile;
    int64_t r1 = std::min<int64_t>(r0 + tile, rows_per_head);
    for (++item; item < it1 && item / tiles_per_head == hk; ++item) {
      const int64_t e = std::min<int64_t>((item % tiles_per_head) * tile + tile, rows_per_head);
      if (e - r0 > tile_cap) break;
      r1 = e;
    }
    const int nt = (int)(r1 - r0);
    int64_t tok[kTileMax], hq[kTileMax];
    float m[kTileMax], l[kTileMax];
    const float* mrow[kTileMax];
    for (int r = 0; r < nt; ++r) {
      tok[r] = (r0 + r) / group;
      hq[r] = hk * group + (r0 + r) % group;
      const float* q = reinterpret_cast<const float*>(Q->data + tok[r] * Q->shape.strides[0] + hq[r] * Q->shape.strides[1]);
      for (int64_t i = 0; i < D; ++i) qbuf[r * D + i] = q[i] * scale;
      m[r] = ninf;
      l[r] = 0.0f;
      std::memset(acc + r * Dv, 0, (size_t)Dv * 4);
      mrow[r] = reinterpret_cast<const float*>(M->data + tok[r] * M->shape.strides[0]);
    }
#if defined(__x86_64__)
    if (a512) {
      // The tile's walk list: cells visible to any of its rows, in walk order. Rows of one token
      // share a mask row; when every token sees a prefix of the list, all rows form one group.
      int nu = 0;
      int64_t utok[kTileMax], ulen[kTileMax], len[kTileMax];
      int ubeg[kTileMax + 1];
      for (int r = 0; r < nt; ++r)
        if (nu == 0 || tok[r] != utok[nu - 1]) { ubeg[nu] = r; utok[nu++] = tok[r]; }
      ubeg[nu] = nt;
      auto walk = [&](int u0, int u1, bool& soft) -> std::pair<int64_t, bool> {
        int64_t nU = 0;
        bool compat = true;
        for (int u = u0; u < u1; ++u) ulen[u] = 0;
        for (int64_t jj = 0; jj < n_kv; ++jj) {
          const int64_t j = O ? *reinterpret_cast<const int32_t*>(O->data + jj * O->shape.strides[0]) : jj;
          if (j < 0 || j >= n_kv) continue;
          bool any = false;
          for (int u = u0; u < u1; ++u) {
            const float mv = mrow[ubeg[u]][j];
            if (mv == ninf) continue;
            any = true;
            compat &= ulen[u] == nU;  // u saw every earlier entry
            ++ulen[u];
            soft |= mv != 0.0f;
          }
          if (any) ulist[nU++] = (int32_t)j;
        }
        return {nU, compat};
      };
      bool soft = false;
      int64_t nU = 0;
      bool compat = false;
      // reuse this run's list for the same tokens (another head or layer), else make and keep it;
      // a tile's tokens are consecutive ((r0 + r) / group), so the first and last name them
      // (searched in full: a verify batch's tiles would collide in a hashed slot and evict each
      // other at every layer; a miss takes a slot of an earlier run, else the next in turn)
      WalkEntry* hit = nullptr;
      WalkEntry* stale = nullptr;
      for (int e = 0; e < kWalkCache && p.run_id; ++e) {
        WalkEntry& w = t_walks[e];
        if (w.run_id != p.run_id) {
          if (!stale) stale = &w;
          continue;
        }
        if (w.mask == M->data && w.order == (O ? O->data : nullptr) && w.n_kv == n_kv && w.tok0 == utok[0] &&
            w.tok1 == utok[nu - 1]) {
          hit = &w;
          break;
        }
      }
      const int32_t* U = ulist;  // the tile's walk list (the cached one on a hit)
      if (hit) {
        nU = hit->nU;
        compat = hit->compat;
        soft = hit->soft;
        U = hit->list.data();
        for (int u = 0; u < nu; ++u) ulen[u] = hit->ulen[u];
      } else {
        std::tie(nU, compat) = walk(0, nu, soft);
        if (p.run_id) {
          WalkEntry& slot = stale ? *stale : t_walks[t_walk_next++ % kWalkCache];
          slot.run_id = p.run_id;
          slot.mask = M->data;
          slot.order = O ? O->data : nullptr;
          slot.n_kv = n_kv;
          slot.tok0 = utok[0];
          slot.tok1 = utok[nu - 1];
          slot.nU = nU;
          slot.compat = compat;
          slot.soft = soft;
          for (int u = 0; u < nu; ++u) slot.ulen[u] = ulen[u];
          slot.list.assign(ulist, ulist + nU);
        }
      }
      for (int u = 0; u < nu && compat; ++u)
        for (int r = ubeg[u]; r < ubeg[u + 1]; ++r) len[r] = ulen[u];
      if (compat && !soft && nt >= kLanesMinRows && lanes_ok(D)) {
        attend_lanes(K, V, hk, U, nU, nt, qbuf, len, D, Dv, krow, vrow, lanes, lanes + D * 16, lanes + D * 16 + 8 * 256,
                     acc, m, l);
      } else if (compat) {
        attend_group_avx512(K, V, hk, U, nU, nt, qbuf, len, mrow, soft, D, Dv, krow, vrow, pbuf, acc, m, l);
      } else {
        for (int u = 0; u < nu; ++u) {  // one token at a time, each with its own list
          bool soft_u = false;
          const int64_t nUu = walk(u, u + 1, soft_u).first;
          const int ra = ubeg[u], rb = ubeg[u + 1];
          for (int r = ra; r < rb; ++r) len[r] = nUu;
          attend_group_avx512(K, V, hk, ulist, nUu, rb - ra, qbuf + ra * D, len + ra, mrow + ra, soft_u, D, Dv, krow,
                              vrow, pbuf + ra * 16, acc + ra * Dv, m + ra, l + ra);
        }
      }
    }
    if (blocked) {
      int64_t cj[kCells];
      const uint16_t* kp[kCells];
      const uint16_t* vp[kCells];
      const bool f16 = K->dtype == DType::F16 && V->dtype == DType::F16;
      for (int64_t jj = 0; jj < n_kv;) {
        int nc = 0;
        for (; jj < n_kv && nc < kCells; ++jj) {
          const int64_t j = O ? *reinterpret_cast<const int32_t*>(O->data + jj * O->shape.strides[0]) : jj;
          if (j < 0 || j >= n_kv) continue;
          bool any = false;
          for (int r = 0; r < nt; ++r) any |= mrow[r][j] != ninf;
          if (!any) continue;
          const uint8_t* kr = K->data + j * K->shape.strides[0] + hk * K->shape.strides[1];
          const uint8_t* vr = V->data + j * V->shape.strides[0] + hk * V->shape.strides[1];
          if (f16) {
            kp[nc] = reinterpret_cast<const uint16_t*>(kr);
            vp[nc] = reinterpret_cast<const uint16_t*>(vr);
          } else {
            load_row(K, kr, krow + nc * D, D, true);
            load_row(V, vr, vrow + nc * Dv, Dv, true);
          }
          cj[nc++] = j;
        }
        if (f16) {
          block_scores_f16_any(qbuf, nt, kp, nc, D, sbuf);
          block_widen_f16(vp, nc, Dv, vrow);
        } else {
          for (int c = 0; c < nc; ++c) dots_any_avx2(qbuf, nt, krow + c * D, D, sbuf + c * kTile);
        }
        for (int r = 0; r < nt; ++r) {
          for (int c = 0; c < nc; ++c) mkb[c] = mrow[r][cj[c]];
          if (Dv == 64) row_update_avx2<8>(acc + r * Dv, m[r], l[r], sbuf + r, mkb, vrow, nc);
          else if (Dv == 32) row_update_avx2<4>(acc + r * Dv, m[r], l[r], sbuf + r, mkb, vrow, nc);
          else row_update_avx2<16>(acc + r * Dv, m[r], l[r], sbuf + r, mkb, vrow, nc);
        }
      }
    }
#endif
    for (int64_t jj = 0; jj < n_kv && !blocked && !a512; ++jj) {
      const int64_t j = O ? *reinterpret_cast<const int32_t*>(O->data + jj * O->shape.strides[0]) : jj;
      if (j < 0 || j >= n_kv) continue;
      bool any = false;
      for (int r = 0; r < nt; ++r) any |= mrow[r][j] != ninf;
      if (!any) continue;
      load_row(K, K->data + j * K->shape.strides[0] + hk * K->shape.strides[1], krow, D, kern.avx2);
      load_row(V, V->data + j * V->shape.strides[0] + hk * V->shape.strides[1], vrow, Dv, kern.avx2);
      for (int r = 0; r < nt; ++r) {
        const float mk = mrow[r][j];
        if (mk == ninf) continue;
        const float s = kern.dot(qbuf + r * D, krow, D) + mk;
        if (s > m[r]) {
          const float c = exp_f32(m[r] - s);  // 0 on the first cell
          m[r] = s;
          l[r] = l[r] * c + 1.0f;
          kern.axpy(acc + r * Dv, c, vrow, 1.0f, Dv);
        } else {
          const float e = exp_f32(s - m[r]);
          l[r] += e;
#if defined(__x86_64__)
          if (kern.avx2) {
            axpy_avx2(acc + r * Dv, vrow, e, Dv);
            continue;
          }
#endif
          kern.axpy(acc + r * Dv, 1.0f, vrow, e, Dv);
        }
      }
    }
    for (int r = 0; r < nt; ++r) {
      float* out = reinterpret_cast<float*>(dst.data) + (tok[r] * Hq + hq[r]) * Dv;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t i = 0; i < Dv; ++i) out[i] = acc[r * Dv + i] * inv;
    }
  }
}

}  // namespace pyfast
