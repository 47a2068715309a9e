// Mixture-of-experts routing: top-k selection, gather along the last dim and the
// expert-indexed matmul.
//
// matmul_id (x[T, K] or [T, k, K], w[E, N, K], ids[T, k] -> y[T, k, N], y[t, j] = x[t(, j)] @
// w[ids[t, j]].T) runs on matmul's machinery (cpu/quant/quant.h): the same activation
// quantization, done once per activation row, and the same per-(row, weight-row) kernels, so
// y[t, j] is bit-identical to matmul(x[t:t+1], w[ids[t, j]]) whatever the batch, the routing of
// the other rows or the thread count. To stream each selected expert's weights once per op, the
// (t, j) pairs are sorted by expert (counting sort, stable in (t, j) order) and their activation
// rows copied into one buffer where each expert's rows are contiguous (groups start on a multiple
// of 4 rows, so the kernels' 4-row tiles stay aligned). Work items are (expert, 16 weight rows,
// up to 64 of its rows), expert-major, split over threads by an estimated cost (small batches:
// one equal range per thread, which the others steal from once theirs is done; see phase 3);
// each item's results go to a small per-thread tile and from there to the pairs' output rows.
//
//   phase 1: every thread checks all ids (a bad id throws on every thread, before any barrier);
//            thread 0 builds the routing tables; quantized weights: each thread quantizes its
//            share of the activation rows.
//   phase 2: the pairs' activation rows (quantized, or f32 for float weights) are copied into
//            expert order.
//   phase 3: the work items.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "cpu/kernels/common.h"
#include "cpu/quant/quant.h"

