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

namespace pyfast {

namespace {
struct Cand {
  float v;
  int32_t i;
};
// true when a ranks before b (is "better")
inline bool better(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }
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
  for (; j < n; ++j) {
    const float v = x[j];
    if (!(v > thr)) continue;  // equal values with a larger index never win; NaN fails too
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
