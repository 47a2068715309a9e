// Recurrent-state ops: the causal depthwise conv with state windows (ssm_conv) and the gated
// delta rule (gated_delta_net), both writing snapshot planes for rollback (algorithms.md §2).
//
// Both ops take `seqs` rows (t0, n, slot, src_plane): tokens [t0, t0+n) of the batch continue the
// state in `slot`, starting from plane `src_plane`; plane i then holds the state i tokens before
// the segment's end, for i < min(n, P). Work is split over (segment, channel block) for the conv
// and (segment, value head) for the delta rule; each item is done by one thread start to finish,
// so a segment's result never depends on the other segments or the thread count.
//
// gated_delta_net has two forms: token-serial (decode / verify; the arithmetic of a token is the
// same whatever the batch) and chunked (prefill, §2.4: C = 64 for the scalar gate, 16 for the
// per-key gate), used for segments with n >= chunk_min when chunk_min > 0; the chunked form
// covers all but the last min(n, P) - 1 tokens, which run token-serially so every snapshot plane
// holds exactly the state it names.
//
// SIMD: the ISA-specific part below (between the #else and the #endif) is compiled once per ISA
// by including this file into itself inside `#pragma GCC target` regions (as Highway does), with
// `V` the ISA's vector policy. Within one ISA every element is computed by a fixed sequence of
// mul/fma operations in a fixed order (reductions run over rows, per lane; blocking and tails
// depend on S or C only), so results never depend on T, the batch or the thread count. The
// scalar ISA (plain mul + add, no fma, libm exp) is the reference the SIMD paths are tested
// against within a tolerance.
#ifndef PYFAST_SSM_ISA_BODY

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu/kernels/common.h"

