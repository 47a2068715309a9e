// CPU backend: the kernel interface, ISA selection and helpers shared by kernels.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "pyfast/graph.h"
#include "pyfast/threadpool.h"

namespace pyfast {

// Which SIMD path kernels use. `scalar` is the reference mode the tests use as an oracle.
enum class CpuIsa : int32_t { scalar = 0, avx2 = 1, avx512 = 2, neon = 3 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false, avx512bf16 = false;
  bool avxvnni = false, neon = false, dotprod = false;
};
const CpuFeatures& cpu_features();
// The best ISA this machine has.
CpuIsa cpu_best_isa();
// Current ISA used by kernels (default: best); setting one the machine lacks throws.
CpuIsa cpu_isa();
void set_cpu_isa(CpuIsa isa);
const char* cpu_isa_name(CpuIsa isa);

struct ComputeParams {
  int ith = 0, nth = 1;
  uint8_t* wdata = nullptr;  // shared scratch (size from kernel_work_size)
  size_t wsize = 0;
  ThreadPool* pool = nullptr;
  CpuIsa isa = CpuIsa::scalar;
  uint64_t run_id = 0;  // != 0: this plan run's number, unique in the process (per-run caches key on it)
  // [nth] words zeroed before each run, private to this node (null when a kernel must split its
  // work statically): see WorkRanges.
  std::atomic<uint64_t>* ranges = nullptr;
  void barrier() const { if (pool && nth > 1) pool->barrier(); }
};

// Work items [0, n) of one node, split into nth contiguous ranges (split_range); a thread takes
// items from the front of its own range in steps (a quarter of what is left, at most `step`), then
// from the back of the others' (half of what is left, at most `step`). So a thread that streams
// its weights faster (or started earlier) takes over the rest of a slower one instead of waiting
// for it, and the last takes are single items. Each item is taken exactly once; which thread
// computes an item does not change its value. Without p.ranges (one thread, or a caller that does
// not provide them) share ith is exactly its static range.
class WorkRanges {
 public:
  // ranges: ComputeParams::ranges of the node, or null for the static split.
  WorkRanges(int ith, int nth, std::atomic<uint64_t>* ranges, int64_t n, int64_t step);
  // The next items [b, e) for this share; false when none are left anywhere.
  bool next(int64_t& b, int64_t& e);

 private:
  uint64_t get(int t) const;
  int ith_, nth_;
  std::atomic<uint64_t>* ranges_;
  int64_t n_, step_;
  int victim_ = -1;  // -1: own range; then the others in order
  bool static_done_ = false;
};

// Kernel entry points (one per non-view op), named cpu_<op>.
using Src = const Node*;
#define X(name, n_src, is_view) void cpu_##name(const ComputeParams& p, Node& dst, const Node* const* src);
#include "pyfast/ops.def"
#undef X

// Scratch bytes an op needs (shared by all threads), given the thread count.
size_t cpu_work_size(const Node& dst, const Node* const* src, int nth);

// Best-of-reps read bandwidth in bytes/s over an nbytes buffer split across the pool's threads.
double cpu_read_bandwidth(size_t nbytes, ThreadPool* pool, int reps);

// Writes the indices of the k largest of x[0..n) (value descending, index ascending; NaN as -inf)
// to out; returns min(k, n).
int64_t cpu_topk_row(const float* x, int64_t n, int64_t k, int32_t* out);

// The sampler chain after penalties (pyfast/sampling.py): top-k (0 < k < n) -> min-p (0 disables)
// -> top-p (1 disables) -> temperature (> 0) -> softmax. Writes the kept ids (most likely first)
// and their probabilities (float64, sum 1) to ids / probs (room for k each); returns how many.
// Throws std::invalid_argument on bad parameters or a row with no finite maximum.
int64_t cpu_sample_candidates(const float* x, int64_t n, int64_t k, double top_p, double min_p, double temp,
                              int32_t* ids, double* probs);
// Index of the entry of probs[0..n) that u in [0, 1) selects: the first whose running sum exceeds
// u times the total.
int64_t cpu_sample_draw(const double* probs, int64_t n, double u);

// Split [0, n) into nth nearly equal parts; returns [begin, end) for thread ith.
inline void split_range(int64_t n, int ith, int nth, int64_t& b, int64_t& e) {
  const int64_t per = (n + nth - 1) / nth;
  b = per * ith;
  e = b + per < n ? b + per : n;
  if (b > n) b = n;
}

// fp16 / bf16 conversion (scalar; SIMD paths live in the kernels).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n);  // F16C when the ISA has it
inline float bf16_to_fp32(uint16_t h) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)h << 16;
  return v.f;
}
uint16_t fp32_to_bf16(float f);

// Convert one contiguous row of n elements of type t to f32 (any supported type).
void row_to_f32(DType t, const void* src, float* dst, int64_t n);
// Convert a row of n f32 values to type t (F32, F16, BF16, Q8_0, Q4_0, Q4_1: reference quantizers).
void row_from_f32(DType t, const float* src, void* dst, int64_t n);

}  // namespace pyfast