namespace pyfast {

namespace {

constexpr size_t kAlign = 64;
inline size_t align_up(size_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }
inline uint8_t* align_ptr(uint8_t* p) { return (uint8_t*)(((uintptr_t)p + kAlign - 1) & ~(uintptr_t)(kAlign - 1)); }

bool is_quant(DType t) {
  switch (t) {
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      return true;
    default:
      return false;
  }
}

// topk order: a before b when a's value is larger; NaN after every number; ties by index.
struct TopkLess {
  const float* x;
  int64_t st;
  bool operator()(int32_t a, int32_t b) const {
    const float va = x[a * st], vb = x[b * st];
    const bool na = std::isnan(va), nb = std::isnan(vb);
    if (na || nb) return na == nb ? a < b : nb;
    if (va != vb) return va > vb;
    return a < b;
  }
};

[[noreturn]] void bad_id(const char* op, const std::string& where, int64_t v, int64_t E) {
  throw std::invalid_argument(std::string("[") + op + "] " + where + " = " + std::to_string(v) +
                              " is out of range [0, " + std::to_string(E) + ")");
}

// ---- matmul_id scratch layout -----------------------------------------------------------------

struct MoeLayout {
  int64_t T = 0, k = 0, E = 0, N = 0, K = 0, nb = 0;
  int64_t R = 0;  // activation rows of x: T (2-D x) or T * k
  int64_t P = 0;  // (t, j) pairs: T * k
  int64_t S = 0;  // rows of the expert-ordered buffer (groups padded to 4 rows), multiple of 4
  bool quant = false;
  // byte offsets from the aligned scratch base
  size_t cnt = 0, off = 0, slot = 0, pair = 0;  // routing: per-expert counts / group starts, pair -> row, row -> pair
  size_t aq = 0, ad = 0, as = 0, af = 0, ah = 0;  // activations in x order (quantized weights)
  size_t sq = 0, sd = 0, ss = 0, sf = 0, sh = 0;  // ... in expert order (sx: f32 rows for float weights)
  size_t thr = 0, thr_size = 0, tile_off = 0;     // per-thread areas: kernel scratch, then a 64 x 16 output tile
  // small batches (decode): every thread builds the routing tables and quantizes / orders all
  // activation rows itself, in its own copy of the areas above (priv_stride bytes apart), so the
  // op needs no barrier
  bool priv = false;
  size_t priv_stride = 0;
  size_t total = 0;
};

constexpr int64_t kTileM = mm::kChunkM;  // activation rows per work item
constexpr int64_t kTileN = mm::kChunkN;  // weight rows per work item
constexpr int64_t kPrivElems = 32768;    // MoeLayout::priv: at most this many activation elements
constexpr int64_t kPrivPairs = 64;       // ... and (t, j) pairs

MoeLayout moe_layout(const Node& x, const Node& w, const Node& ids, int nth) {
  MoeLayout L;
  L.T = ids.shape.dims[0];
  L.k = ids.shape.dims[1];
  L.E = w.shape.dims[0];
  L.N = w.shape.dims[1];
  L.K = w.shape.dims[2];
  L.quant = is_quant(w.dtype);
  L.nb = L.K / QK;
  L.P = L.T * L.k;
  L.R = x.shape.ndim == 2 ? L.T : L.P;
  L.S = (L.P + 3 * std::min(L.E, L.P) + 3) & ~(int64_t)3;
  const int64_t R4 = (L.R + 3) & ~(int64_t)3;
  size_t o = 0;
  auto take = [&](size_t bytes) { const size_t at = o; o = align_up(o + bytes); return at; };
  L.cnt = take((size_t)L.E * 8);
  L.off = take((size_t)(L.E + 1) * 8);
  L.slot = take((size_t)L.P * 8);
  L.pair = take((size_t)L.S * 8);
  if (L.quant) {
    const size_t meta_a = (size_t)(R4 * L.nb) * 4, meta_s = (size_t)(L.S * L.nb) * 4;
    L.aq = take((size_t)(L.R * L.K));
    L.ad = take(meta_a);
    L.as = take(meta_a);
    L.af = take(meta_a);
    L.ah = take(meta_a);
    L.sq = take((size_t)(L.S * L.K));
    L.sd = take(meta_s);
    L.ss = take(meta_s);
    L.sf = take(meta_s);
    L.sh = take(meta_s);
    L.tile_off = align_up(mm::qjob_scratch_floats(L.nb) * sizeof(float));
  } else {
    L.sq = take((size_t)(L.S * L.K) * 4);
    L.tile_off = 0;
  }
  L.thr_size = L.tile_off + align_up((size_t)(kTileM * kTileN) * 4);
  // The redundant work of the private mode (quantizing R x K activations, copying P rows) costs
  // a few microseconds at most, less than the two barriers it saves.
  L.priv = nth > 1 && L.R * L.K <= kPrivElems && L.P <= kPrivPairs;
  if (L.priv) {
    L.priv_stride = o;
    o *= (size_t)nth;
  }
  L.thr = o;
  o += L.thr_size * (size_t)(nth > 0 ? nth : 1);
  L.total = o + kAlign;
  return L;
}

inline int32_t id_at(const Node& ids, int64_t t, int64_t j) {
  return *reinterpret_cast<const int32_t*>(ids.data + t * ids.shape.strides[0] + j * ids.shape.strides[1]);
}

// The output tile: row m of a work item at tile + (m % 64) * 64 bytes (a RowView that wraps every
// 64 rows; d0 > 1 with stride 0 keeps finalize() from treating it as flat).
mm::RowView tile_view(uint8_t* tile) {
  mm::RowView v;
  v.base = tile;
  v.d0 = INT64_MAX / kTileM;
  v.s0 = 0;
  v.d1 = 1;
  v.s1 = 0;
  v.d2 = kTileM;
  v.s2 = kTileN * 4;
  v.finalize();
  return v;
}

}  // namespace

// Scratch bytes (shared by all threads) for this file's ops.
size_t cpu_moe_work_size(const Node& dst, const Node* const* src, int nth) {
  switch (dst.op) {
    case Op::topk: {
      const Node& a = *src[0];
      return (size_t)(nth > 0 ? nth : 1) * align_up((size_t)a.shape.dims[a.shape.ndim - 1] * 4) + kAlign;
    }
    case Op::topk_mask: {
      const Node& a = *src[0];
      return (size_t)(nth > 0 ? nth : 1) * 2 * align_up((size_t)a.shape.dims[a.shape.ndim - 1] * 4) + kAlign;
    }
    case Op::matmul_id: return moe_layout(*src[0], *src[1], *src[2], nth).total;
    default: return 0;
  }
}

// Whether matmul_id waits for the other threads inside (then its shares cannot move between
// threads, see op_shareable in core/plan.cpp): all but small batches.
bool cpu_matmul_id_syncs(const Node& dst, const Node* const* src, int nth) {
  (void)dst;
  return !moe_layout(*src[0], *src[1], *src[2], nth).priv;
}

// ---- topk ---------------------------------------------------------------------------------------

namespace {

// The k largest of one row (largest first, ties: lower index) into o[0..k); idx: E ints of scratch.
void topk_select(const TopkLess& less, int64_t E, int64_t k, int32_t* o, int32_t* idx) {
  if (k <= 16) {
    // Insertion into the sorted top-k list: one compare per element for most of them.
    int64_t n = 0;
    for (int32_t i = 0; i < (int32_t)E; ++i) {
      if (n == k && !less(i, o[k - 1])) continue;
      int64_t pos = n < k ? n++ : k - 1;
      while (pos > 0 && less(i, o[pos - 1])) {
        o[pos] = o[pos - 1];
        --pos;
      }
      o[pos] = i;
    }
  } else {
    // Select, then sort the k picks: O(E + k log k). less is a strict total order (ties go to
    // the lower index, NaN ranks last), so the result is the same as a full sort's first k.
    for (int32_t i = 0; i < (int32_t)E; ++i) idx[i] = i;
    if (k < E) std::nth_element(idx, idx + (k - 1), idx + E, less);
    std::sort(idx, idx + k, less);
    std::memcpy(o, idx, (size_t)k * 4);
  }
}

}  // namespace

void cpu_topk(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const int64_t E = sa.dims[sa.ndim - 1];
  const int64_t k = dst.params.i[0];
  const int64_t st = inner_stride(sa) / 4;
  int32_t* idx = reinterpret_cast<int32_t*>(align_ptr(p.wdata) + (size_t)p.ith * align_up((size_t)E * 4));
  int64_t r0, r1;
  split_range(n_rows(sa), p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const TopkLess less{reinterpret_cast<const float*>(a->data + row_offset(sa, r)), st};
    topk_select(less, E, k, reinterpret_cast<int32_t*>(dst.data) + r * k, idx);
  }
}

// topk_mask: the same selection as topk, written as an additive mask (0 kept, -inf elsewhere).
void cpu_topk_mask(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const int64_t E = sa.dims[sa.ndim - 1];
  const int64_t k = dst.params.i[0];
  const int64_t st = inner_stride(sa) / 4;
  int32_t* idx = reinterpret_cast<int32_t*>(align_ptr(p.wdata) + (size_t)p.ith * 2 * align_up((size_t)E * 4));
  int32_t* sel = idx + align_up((size_t)E * 4) / 4;
  int64_t r0, r1;
  split_range(n_rows(sa), p.ith, p.nth, r0, r1);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = r0; r < r1; ++r) {
    const TopkLess less{reinterpret_cast<const float*>(a->data + row_offset(sa, r)), st};
    topk_select(less, E, k, sel, idx);
    float* o = reinterpret_cast<float*>(dst.data) + r * E;
    for (int64_t i = 0; i < E; ++i) o[i] = ninf;
    for (int64_t j = 0; j < k; ++j) o[sel[j]] = 0.0f;
  }
}