namespace pyfast {

namespace {

constexpr int64_t kConvBlock = 64;  // channels per ssm_conv work item
constexpr int kChunkGda = 64;       // chunk length of the chunked delta rule, scalar gate
constexpr int kChunkKda = 16;       // ... per-key gate (decays per key dim underflow sooner)

inline int64_t pad16(int64_t n) { return (n + 15) & ~(int64_t)15; }  // floats, 64-byte multiples

struct Seg {
  int64_t t0, n, slot, src;
};

inline Seg seg_at(const Node* seqs, int64_t r) {
  const int32_t* p = reinterpret_cast<const int32_t*>(seqs->data + r * seqs->shape.strides[0]);
  return Seg{p[0], p[1], p[2], p[3]};
}

// Checks the run-time values of `seqs` (the constructor only sees shapes). Returns "" when they
// are valid. `tmp` holds 2 * n_seg int64 (per-thread scratch).
std::string check_seqs_values(const char* op, const Node* seqs, int64_t T, int64_t n_slot, int64_t P, int64_t* tmp) {
  const int64_t n_seg = seqs->shape.dims[0];
  auto bad = [&](int64_t r, const std::string& what) {
    return std::string("[") + op + "] seqs row " + std::to_string(r) + ": " + what;
  };
  int64_t m = 0;
  for (int64_t r = 0; r < n_seg; ++r) {
    const Seg s = seg_at(seqs, r);
    if (s.n < 0) return bad(r, "n = " + std::to_string(s.n) + " < 0");
    if (s.t0 < 0 || s.t0 + s.n > T)
      return bad(r, "tokens [" + std::to_string(s.t0) + ", " + std::to_string(s.t0 + s.n) + ") are outside the batch [0, " +
                        std::to_string(T) + ")");
    if (s.slot < 0 || s.slot >= n_slot)
      return bad(r, "slot " + std::to_string(s.slot) + " is outside [0, " + std::to_string(n_slot) + ")");
    if (s.src < 0 || s.src >= P)
      return bad(r, "src_plane " + std::to_string(s.src) + " is outside [0, " + std::to_string(P) + ")");
    if (s.n > 0) tmp[m++] = r;
  }
  // Non-empty segments must not share tokens (their outputs would race) nor slots (their states).
  int64_t* idx = tmp;
  std::sort(idx, idx + m, [&](int64_t a, int64_t b) { return seg_at(seqs, a).t0 < seg_at(seqs, b).t0; });
  for (int64_t i = 1; i < m; ++i) {
    const Seg a = seg_at(seqs, idx[i - 1]), b = seg_at(seqs, idx[i]);
    if (b.t0 < a.t0 + a.n)
      return bad(idx[i], "its tokens overlap those of row " + std::to_string(idx[i - 1]) + " (token " + std::to_string(b.t0) + ")");
  }
  std::sort(idx, idx + m, [&](int64_t a, int64_t b) {
    const int64_t sa = seg_at(seqs, a).slot, sb = seg_at(seqs, b).slot;
    return sa != sb ? sa < sb : a < b;
  });
  for (int64_t i = 1; i < m; ++i)
    if (seg_at(seqs, idx[i - 1]).slot == seg_at(seqs, idx[i]).slot)
      return bad(idx[i], "slot " + std::to_string(seg_at(seqs, idx[i]).slot) + " is also used by row " + std::to_string(idx[i - 1]));
  return "";
}

// Bad seqs values throw on every thread, before anything is written (Plan::run rethrows the
// first one once all threads have stopped; this kernel has no barrier of its own).
[[noreturn]] void seqs_error(const std::string& msg) { throw std::runtime_error(msg); }

// Zeroes the output rows (of `row` floats) of tokens that no segment covers, split over threads.
void zero_uncovered(const ComputeParams& p, const Node* seqs, float* out, int64_t T, int64_t row) {
  const int64_t n_seg = seqs->shape.dims[0];
  int64_t b, e;
  split_range(T, p.ith, p.nth, b, e);
  for (int64_t t = b; t < e; ++t) {
    bool covered = false;
    for (int64_t r = 0; r < n_seg && !covered; ++r) {
      const Seg s = seg_at(seqs, r);
      covered = t >= s.t0 && t < s.t0 + s.n;
    }
    if (!covered) std::memset(out + t * row, 0, (size_t)row * sizeof(float));
  }
}

// ---- ssm_conv ---------------------------------------------------------------------------------

struct ConvCtx {
  const uint8_t* x;
  int64_t xs0;  // bytes between tokens
  const uint8_t* w;
  int64_t ws0, ws1;  // bytes (channel, tap)
  float* y;          // [T, C] contiguous
  float* state;      // [P, n_slot, Kc-1, C] contiguous
  int64_t T, C, Kc, P, n_slot;
};

size_t conv_thread_floats(int64_t Kc, int64_t n_seg) {
  // window (Kc-1) x block, transposed taps Kc x block, Kc row pointers, the seqs sort buffer
  return (size_t)(pad16((Kc - 1) * kConvBlock) + pad16(Kc * kConvBlock) + pad16(Kc * 2) + pad16(2 * n_seg * 2));
}

// ---- gated_delta_net --------------------------------------------------------------------------

struct GdnCtx {
  const uint8_t *q, *k, *v, *g, *b;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, gs0, gs1, gs2, bs0, bs1;  // byte strides (token, head[, key])
  float* o;                                                        // [T, Hv, S] contiguous
  float* state;                                                    // [P, n_slot, Hv, S*S] contiguous
  int64_t T, Hk, Hv, S, P, n_slot;
  float scale;
  int broadcast, chunk, chunk_min;
  bool kda;
};

// Per-thread scratch layout of gated_delta_net, in floats.
struct GdnScratch {
  int64_t M, a, b, delta, prep0, prep1;              // serial: state copy, reductions, 2 x (dvec, kt, qt)
  int64_t QK, V, KT, G, A, QKL, UW, KdT, gam, E, ed, rs, kd;  // chunked
  int64_t sort, total;
};

GdnScratch gdn_scratch(int64_t S, int C, bool chunked, bool kda, int64_t n_seg) {
  GdnScratch L{};
  int64_t off = 0;
  auto take = [&](int64_t n) { const int64_t at = off; off += pad16(n); return at; };
  L.M = take(S * S);
  L.a = take(S);
  L.b = take(S);
  L.delta = take(S);
  L.prep0 = take(3 * S);
  L.prep1 = take(3 * S);
  if (chunked) {
    const int64_t ng = kda ? (int64_t)C * S : C;
    L.QK = take(2 * (int64_t)C * S);
    L.V = take((int64_t)C * S);
    L.KT = take(S * C);
    L.G = take(2 * (int64_t)C * C);
    L.A = take((int64_t)C * C);
    L.QKL = take((int64_t)C * C);
    L.UW = take((int64_t)C * 2 * S);
    L.KdT = take(S * C);
    L.gam = take(ng);
    L.E = take(ng);
    L.ed = take(ng);
    L.rs = take(S);
    L.kd = take(S);
  }
  L.sort = take(2 * n_seg * 2);  // int64 x 2 n_seg
  L.total = off;
  return L;
}

// ---- vector policies --------------------------------------------------------------------------

// The reference: one float per "vector", plain mul + add (the build uses -ffp-contract=off).
struct VecScalar {
  using T = float;
  static constexpr int W = 1;
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T set1(float s) { return s; }
  static T zero() { return 0.0f; }
  static T mul(T a, T b) { return a * b; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T exp(T x) { return std::exp(x); }
};

}  // namespace
}  // namespace pyfast

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace pyfast {
namespace {
// A single lane with a fused multiply-add: the scalar tails of the AVX2 / AVX-512 paths.
struct VecFmaLane {
  using T = float;
  static constexpr int W = 1;
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T set1(float s) { return s; }
  static T zero() { return 0.0f; }
  static T mul(T a, T b) { return a * b; }
  static T fma(T a, T b, T c) { return __builtin_fmaf(a, b, c); }
  static T exp(T x) { return std::exp(x); }
};

// exp(x) for x in [-87, 88] (clamped there): Cephes' expf polynomial, about 1 ulp.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
struct VecAvx2 {
  using T = __m256;
  using Lane = VecFmaLane;
  static constexpr int W = 8;
  static constexpr int MR = 4;  // gemm tile rows (x 2 vectors: 8 accumulators of 16 registers)
  static constexpr int NBS = 4;  // serial passes: vectors per column block (2 x 4 accumulators)
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float s) { return _mm256_set1_ps(s); }
  static T zero() { return _mm256_setzero_ps(); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T exp(T x) {
    x = _mm256_min_ps(_mm256_max_ps(x, set1(kExpLo)), set1(kExpHi));
    const T n = _mm256_round_ps(_mm256_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, set1(kLn2Hi), x);
    x = _mm256_fnmadd_ps(n, set1(kLn2Lo), x);
    T y = set1(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = fma(y, x, set1(kExpP[i]));
    y = fma(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, set1(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
};
}  // namespace
}  // namespace pyfast
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace pyfast {
namespace {
struct VecAvx512 {
  using T = __m512;
  using Lane = VecFmaLane;
  static constexpr int W = 16;
  static constexpr int MR = 6;  // 12 accumulators of 32 registers
  static constexpr int NBS = 8;  // 16 accumulators: a whole S = 128 row per block (sequential reads)
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float s) { return _mm512_set1_ps(s); }
  static T zero() { return _mm512_setzero_ps(); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T exp(T x) {
    // (maskz forms with a full mask: GCC 12's unmasked ones warn about an "uninitialized" source)
    const __mmask16 all = (__mmask16)0xFFFF;
    x = _mm512_maskz_min_ps(all, _mm512_maskz_max_ps(all, x, set1(kExpLo)), set1(kExpHi));
    const T n = _mm512_maskz_roundscale_ps(all, _mm512_mul_ps(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, set1(kLn2Hi), x);
    x = _mm512_fnmadd_ps(n, set1(kLn2Lo), x);
    T y = set1(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = fma(y, x, set1(kExpP[i]));
    y = fma(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, set1(1.0f)));
    return _mm512_maskz_scalef_ps(all, y, n);
  }
};
}  // namespace
}  // namespace pyfast
#pragma GCC pop_options
#endif

// ---- one copy of the kernels per ISA ------------------------------------------------------------

#define PYFAST_SSM_ISA_BODY 1
namespace pyfast {
namespace {
namespace isa_scalar {
struct V : VecScalar {
  using Lane = VecScalar;
  static constexpr int MR = 4;
  static constexpr int NBS = 4;
};
#include __FILE__
}  // namespace isa_scalar
}  // namespace
}  // namespace pyfast

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace pyfast {
namespace {
namespace isa_avx2 {
using V = VecAvx2;
#include __FILE__
}  // namespace isa_avx2
}  // namespace
}  // namespace pyfast
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace pyfast {
namespace {
namespace isa_avx512 {
using V = VecAvx512;
#include __FILE__
}  // namespace isa_avx512
}  // namespace
}  // namespace pyfast
#pragma GCC pop_options
#endif
#undef PYFAST_SSM_ISA_BODY

// ---- entry points -------------------------------------------------------------------------------

namespace pyfast {

namespace {

using ConvItemFn = void (*)(const ConvCtx&, const Seg&, int64_t, int64_t, float*);
using GdnItemFn = void (*)(const GdnCtx&, const Seg&, int64_t, const GdnScratch&, float*);

ConvItemFn conv_item_for(CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::avx512) return isa_avx512::conv_item;
  if (isa == CpuIsa::avx2) return isa_avx2::conv_item;
#endif
  (void)isa;
  return isa_scalar::conv_item;
}

GdnItemFn gdn_item_for(CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::avx512) return isa_avx512::gdn_item;
  if (isa == CpuIsa::avx2) return isa_avx2::gdn_item;
#endif
  (void)isa;
  return isa_scalar::gdn_item;
}

int gdn_chunk(const Node& dst) { return dst.params.i[2] ? kChunkKda : kChunkGda; }

}  // namespace

// Scratch bytes (shared by all threads) for this file's ops: one region per thread.
size_t cpu_ssm_work_size(const Node& dst, const Node* const* src, int nth) {
  const int n = nth > 0 ? nth : 1;
  if (dst.op == Op::ssm_conv) {
    const int64_t Kc = src[1]->shape.dims[1], n_seg = src[3]->shape.dims[0];
    return (size_t)n * conv_thread_floats(Kc, n_seg) * sizeof(float);
  }
  if (dst.op == Op::gated_delta_net) {
    const int64_t S = src[2]->shape.dims[2], n_seg = src[6]->shape.dims[0];
    const GdnScratch L = gdn_scratch(S, gdn_chunk(dst), dst.params.i[1] > 0, dst.params.i[2] != 0, n_seg);
    return (size_t)n * (size_t)L.total * sizeof(float);
  }
  return 0;
}

void cpu_ssm_conv(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* x = src[0];
  const Node* w = src[1];
  const Node* st = src[2];
  const Node* seqs = src[3];
  ConvCtx c;
  c.x = x->data;
  c.xs0 = x->shape.strides[0];
  c.w = w->data;
  c.ws0 = w->shape.strides[0];
  c.ws1 = w->shape.strides[1];
  c.y = reinterpret_cast<float*>(dst.data);
  c.state = reinterpret_cast<float*>(st->data);
  c.T = x->shape.dims[0];
  c.C = x->shape.dims[1];
  c.Kc = w->shape.dims[1];
  c.P = st->shape.dims[0];
  c.n_slot = st->shape.dims[1];
  const int64_t n_seg = seqs->shape.dims[0];

  float* scr = reinterpret_cast<float*>(p.wdata) + (size_t)p.ith * conv_thread_floats(c.Kc, n_seg);
  int64_t* sort_buf = reinterpret_cast<int64_t*>(scr + pad16((c.Kc - 1) * kConvBlock) + pad16(c.Kc * kConvBlock) + pad16(c.Kc * 2));
  const std::string err = check_seqs_values("ssm_conv", seqs, c.T, c.n_slot, c.P, sort_buf);
  if (!err.empty()) seqs_error(err);

  zero_uncovered(p, seqs, c.y, c.T, c.C);
  const ConvItemFn item = conv_item_for(p.isa);
  const int64_t n_cb = (c.C + kConvBlock - 1) / kConvBlock;
  // Items (segment, channel block) from the thread's own range, then the rest of the others'
  // (WorkRanges): a thread that reaches this op late does not hold the others at the barrier.
  // A decoded token's items are cheap (64 channels each): they are taken in steps of about an
  // eighth of a share.
  const int64_t n_items = n_seg * n_cb;
  WorkRanges wr(p.ith, p.nth, p.ranges, n_items, n_items / (8 * (int64_t)p.nth));
  for (int64_t b, e; wr.next(b, e);) {
    for (int64_t it = b; it < e; ++it) {
      const Seg s = seg_at(seqs, it / n_cb);
      if (s.n == 0) continue;
      const int64_t c0 = (it % n_cb) * kConvBlock;
      item(c, s, c0, std::min(kConvBlock, c.C - c0), scr);
    }
  }
}

void cpu_gated_delta_net(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node *Q = src[0], *K = src[1], *Vn = src[2], *G = src[3], *B = src[4], *M = src[5], *seqs = src[6];
  GdnCtx c;
  c.q = Q->data;
  c.k = K->data;
  c.v = Vn->data;
  c.g = G->data;
  c.b = B->data;
  c.qs0 = Q->shape.strides[0];
  c.qs1 = Q->shape.strides[1];
  c.ks0 = K->shape.strides[0];
  c.ks1 = K->shape.strides[1];
  c.vs0 = Vn->shape.strides[0];
  c.vs1 = Vn->shape.strides[1];
  c.gs0 = G->shape.strides[0];
  c.gs1 = G->shape.strides[1];
  c.gs2 = G->shape.ndim == 3 ? G->shape.strides[2] : 0;
  c.bs0 = B->shape.strides[0];
  c.bs1 = B->shape.strides[1];
  c.o = reinterpret_cast<float*>(dst.data);
  c.state = reinterpret_cast<float*>(M->data);
  c.T = Vn->shape.dims[0];
  c.Hv = Vn->shape.dims[1];
  c.S = Vn->shape.dims[2];
  c.Hk = Q->shape.dims[1];
  c.P = M->shape.dims[0];
  c.n_slot = M->shape.dims[1];
  c.scale = dst.params.f[0];
  c.broadcast = dst.params.i[0];
  c.chunk_min = dst.params.i[1];
  c.kda = dst.params.i[2] != 0;
  c.chunk = gdn_chunk(dst);
  const int64_t n_seg = seqs->shape.dims[0];

  const GdnScratch L = gdn_scratch(c.S, c.chunk, c.chunk_min > 0, c.kda, n_seg);
  float* scr = reinterpret_cast<float*>(p.wdata) + (size_t)p.ith * (size_t)L.total;
  const std::string err =
      check_seqs_values("gated_delta_net", seqs, c.T, c.n_slot, c.P, reinterpret_cast<int64_t*>(scr + L.sort));
  if (!err.empty()) seqs_error(err);

  zero_uncovered(p, seqs, c.o, c.T, c.Hv * c.S);
  const GdnItemFn item = gdn_item_for(p.isa);
  // Items (segment, head), one at a time from the thread's own range, then from the far end of
  // the others' (WorkRanges): a long segment's items (n tokens each) and a thread that reaches
  // this op late are both balanced by taking over the rest of another thread's items.
  WorkRanges wr(p.ith, p.nth, p.ranges, n_seg * c.Hv, 1);
  for (int64_t b, e; wr.next(b, e);) {
    for (int64_t it = b; it < e; ++it) {
      const Seg s = seg_at(seqs, it / c.Hv);
      if (s.n == 0) continue;
      item(c, s, it % c.Hv, L, scr);
    }
  }
}

}  // namespace pyfast

#else  // PYFAST_SSM_ISA_BODY ====================================================================
// The kernels of one ISA: `V` is the vector policy (T, W, MR, load/store/set1/zero/mul/fma) and
// `V::Lane` the matching single-lane policy for tails.

// ---- ssm_conv -----------------------------------------------------------------------------------

// y[c] = sum_j w[j][c] * rows[j][c] over cw channels (taps in order; the first is a plain product).
template <class P>
inline void conv_cols(float* y, const float* const* rows, const float* wt, int64_t ldw, int64_t Kc, int64_t c) {
  typename P::T acc = P::mul(P::load(wt + c), P::load(rows[0] + c));
  for (int64_t j = 1; j < Kc; ++j) acc = P::fma(P::load(wt + j * ldw + c), P::load(rows[j] + c), acc);
  P::store(y + c, acc);
}

void conv_item(const ConvCtx& cx, const Seg& s, int64_t c0, int64_t cw, float* scr) {
  const int64_t Kc = cx.Kc, K1 = Kc - 1, C = cx.C;
  float* win = scr;                                  // [K1][cw]: the source plane's window
  float* wbuf = scr + pad16(K1 * kConvBlock);        // [Kc][cw]: taps, transposed
  const float** rows = reinterpret_cast<const float**>(wbuf + pad16(Kc * kConvBlock));  // [Kc]
  const float* srcw = cx.state + ((s.src * cx.n_slot + s.slot) * K1) * C + c0;
  for (int64_t r = 0; r < K1; ++r) std::memcpy(win + r * cw, srcw + r * C, (size_t)cw * sizeof(float));
  // Taps as [Kc][channels]: read in place when w is a view of a [Kc, C] buffer (channels
  // contiguous), else transposed into scratch.
  const float* wt;
  int64_t ldw;
  if (cx.ws0 == (int64_t)sizeof(float) && cx.ws1 % (int64_t)sizeof(float) == 0) {
    wt = reinterpret_cast<const float*>(cx.w) + c0;
    ldw = cx.ws1 / (int64_t)sizeof(float);
  } else {
    for (int64_t j = 0; j < Kc; ++j)
      for (int64_t c = 0; c < cw; ++c)
        wbuf[j * cw + c] = *reinterpret_cast<const float*>(cx.w + (c0 + c) * cx.ws0 + j * cx.ws1);
    wt = wbuf;
    ldw = cw;
  }
  // Row r of the segment's window: the old state for r < K1, then the segment's inputs.
  auto row = [&](int64_t r) -> const float* {
    return r < K1 ? win + r * cw : reinterpret_cast<const float*>(cx.x + (s.t0 + r - K1) * cx.xs0) + c0;
  };
  for (int64_t t = 0; t < s.n; ++t) {
    for (int64_t j = 0; j < Kc; ++j) rows[j] = row(t + j);
    float* y = cx.y + (s.t0 + t) * C + c0;
    int64_t c = 0;
    for (; c + V::W <= cw; c += V::W) conv_cols<V>(y, rows, wt, ldw, Kc, c);
    for (; c < cw; ++c) conv_cols<typename V::Lane>(y, rows, wt, ldw, Kc, c);
  }
  // Snapshot windows: plane i = the K1 inputs ending i tokens before the segment's end.
  const int64_t n_snap = std::min(s.n, cx.P);
  for (int64_t i = 0; i < n_snap; ++i) {
    float* d = cx.state + ((i * cx.n_slot + s.slot) * K1) * C + c0;
    for (int64_t r = 0; r < K1; ++r) std::memcpy(d + r * C, row(s.n - i + r), (size_t)cw * sizeof(float));
  }
}

// ---- gated_delta_net: token-serial --------------------------------------------------------------

inline const float* gq(const GdnCtx& c, int64_t t, int64_t hk) { return reinterpret_cast<const float*>(c.q + t * c.qs0 + hk * c.qs1); }
inline const float* gk(const GdnCtx& c, int64_t t, int64_t hk) { return reinterpret_cast<const float*>(c.k + t * c.ks0 + hk * c.ks1); }
inline const float* gv(const GdnCtx& c, int64_t t, int64_t h) { return reinterpret_cast<const float*>(c.v + t * c.vs0 + h * c.vs1); }
inline float gbeta(const GdnCtx& c, int64_t t, int64_t h) { return *reinterpret_cast<const float*>(c.b + t * c.bs0 + h * c.bs1); }
inline float ggate(const GdnCtx& c, int64_t t, int64_t h, int64_t i) {
  return *reinterpret_cast<const float*>(c.g + t * c.gs0 + h * c.gs1 + i * c.gs2);
}
// The per-key gate row of (t, h) (contiguous: the constructor requires an inner-contiguous g).
inline const float& ggate_ref(const GdnCtx& c, int64_t t, int64_t h) {
  return *reinterpret_cast<const float*>(c.g + t * c.gs0 + h * c.gs1);
}

// y[i] = exp(x[i]) (the vector exp for whole vectors, libm for the tail).
void exp_row(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(y + i, V::exp(V::load(x + i)));
  for (; i < n; ++i) y[i] = std::exp(x[i]);
}

// A token's per-key factors: prep = [dvec | kt | qt] with dvec[i] the decay of key row i,
// kt = dvec * k and qt = dvec * q. Returns k . q (sequential sum).
inline float gdn_prep(const GdnCtx& c, int64_t t, int64_t h, int64_t hk, float* prep) {
  const int64_t S = c.S;
  float* dv = prep;
  float* kt = prep + S;
  float* qt = prep + 2 * S;
  const float* k = gk(c, t, hk);
  const float* q = gq(c, t, hk);
  if (c.kda) {
    exp_row(&ggate_ref(c, t, h), dv, S);
  } else {
    const float d = std::exp(ggate(c, t, h, 0));
    for (int64_t i = 0; i < S; ++i) dv[i] = d;
  }
  for (int64_t i = 0; i < S; ++i) {  // (apart from the sum below, so that this loop vectorizes)
    kt[i] = dv[i] * k[i];
    qt[i] = dv[i] * q[i];
  }
  float kq = 0.0f;
  for (int64_t i = 0; i < S; ++i) kq += k[i] * q[i];
  return kq;
}

// a[j] = sum_i kt[i] M[i][j], b[j] = sum_i qt[i] M[i][j] for columns [j, j + NB*W).
template <class P, int NB>
inline void read_cols(const float* M, int64_t S, int64_t j, const float* kt, const float* qt, float* a, float* b) {
  typename P::T aa[NB], bb[NB];
  for (int u = 0; u < NB; ++u) aa[u] = bb[u] = P::zero();
  for (int64_t i = 0; i < S; ++i) {
    const typename P::T ki = P::set1(kt[i]), qi = P::set1(qt[i]);
    const float* m = M + i * S + j;
    for (int u = 0; u < NB; ++u) {
      const typename P::T mv = P::load(m + u * P::W);
      aa[u] = P::fma(ki, mv, aa[u]);
      bb[u] = P::fma(qi, mv, bb[u]);
    }
  }
  for (int u = 0; u < NB; ++u) {
    P::store(a + j + u * P::W, aa[u]);
    P::store(b + j + u * P::W, bb[u]);
  }
}

// The serial passes split the columns into blocks of NBS, then 4, 2 and 1 vectors, then single
// lanes (which blocks a column falls in depends on S only).
void read_pass(const float* M, int64_t S, const float* kt, const float* qt, float* a, float* b) {
  int64_t j = 0;
  if constexpr (V::NBS >= 8)
    for (; j + 8 * V::W <= S; j += 8 * V::W) read_cols<V, 8>(M, S, j, kt, qt, a, b);
  for (; j + 4 * V::W <= S; j += 4 * V::W) read_cols<V, 4>(M, S, j, kt, qt, a, b);
  for (; j + 2 * V::W <= S; j += 2 * V::W) read_cols<V, 2>(M, S, j, kt, qt, a, b);
  for (; j + V::W <= S; j += V::W) read_cols<V, 1>(M, S, j, kt, qt, a, b);
  for (; j < S; ++j) read_cols<typename V::Lane, 1>(M, S, j, kt, qt, a, b);
}

// Out[i][j] = dv[i] * Min[i][j] + k[i] * delta[j] (Out may be Min) and, when NX, the next token's
// reductions a[j] = sum_i nkt[i] Out[i][j], b[j] = sum_i nqt[i] Out[i][j].
template <class P, int NB, bool NX>
inline void update_cols(const float* Min, float* Out, int64_t S, int64_t j, const float* dv, const float* k,
                        const float* delta, const float* nkt, const float* nqt, float* a, float* b) {
  typename P::T aa[NB], bb[NB], dl[NB];  // delta in registers (the stores to Out could alias it for the compiler)
  for (int u = 0; u < NB; ++u) {
    aa[u] = bb[u] = P::zero();
    dl[u] = P::load(delta + j + u * P::W);
  }
  for (int64_t i = 0; i < S; ++i) {
    const typename P::T di = P::set1(dv[i]), ki = P::set1(k[i]);
    const float* m = Min + i * S + j;
    float* o = Out + i * S + j;
    for (int u = 0; u < NB; ++u) {
      const typename P::T mv = P::fma(ki, dl[u], P::mul(di, P::load(m + u * P::W)));
      P::store(o + u * P::W, mv);
      if (NX) {
        aa[u] = P::fma(P::set1(nkt[i]), mv, aa[u]);
        bb[u] = P::fma(P::set1(nqt[i]), mv, bb[u]);
      }
    }
  }
  if (NX)
    for (int u = 0; u < NB; ++u) {
      P::store(a + j + u * P::W, aa[u]);
      P::store(b + j + u * P::W, bb[u]);
    }
}

template <bool NX>
void update_pass(const float* Min, float* Out, int64_t S, const float* dv, const float* k, const float* delta,
                 const float* nkt, const float* nqt, float* a, float* b) {
  int64_t j = 0;
  if constexpr (V::NBS >= 8)
    for (; j + 8 * V::W <= S; j += 8 * V::W) update_cols<V, 8, NX>(Min, Out, S, j, dv, k, delta, nkt, nqt, a, b);
  for (; j + 4 * V::W <= S; j += 4 * V::W) update_cols<V, 4, NX>(Min, Out, S, j, dv, k, delta, nkt, nqt, a, b);
  for (; j + 2 * V::W <= S; j += 2 * V::W) update_cols<V, 2, NX>(Min, Out, S, j, dv, k, delta, nkt, nqt, a, b);
  for (; j + V::W <= S; j += V::W) update_cols<V, 1, NX>(Min, Out, S, j, dv, k, delta, nkt, nqt, a, b);
  for (; j < S; ++j) update_cols<typename V::Lane, 1, NX>(Min, Out, S, j, dv, k, delta, nkt, nqt, a, b);
}

// ---- gated_delta_net: chunked -------------------------------------------------------------------

// C[m][n] = init + sum_{k < kend} A[m][k] B[k][n] over rows [m0, m0+MR) and columns [n0, n0+NB*W),
// init = C0 ? (rs ? rs[m] * C0[m][n] : C0[m][n]) : 0 (C0 may be C). The k order is fixed.
template <class P, int MR, int NB>
inline void gemm_tile(int64_t kend, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                      const float* C0, int64_t ldc0, const float* rs, int64_t m0, int64_t n0) {
  typename P::T acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < NB; ++u) {
      if (!C0) acc[r][u] = P::zero();
      else {
        const typename P::T c0 = P::load(C0 + (m0 + r) * ldc0 + n0 + u * P::W);
        acc[r][u] = rs ? P::mul(P::set1(rs[m0 + r]), c0) : c0;
      }
    }
  for (int64_t k = 0; k < kend; ++k) {
    typename P::T bv[NB];
    for (int u = 0; u < NB; ++u) bv[u] = P::load(B + k * ldb + n0 + u * P::W);
    for (int r = 0; r < MR; ++r) {
      const typename P::T av = P::set1(A[(m0 + r) * lda + k]);
      for (int u = 0; u < NB; ++u) acc[r][u] = P::fma(av, bv[u], acc[r][u]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < NB; ++u) P::store(C + (m0 + r) * ldc + n0 + u * P::W, acc[r][u]);
}

template <int MR>
inline void gemm_rows(int64_t N, int64_t kend, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                      int64_t ldc, const float* C0, int64_t ldc0, const float* rs, int64_t m0) {
  int64_t n = 0;
  for (; n + 2 * V::W <= N; n += 2 * V::W) gemm_tile<V, MR, 2>(kend, A, lda, B, ldb, C, ldc, C0, ldc0, rs, m0, n);
  for (; n + V::W <= N; n += V::W) gemm_tile<V, MR, 1>(kend, A, lda, B, ldb, C, ldc, C0, ldc0, rs, m0, n);
  for (; n < N; ++n) gemm_tile<typename V::Lane, MR, 1>(kend, A, lda, B, ldb, C, ldc, C0, ldc0, rs, m0, n);
}

// C[M x N] = init + A[M x K] B[K x N] (all row-major). tri: A is lower triangular (A[m][k] = 0
// for k > m), so a tile of rows stops at its last row's diagonal; the skipped terms are zeros.
void gemm(int64_t Mr, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
          int64_t ldc, const float* C0, int64_t ldc0, const float* rs, bool tri) {
  int64_t m = 0;
  for (; m + V::MR <= Mr; m += V::MR)
    gemm_rows<V::MR>(N, tri ? std::min(K, m + V::MR) : K, A, lda, B, ldb, C, ldc, C0, ldc0, rs, m);
  for (; m < Mr; ++m) gemm_rows<1>(N, tri ? std::min(K, m + 1) : K, A, lda, B, ldb, C, ldc, C0, ldc0, rs, m);
}

// R[t][:] -= sum_{s<t} A[t][s] R[s][:] for t in order (unit lower-triangular solve, in place),
// over columns [j, j + NB*W).
template <class P, int NB>
inline void trsv_cols(int64_t c, const float* A, int64_t lda, float* R, int64_t ldr, int64_t j) {
  for (int64_t t = 1; t < c; ++t) {
    typename P::T acc[NB];
    for (int u = 0; u < NB; ++u) acc[u] = P::load(R + t * ldr + j + u * P::W);
    for (int64_t s = 0; s < t; ++s) {
      const typename P::T as = P::set1(-A[t * lda + s]);
      for (int u = 0; u < NB; ++u) acc[u] = P::fma(as, P::load(R + s * ldr + j + u * P::W), acc[u]);
    }
    for (int u = 0; u < NB; ++u) P::store(R + t * ldr + j + u * P::W, acc[u]);
  }
}

void trsv(int64_t c, const float* A, int64_t lda, float* R, int64_t ldr, int64_t N) {
  int64_t j = 0;
  for (; j + 4 * V::W <= N; j += 4 * V::W) trsv_cols<V, 4>(c, A, lda, R, ldr, j);
  for (; j + V::W <= N; j += V::W) trsv_cols<V, 1>(c, A, lda, R, ldr, j);
  for (; j < N; ++j) trsv_cols<typename V::Lane, 1>(c, A, lda, R, ldr, j);
}

// sum_i a[i] b[i] in a fixed order (vector lanes, then the lanes in order, then the tail).
float dot(const float* a, const float* b, int64_t n) {
  typename V::T acc = V::zero();
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) acc = V::fma(V::load(a + i), V::load(b + i), acc);
  alignas(64) float l[V::W];
  V::store(l, acc);
  float s = 0.0f;
  for (int u = 0; u < V::W; ++u) s += l[u];
  for (; i < n; ++i) s = V::Lane::fma(a[i], b[i], s);
  return s;
}

// Runs tokens [0, n_c) of the segment (relative) through the chunked form, starting from Min; the
// state after the last chunk goes to Mfinal (earlier chunk states to the M scratch).
void gdn_chunked(const GdnCtx& c, const Seg& s, int64_t h, int64_t hk, int64_t n_c, const float* Min, float* Mfinal,
                 const GdnScratch& L, float* scr) {
  const int64_t S = c.S, Cn = c.chunk, ldo = c.Hv * S;
  float* QKb = scr + L.QK;  // rows [0, cl): q, then [cl, 2cl): k   (q rows later become scale * q * e^gamma)
  float* Vb = scr + L.V;
  float* KT = scr + L.KT;
  float* Gm = scr + L.G;
  float* Am = scr + L.A;
  float* QKL = scr + L.QKL;
  float* UW = scr + L.UW;  // [cl][2S]: U = T(beta V) then V' in [0, S); -T(beta K e^gamma) in [S, 2S)
  float* KdT = scr + L.KdT;
  float* gam = scr + L.gam;
  float* E = scr + L.E;
  float* ed = scr + L.ed;
  float* rs = scr + L.rs;
  float* kd = scr + L.kd;
  const float* Mcur = Min;
  for (int64_t c0 = 0; c0 < n_c; c0 += Cn) {
    const int64_t cl = std::min<int64_t>(Cn, n_c - c0);
    const int64_t tb = s.t0 + c0;
    float* Qc = QKb;
    float* Kc = QKb + cl * S;
    for (int64_t t = 0; t < cl; ++t) {
      std::memcpy(Qc + t * S, gq(c, tb + t, hk), (size_t)S * sizeof(float));
      std::memcpy(Kc + t * S, gk(c, tb + t, hk), (size_t)S * sizeof(float));
      std::memcpy(Vb + t * S, gv(c, tb + t, h), (size_t)S * sizeof(float));
    }
    // Decays. Scalar gate: gam = cumulative log decay within the chunk, E = exp(gam). Per-key
    // gate (one exp per element): ed = exp(g), E = its running product (the decay since the
    // chunk start) and gam[t] = the product of ed over (t, last] (the decay from t to the end).
    if (c.kda) {
      for (int64_t t = 0; t < cl; ++t) {
        exp_row(&ggate_ref(c, tb + t, h), ed + t * S, S);
        for (int64_t i = 0; i < S; ++i) E[t * S + i] = t ? E[(t - 1) * S + i] * ed[t * S + i] : ed[t * S + i];
      }
      for (int64_t i = 0; i < S; ++i) gam[(cl - 1) * S + i] = 1.0f;
      for (int64_t t = cl - 2; t >= 0; --t)
        for (int64_t i = 0; i < S; ++i) gam[t * S + i] = gam[(t + 1) * S + i] * ed[(t + 1) * S + i];
    } else {
      for (int64_t t = 0; t < cl; ++t) gam[t] = t ? gam[t - 1] + ggate(c, tb + t, h, 0) : ggate(c, tb + t, h, 0);
      exp_row(gam, E, cl);
    }
    // QKL[t][s] = scale * (q_t . k_s)_L (s <= t), A[t][s] = beta_t (k_t . k_s)_L (s < t), where
    // (x . y)_L = sum_i x[i] y[i] exp(gam_t[i] - gam_s[i]).
    std::fill(QKL, QKL + cl * cl, 0.0f);
    std::fill(Am, Am + cl * cl, 0.0f);
    if (c.kda) {
      for (int64_t s0 = 0; s0 < cl; ++s0) {
        std::memcpy(kd, Kc + s0 * S, (size_t)S * sizeof(float));
        QKL[s0 * cl + s0] = c.scale * dot(Qc + s0 * S, kd, S);
        for (int64_t t = s0 + 1; t < cl; ++t) {
          for (int64_t i = 0; i < S; ++i) kd[i] *= ed[t * S + i];
          QKL[t * cl + s0] = c.scale * dot(Qc + t * S, kd, S);
          Am[t * cl + s0] = gbeta(c, tb + t, h) * dot(Kc + t * S, kd, S);
        }
      }
    } else {
      for (int64_t i = 0; i < S; ++i)
        for (int64_t t = 0; t < cl; ++t) KT[i * cl + t] = Kc[t * S + i];
      gemm(2 * cl, cl, S, QKb, S, KT, cl, Gm, cl, nullptr, 0, nullptr, false);  // [q; k] k^T
      for (int64_t t = 0; t < cl; ++t) {
        const float bt = gbeta(c, tb + t, h);
        float* l = ed;  // exp(gam_t - gam_s), s <= t
        for (int64_t s0 = 0; s0 <= t; ++s0) l[s0] = gam[t] - gam[s0];
        exp_row(l, l, t + 1);
        for (int64_t s0 = 0; s0 <= t; ++s0) {
          QKL[t * cl + s0] = c.scale * (Gm[t * cl + s0] * l[s0]);
          if (s0 < t) Am[t * cl + s0] = bt * (Gm[(cl + t) * cl + s0] * l[s0]);
        }
      }
    }
    // U = T (beta V), -W = T (-beta K e^gam) with T = (I + A)^-1 (forward substitution).
    for (int64_t t = 0; t < cl; ++t) {
      const float bt = gbeta(c, tb + t, h);
      float* u = UW + t * 2 * S;
      for (int64_t j = 0; j < S; ++j) u[j] = bt * Vb[t * S + j];
      for (int64_t i = 0; i < S; ++i) u[S + i] = -bt * (Kc[t * S + i] * (c.kda ? E[t * S + i] : E[t]));
    }
    trsv(cl, Am, cl, UW, 2 * S, 2 * S);
    // End-of-chunk factors: rs = e^{gam_last}, KdT[i][t] = k_t[i] e^{gam_last[i] - gam_t[i]}.
    const int64_t last = cl - 1;
    if (c.kda) {
      for (int64_t i = 0; i < S; ++i) {
        rs[i] = E[last * S + i];
        for (int64_t t = 0; t < cl; ++t) KdT[i * cl + t] = Kc[t * S + i] * gam[t * S + i];
      }
    } else {
      for (int64_t t = 0; t < cl; ++t) ed[t] = gam[last] - gam[t];
      exp_row(ed, ed, cl);
      for (int64_t i = 0; i < S; ++i) {
        rs[i] = E[last];
        for (int64_t t = 0; t < cl; ++t) KdT[i * cl + t] = Kc[t * S + i] * ed[t];
      }
    }
    // q rows -> scale * q * e^gam (G, which read them, is done).
    for (int64_t t = 0; t < cl; ++t)
      for (int64_t i = 0; i < S; ++i) Qc[t * S + i] = c.scale * (Qc[t * S + i] * (c.kda ? E[t * S + i] : E[t]));
    // V' = U - W M (into U), O = (scale q e^gam) M + QKL V', M <- rs * M + KdT V'.
    gemm(cl, S, S, UW + S, 2 * S, Mcur, S, UW, 2 * S, UW, 2 * S, nullptr, false);
    float* O = c.o + tb * ldo + h * S;
    gemm(cl, S, S, Qc, S, Mcur, S, O, ldo, nullptr, 0, nullptr, false);
    gemm(cl, S, cl, QKL, cl, UW, 2 * S, O, ldo, O, ldo, nullptr, true);
    float* Mnext = c0 + cl >= n_c ? Mfinal : scr + L.M;
    gemm(S, S, cl, KdT, cl, UW, 2 * S, Mnext, S, Mcur, S, rs, false);
    Mcur = Mnext;
  }
}

// ---- gated_delta_net: one (segment, value head) ----------------------------------------------------

void gdn_item(const GdnCtx& c, const Seg& s, int64_t h, const GdnScratch& L, float* scr) {
  const int64_t S = c.S, SS = S * S, n = s.n;
  const int64_t hk = c.broadcast == 0 ? h % c.Hk : h / (c.Hv / c.Hk);
  const int64_t n_snap = std::min(n, c.P);
  auto plane = [&](int64_t i) { return c.state + ((i * c.n_slot + s.slot) * c.Hv + h) * SS; };
  const float* Mcur = plane(s.src);
  float* Mscr = scr + L.M;
  int64_t t = 0;
  if (c.chunk_min > 0 && n >= c.chunk_min) {
    // Chunked up to the oldest snapshot (plane n_snap - 1), token-serial after it.
    const int64_t n_c = n - (n_snap - 1);
    gdn_chunked(c, s, h, hk, n_c, Mcur, plane(n_snap - 1), L, scr);
    Mcur = plane(n_snap - 1);
    t = n_c;
  }
  if (t >= n) return;
  float* a = scr + L.a;
  float* b = scr + L.b;
  float* delta = scr + L.delta;
  float* prep = scr + L.prep0;
  float* nprep = scr + L.prep1;
  float kq = gdn_prep(c, s.t0 + t, h, hk, prep);
  read_pass(Mcur, S, prep + S, prep + 2 * S, a, b);
  for (; t < n; ++t) {
    const int64_t tg = s.t0 + t;
    const float bt = gbeta(c, tg, h);
    const float* v = gv(c, tg, h);
    float* o = c.o + tg * c.Hv * S + h * S;
    for (int64_t j = 0; j < S; ++j) {
      delta[j] = bt * (v[j] - a[j]);
      o[j] = c.scale * (b[j] + kq * delta[j]);
    }
    // The state after this token: a snapshot plane when it is one, else the scratch copy.
    const int64_t after = n - 1 - t;  // tokens left after this one
    float* Out = after < n_snap ? plane(after) : Mscr;
    const float* k = gk(c, tg, hk);
    if (t + 1 < n) {
      const float nkq = gdn_prep(c, tg + 1, h, hk, nprep);
      update_pass<true>(Mcur, Out, S, prep, k, delta, nprep + S, nprep + 2 * S, a, b);
      std::swap(prep, nprep);
      kq = nkq;
    } else {
      update_pass<false>(Mcur, Out, S, prep, k, delta, nullptr, nullptr, a, b);
    }
    Mcur = Out;
  }
}

#endif  // PYFAST_SSM_ISA_BODY
