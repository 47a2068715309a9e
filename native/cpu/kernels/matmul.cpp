// matmul: dst[..., M, N] = x[..., M, K] @ w[N, K].T  (x f32; w F32/F16/BF16 or quantized:
// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K).
//
// Quantized weights: the activation rows are quantized once per op into the shared scratch
// (split over threads by rows), then after a barrier the output is split into work items of up
// to 16 weight rows x 64 activation rows; each thread takes a contiguous range of items
// (weight-chunk major, so a thread reuses its weight rows from cache across row chunks). With at
// most kPrivateRows rows each thread quantizes all of them into its own area instead, and there
// is no barrier (cpu_matmul_syncs tells the plan which case a node is). Either way a thread done
// with its range then takes the remaining items of the others from their far end (WorkRanges,
// cpu.h), so that a step does not wait for the thread whose core or share of the memory bandwidth
// was slowest.
// Float weights read x in place (no barrier). Each output element is computed by exactly one
// kernel call with a fixed per-pair reduction order (see cpu/quant/quant.h), so results do not
// depend on M, the thread count or the tiling.
#include <cstdint>
#include <vector>

#include "cpu/quant/quant.h"
#include "pyfast/cpu.h"

namespace pyfast {

namespace {

constexpr size_t kAlign = 64;
inline size_t align_up(size_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

// Up to this many activation rows, every thread quantizes all of them into its own area instead
// of a share into the common one: a little redundant work, but no barrier (decode steps and
// short verify batches run many small matmuls).
constexpr int64_t kPrivateRows = 4;

struct QLayout {
  int64_t R = 0, K = 0, nb = 0;
  size_t q = 0, d = 0, s = 0, f = 0, h = 0, scratch = 0, scratch_per_thread = 0, total = 0;
  size_t act_per_thread = 0;  // != 0: thread ith's activations at ith * act_per_thread
};

QLayout qlayout(int64_t R, int64_t K, int nth) {
  QLayout L;
  L.R = R;
  L.K = K;
  L.nb = K / QK;
  nth = nth > 0 ? nth : 1;
  const int64_t R4 = (R + 3) & ~(int64_t)3;
  size_t off = 0;
  L.q = off;
  off = align_up(off + (size_t)(R * K));
  const size_t meta = (size_t)(R4 * L.nb) * 4;  // bytes of one f32/i32 meta array
  L.d = off;
  off = align_up(off + meta);
  L.s = off;
  off = align_up(off + meta);
  L.f = off;
  off = align_up(off + meta);
  L.h = off;
  off = align_up(off + meta);
  if (R <= kPrivateRows && nth > 1) {
    L.act_per_thread = off;
    off *= (size_t)nth;
  }
  L.scratch = off;
  L.scratch_per_thread = align_up(mm::qjob_scratch_floats(L.nb) * sizeof(float));
  off += L.scratch_per_thread * (size_t)nth;
  L.total = off;
  return L;
}

// Rows of a tensor (all dims but the innermost; at most 3 of them).
mm::RowView row_view(const Node& n) {
  mm::RowView v;
  v.base = n.data;
  int64_t d[3] = {1, 1, 1}, s[3] = {0, 0, 0};
  const int outer = n.shape.ndim - 1;
  for (int i = 0; i < outer && i < 3; ++i) {
    d[2 - i] = n.shape.dims[outer - 1 - i];
    s[2 - i] = n.shape.strides[outer - 1 - i];
  }
  v.d0 = d[0];
  v.d1 = d[1];
  v.d2 = d[2];
  v.s0 = s[0];
  v.s1 = s[1];
  v.s2 = s[2];
  v.finalize();
  return v;
}

int64_t n_rows(const Node& n) {
  int64_t r = 1;
  for (int i = 0; i < n.shape.ndim - 1; ++i) r *= n.shape.dims[i];
  return r;
}

bool is_quant(DType t) {
  switch (t) {
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      return true;
    default:
      return false;
  }
}

}  // namespace

bool matmul_weight_supported(DType t) {
  return is_quant(t) || t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

size_t cpu_matmul_work_size(const Node& dst, const Node* const* src, int nth) {
  (void)dst;
  const Node& x = *src[0];
  const Node& w = *src[1];
  if (!is_quant(w.dtype)) return 0;
  return qlayout(n_rows(x), x.shape.dims[x.shape.ndim - 1], nth).total + kAlign;
}

// Whether cpu_matmul calls p.barrier() (quantized weights with more than kPrivateRows rows);
// used by the plan, which may run a share (ith) of a kernel without barriers on any thread.
bool cpu_matmul_syncs(const Node& dst, const Node* const* src, int nth) {
  (void)dst;
  return nth > 1 && is_quant(src[1]->dtype) && n_rows(*src[0]) > kPrivateRows;
}

// Several matmuls of one activation tensor (quantized weights, one K): the rows are quantized
// once and the work items run over the weights' 16-row chunks one weight after another. Each
// output element is computed exactly as by its own matmul (same chunk boundaries and kernel).
void cpu_matmul_multi(const ComputeParams& p, Node* const* dsts, const Node* const* ws, int nw, const Node& x) {
  const int64_t K = x.shape.dims[x.shape.ndim - 1];
  const int64_t R = n_rows(x);
  const mm::RowView xv = row_view(x);
  CpuIsa isa = p.isa;
  if (isa != CpuIsa::avx2 && isa != CpuIsa::avx512 && isa != CpuIsa::neon) isa = CpuIsa::scalar;
  const int64_t cn = mm::kChunkN;
  const int64_t n_mc = (R + mm::kChunkM - 1) / mm::kChunkM;
  int64_t n_nc = 0;
  for (int i = 0; i < nw; ++i) n_nc += (ws[i]->shape.dims[0] + cn - 1) / cn;
  const QLayout L = qlayout(R, K, p.nth);
  uint8_t* base = (uint8_t*)(((uintptr_t)p.wdata + kAlign - 1) & ~(uintptr_t)(kAlign - 1));
  uint8_t* act = base + L.act_per_thread * (size_t)p.ith;
  mm::ActQ a;
  a.q = reinterpret_cast<int8_t*>(act + L.q);
  a.d = reinterpret_cast<float*>(act + L.d);
  a.s = reinterpret_cast<int32_t*>(act + L.s);
  a.f = reinterpret_cast<float*>(act + L.f);
  a.h = reinterpret_cast<int32_t*>(act + L.h);
  a.K = K;
  a.nb = L.nb;
  // Phase 1: quantize this thread's activation rows (all of them into its own area when they
  // are few; the quantization is per row, so the copies are identical).
  auto quant = isa == CpuIsa::avx512 ? mm::quant_act_avx512
             : isa == CpuIsa::avx2   ? mm::quant_act_avx2
             : isa == CpuIsa::neon   ? mm::quant_act_neon
                                     : mm::quant_act_scalar;
  int64_t r0 = 0, r1 = R;
  if (!L.act_per_thread) split_range(R, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const size_t mi = a.meta(r, 0);
    quant(reinterpret_cast<const float*>(xv.row(r)), const_cast<int8_t*>(a.q) + r * K,
          const_cast<float*>(a.d) + mi, const_cast<int32_t*>(a.s) + mi, const_cast<float*>(a.f) + mi,
          const_cast<int32_t*>(a.h) + mi, L.nb);
  }
  if (!L.act_per_thread) p.barrier();
  // Phase 2: this thread's work items.
  mm::QJob j;
  j.a = a;
  j.scratch = reinterpret_cast<float*>(base + L.scratch + L.scratch_per_thread * (size_t)p.ith);
  // Items in steps of at most about 1/16 of a share, shrinking to single items at its end; a
  // thread that finishes its share early takes the rest of a slower one (WorkRanges), whether the
  // rows were quantized per thread (few rows) or shared after the barrier. Which thread computes
  // an item does not change its result.
  const int64_t n_items = n_nc * n_mc;
  const int64_t step = n_items / ((int64_t)p.nth * 16) + 1;
  WorkRanges wr(p.ith, p.nth, p.ranges, n_items, step);
  int64_t it0, it1;
  // the weight rows whose decoded blocks this thread's scratch holds (QJob::reuse)
  const uint8_t* dec_w = nullptr;
  int64_t dec_n0 = -1;
  bool stored = false;
  j.stored = &stored;
  while (wr.next(it0, it1)) {
    int wi = 0;
    int64_t wc0 = 0;  // first global chunk of weight wi
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t gc = it / n_mc, mc = it % n_mc;
      while (gc >= wc0 + (ws[wi]->shape.dims[0] + cn - 1) / cn) wc0 += (ws[wi++]->shape.dims[0] + cn - 1) / cn;
      const Node& w = *ws[wi];
      const int64_t N = w.shape.dims[0];
      j.wt = w.dtype;
      j.w = w.data;
      j.w_stride = w.shape.strides[0];
      j.packed = w.packed;
      j.y = row_view(*dsts[wi]);
      j.n0 = (gc - wc0) * cn;
      j.n1 = j.n0 + cn < N ? j.n0 + cn : N;
      j.m0 = mc * mm::kChunkM;
      j.m1 = j.m0 + mm::kChunkM < R ? j.m0 + mm::kChunkM : R;
      j.reuse = stored && j.w == dec_w && j.n0 == dec_n0;
      stored = false;
      mm::qgemm_run(isa, j, K);
      dec_w = j.w;
      dec_n0 = j.n0;
    }
  }
}

bool cpu_matmul_fusable(const Node& a, const Node* const* asrc, const Node& b, const Node* const* bsrc) {
  return a.op == Op::matmul && b.op == Op::matmul && asrc[0] == bsrc[0] && is_quant(asrc[1]->dtype) &&
         is_quant(bsrc[1]->dtype) && asrc[1]->shape.dims[1] == bsrc[1]->shape.dims[1];
}

void cpu_matmul(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node& x = *src[0];
  const Node& w = *src[1];
  if (is_quant(w.dtype)) {
    Node* d = &dst;
    return cpu_matmul_multi(p, &d, &src[1], 1, x);
  }
  const int64_t K = x.shape.dims[x.shape.ndim - 1];
  const int64_t N = w.shape.dims[0];
  const int64_t R = n_rows(x);
  const mm::RowView xv = row_view(x);
  const mm::RowView yv = row_view(dst);
  CpuIsa isa = p.isa;
  if (isa != CpuIsa::avx2 && isa != CpuIsa::avx512 && isa != CpuIsa::neon) isa = CpuIsa::scalar;
  const int64_t cn = mm::kChunkN;
  const int64_t n_nc = (N + cn - 1) / cn;
  const int64_t n_mc = (R + mm::kChunkM - 1) / mm::kChunkM;
  int64_t it0, it1;
  split_range(n_nc * n_mc, p.ith, p.nth, it0, it1);

  auto gemm = isa == CpuIsa::avx512 ? mm::fgemm_avx512 : isa == CpuIsa::avx2 ? mm::fgemm_avx2 : isa == CpuIsa::neon ? mm::fgemm_neon : mm::fgemm_scalar;
  mm::FJob j;
  j.wt = w.dtype;
  j.w = w.data;
  j.w_stride = w.shape.strides[0];
  j.x = xv;
  j.K = K;
  j.y = yv;
  for (int64_t it = it0; it < it1; ++it) {
    const int64_t nc = it / n_mc, mc = it % n_mc;
    j.n0 = nc * cn;
    j.n1 = j.n0 + cn < N ? j.n0 + cn : N;
    j.m0 = mc * mm::kChunkM;
    j.m1 = j.m0 + mm::kChunkM < R ? j.m0 + mm::kChunkM : R;
    gemm(j);
  }
}

}  // namespace pyfast