// ---- gather -------------------------------------------------------------------------------------

void cpu_gather(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Node* ids = src[1];
  const Shape& sa = a->shape;
  const Shape& si = ids->shape;
  const int64_t E = sa.dims[sa.ndim - 1], k = si.dims[si.ndim - 1];
  const int64_t sta = inner_stride(sa) / 4, sti = inner_stride(si) / 4;
  int64_t r0, r1;
  split_range(n_rows(si), p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
    const int32_t* id = reinterpret_cast<const int32_t*>(ids->data + row_offset(si, r));
    float* o = reinterpret_cast<float*>(dst.data) + r * k;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t v = id[j * sti];
      if (v < 0 || v >= E) bad_id("gather", "ids row " + std::to_string(r) + ", column " + std::to_string(j), v, E);
      o[j] = x[v * sta];
    }
  }
}

// ---- matmul_id ----------------------------------------------------------------------------------

void cpu_matmul_id(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node& x = *src[0];
  const Node& w = *src[1];
  const Node& ids = *src[2];
  const MoeLayout L = moe_layout(x, w, ids, p.nth);
  const int64_t T = L.T, k = L.k, E = L.E, N = L.N, K = L.K, P = L.P;
  const bool x2 = x.shape.ndim == 2;

  // Phase 1. Every thread checks every id, so that all of them throw or none does.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = id_at(ids, t, j);
      if (e < 0 || e >= E) bad_id("matmul_id", "ids[" + std::to_string(t) + ", " + std::to_string(j) + "]", e, E);
    }

  uint8_t* const shared = align_ptr(p.wdata);  // per-thread tiles; the routing / activation areas (shared or own)
  uint8_t* base = L.priv ? shared + (size_t)p.ith * L.priv_stride : shared;
  int64_t* cnt = reinterpret_cast<int64_t*>(base + L.cnt);
  int64_t* off = reinterpret_cast<int64_t*>(base + L.off);
  int64_t* slot = reinterpret_cast<int64_t*>(base + L.slot);
  int64_t* pair = reinterpret_cast<int64_t*>(base + L.pair);
  if (p.ith == 0 || L.priv) {
    std::fill(cnt, cnt + E, 0);
    for (int64_t q = 0; q < P; ++q) ++cnt[id_at(ids, q / k, q % k)];
    off[0] = 0;
    for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + ((cnt[e] + 3) & ~(int64_t)3);
    std::fill(pair, pair + L.S, -1);
    for (int64_t e = 0; e < E; ++e) cnt[e] = 0;  // reused as fill cursors, ends equal the counts
    for (int64_t q = 0; q < P; ++q) {
      const int32_t e = id_at(ids, q / k, q % k);
      const int64_t s = off[e] + cnt[e]++;
      slot[q] = s;
      pair[s] = q;
    }
  }

  CpuIsa isa = p.isa;
  if (isa != CpuIsa::avx2 && isa != CpuIsa::avx512 && isa != CpuIsa::neon) isa = CpuIsa::scalar;
  auto xrow = [&](int64_t r) { return reinterpret_cast<const float*>(x.data + row_offset(x.shape, r)); };

  mm::ActQ aq, sq;  // activations quantized in x order / in expert order
  if (L.quant) {
    aq.q = reinterpret_cast<int8_t*>(base + L.aq);
    aq.d = reinterpret_cast<float*>(base + L.ad);
    aq.s = reinterpret_cast<int32_t*>(base + L.as);
    aq.f = reinterpret_cast<float*>(base + L.af);
    aq.h = reinterpret_cast<int32_t*>(base + L.ah);
    sq.q = reinterpret_cast<int8_t*>(base + L.sq);
    sq.d = reinterpret_cast<float*>(base + L.sd);
    sq.s = reinterpret_cast<int32_t*>(base + L.ss);
    sq.f = reinterpret_cast<float*>(base + L.sf);
    sq.h = reinterpret_cast<int32_t*>(base + L.sh);
    aq.K = sq.K = K;
    aq.nb = sq.nb = L.nb;
    auto quant = isa == CpuIsa::avx512 ? mm::quant_act_avx512
               : isa == CpuIsa::avx2   ? mm::quant_act_avx2
               : isa == CpuIsa::neon   ? mm::quant_act_neon
                                       : mm::quant_act_scalar;
    int64_t r0 = 0, r1 = L.R;
    if (!L.priv) split_range(L.R, p.ith, p.nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
      const size_t mi = aq.meta(r, 0);
      quant(xrow(r), const_cast<int8_t*>(aq.q) + r * K, const_cast<float*>(aq.d) + mi,
            const_cast<int32_t*>(aq.s) + mi, const_cast<float*>(aq.f) + mi, const_cast<int32_t*>(aq.h) + mi, L.nb);
    }
  }
  if (!L.priv) p.barrier();

  // Phase 2: pair q's activation row into its expert-ordered row slot[q].
  {
    int64_t q0 = 0, q1 = P;
    if (!L.priv) split_range(P, p.ith, p.nth, q0, q1);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t r = x2 ? q / k : q, s = slot[q];
      if (L.quant) {
        std::memcpy(const_cast<int8_t*>(sq.q) + s * K, aq.q + r * K, (size_t)K);
        for (int64_t b = 0; b < L.nb; ++b) {
          const size_t ms = sq.meta(s, b), ma = aq.meta(r, b);
          const_cast<float*>(sq.d)[ms] = aq.d[ma];
          const_cast<int32_t*>(sq.s)[ms] = aq.s[ma];
          const_cast<float*>(sq.f)[ms] = aq.f[ma];
          const_cast<int32_t*>(sq.h)[ms] = aq.h[ma];
        }
      } else {
        const float* xr = xrow(r);
        float* o = reinterpret_cast<float*>(base + L.sq) + s * K;
        std::memcpy(o, xr, (size_t)K * 4);
      }
    }
  }
  if (!L.priv) p.barrier();

  // Phase 3: work items (expert, 16 weight rows, <= 64 of the expert's rows), expert-major; each
  // thread takes the items whose cost midpoint falls in its share (the same split on every thread).
  const int64_t n_nc = (N + kTileN - 1) / kTileN;
  constexpr int64_t kItemCost = 8;  // ~ streaming 16 weight rows, in units of one activation row
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e)
    if (cnt[e]) total += n_nc * (((cnt[e] + kTileM - 1) / kTileM) * kItemCost + cnt[e]);
  if (total == 0) return;

  uint8_t* thr = shared + L.thr + L.thr_size * (size_t)p.ith;
  uint8_t* tile = thr + L.tile_off;
  const mm::RowView yv = tile_view(tile);
  mm::QJob qj;
  mm::FJob fj;
  void (*fgemm)(const mm::FJob&) = isa == CpuIsa::avx512 ? mm::fgemm_avx512 : isa == CpuIsa::avx2 ? mm::fgemm_avx2 : isa == CpuIsa::neon ? mm::fgemm_neon : mm::fgemm_scalar;
  if (L.quant) {
    qj.wt = w.dtype;
    qj.w_stride = w.shape.strides[1];
    qj.packed = w.packed;  // each expert's rows in x16 chunks (N % 16 == 0): a chunk starts at row n0
    qj.a = sq;
    qj.y = yv;
    qj.scratch = reinterpret_cast<float*>(thr);
  } else {
    fj.wt = w.dtype;
    fj.w_stride = w.shape.strides[1];
    fj.x.base = base + L.sq;
    fj.x.d2 = L.S;
    fj.x.s2 = K * 4;
    fj.x.finalize();
    fj.K = K;
    fj.y = yv;
  }
  float* out = reinterpret_cast<float*>(dst.data);
  // One work item: weight rows n0 .. n0 + 16 of expert e against its rows m0 .. m1.
  auto item = [&](int64_t e, int64_t n0, int64_t m0, int64_t m1) {
    const uint8_t* we = w.data + e * w.shape.strides[0];
    const int64_t nv = std::min(kTileN, N - n0);
    // Weight rows n0.. are addressed from their own base, so the tile holds columns 0..nv-1.
    if (L.quant) {
      qj.w = we + n0 * qj.w_stride;
      qj.n0 = 0;
      qj.n1 = nv;
      qj.m0 = m0;
      qj.m1 = m1;
      mm::qgemm_run(isa, qj, K);
    } else {
      fj.w = we + n0 * fj.w_stride;
      fj.n0 = 0;
      fj.n1 = nv;
      fj.m0 = m0;
      fj.m1 = m1;
      fgemm(fj);
    }
    for (int64_t m = m0; m < m1; ++m)
      std::memcpy(out + pair[m] * N + n0, tile + (m % kTileM) * kTileN * 4, (size_t)nv * 4);
  };
  if (L.priv && p.ranges && p.nth > 1) {
    // Small batches (no barriers, so this share may run on any thread): every expert has at
    // most kPrivPairs <= kTileM rows, so the items are (selected expert, 16 weight rows) of
    // about equal cost, taken in steps from per-thread ranges (WorkRanges): a thread whose
    // core or share of the memory bandwidth is slower is relieved by the others instead of
    // holding up the group. The initial ranges are the expert-major shares the cost split
    // below would give.
    static_assert(kPrivPairs <= kTileM, "one item of rows per expert");
    int64_t sel[kPrivPairs];
    int64_t n_sel = 0;
    for (int64_t e = 0; e < E; ++e)
      if (cnt[e]) sel[n_sel++] = e;
    const int64_t n_items = n_sel * n_nc;
    WorkRanges wr(p.ith, p.nth, p.ranges, n_items, n_items / ((int64_t)p.nth * 16) + 1);
    int64_t it0, it1;
    while (wr.next(it0, it1))
      for (int64_t it = it0; it < it1; ++it) {
        const int64_t e = sel[it / n_nc];
        item(e, (it % n_nc) * kTileN, off[e], off[e] + cnt[e]);
      }
    return;
  }
  int64_t acc = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = cnt[e];
    if (!c) continue;
    for (int64_t nc = 0; nc < n_nc; ++nc) {
      for (int64_t m0 = off[e]; m0 < off[e] + c; m0 += kTileM) {
        const int64_t m1 = std::min(m0 + kTileM, off[e] + c);
        const int64_t cost = kItemCost + (m1 - m0);
        const int64_t owner = std::min<int64_t>(p.nth - 1, (2 * acc + cost) * p.nth / (2 * total));
        acc += cost;
        if (owner == p.ith) item(e, nc * kTileN, m0, m1);
      }
    }
  }
}

}  // namespace pyfast
