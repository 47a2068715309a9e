// Top-k of one row for the samplers: the k largest values of x[0..n) under the total order
// (value descending, index ascending), NaN treated as -inf. One pass with a k-sized min-heap;
// an element that cannot beat the heap's worst is rejected by a single compare, so a 50k-entry
// vocabulary costs a few tens of microseconds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "pyfast/cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PF_TOPK_AVX2 1
#endif

namespace pyfast {

namespace {
struct Cand {
  float v;
  int32_t i;
};
// true when a ranks before b (is "better")
inline bool better(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// First j in [j, n) with x[j] > thr (NaN never is), or n. The scan is where the time goes: almost
// every element of a vocabulary row loses to the heap's worst.
inline int64_t next_above_scalar(const float* x, int64_t j, int64_t n, float thr) {
  while (j < n && !(x[j] > thr)) ++j;
  return j;
}
#ifdef PF_TOPK_AVX2
__attribute__((target("avx2"))) int64_t next_above_avx2(const float* x, int64_t j, int64_t n, float thr) {
  const __m256 t = _mm256_set1_ps(thr);
  for (; j + 32 <= n; j += 32) {
    const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(x + j), t, _CMP_GT_OQ);
    const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 8), t, _CMP_GT_OQ);
    const __m256 c = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 16), t, _CMP_GT_OQ);
    const __m256 d = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 24), t, _CMP_GT_OQ);
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(a, b), _mm256_or_ps(c, d))) != 0) break;
  }
  return next_above_scalar(x, j, n, thr);
}
#endif
}  // namespace

int64_t cpu_topk_row(const float* x, int64_t n, int64_t k, int32_t* out) {
  if (k <= 0 || n <= 0) return 0;
  if (k > n) k = n;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<Cand> heap;  // min-heap by `better`: heap.front() is the worst kept
  heap.reserve((size_t)k);
  auto worse_first = [](const Cand& a, const Cand& b) { return better(a, b); };
  int64_t j = 0;
  for (; j < n && (int64_t)heap.size() < k; ++j) {
    const float v = std::isnan(x[j]) ? ninf : x[j];
    heap.push_back({v, (int32_t)j});
    std::push_heap(heap.begin(), heap.end(), worse_first);
  }
  float thr = heap.front().v;
#ifdef PF_TOPK_AVX2
  const bool avx2 = cpu_isa() != CpuIsa::scalar && cpu_features().avx2;
#endif
  for (; j < n; ++j) {
    // equal values with a larger index never win; NaN fails too
#ifdef PF_TOPK_AVX2
    j = avx2 ? next_above_avx2(x, j, n, thr) : next_above_scalar(x, j, n, thr);
#else
    j = next_above_scalar(x, j, n, thr);
#endif
    if (j >= n) break;
    const float v = x[j];
    std::pop_heap(heap.begin(), heap.end(), worse_first);
    heap.back() = {v, (int32_t)j};
    std::push_heap(heap.begin(), heap.end(), worse_first);
    thr = heap.front().v;
  }
  std::sort(heap.begin(), heap.end(), better);
  for (int64_t t = 0; t < k; ++t) out[t] = heap[(size_t)t].i;
  return k;
}

}  // namespace pyfast
