// WorkRanges (cpu.h): per-run work ranges of one node that threads take items from and steal
// from each other. Each range is one 64-bit word: bit 63 set once initialized, then the first
// item still to take (31 bits) and one past the last (31 bits). The plan zeroes the words before
// every run; the first thread to touch a range installs its static split (every thread computes
// the same one), so no ordering between threads is needed.
#include <algorithm>

#include "pyfast/cpu.h"

namespace pyfast {

namespace {

constexpr uint64_t kInit = uint64_t(1) << 63;
constexpr uint64_t kMask = (uint64_t(1) << 31) - 1;

inline uint64_t pack(int64_t b, int64_t e) { return kInit | ((uint64_t)b << 31) | (uint64_t)e; }
inline int64_t lo(uint64_t v) { return (int64_t)((v >> 31) & kMask); }
inline int64_t hi(uint64_t v) { return (int64_t)(v & kMask); }

}  // namespace

WorkRanges::WorkRanges(int ith, int nth, std::atomic<uint64_t>* ranges, int64_t n, int64_t step)
    : ith_(ith), nth_(nth), ranges_(n <= (int64_t)kMask ? ranges : nullptr), n_(n), step_(std::max<int64_t>(step, 1)) {}

uint64_t WorkRanges::get(int t) const {
  std::atomic<uint64_t>& w = ranges_[t];
  uint64_t v = w.load(std::memory_order_acquire);
  if (v & kInit) return v;
  int64_t b, e;
  split_range(n_, t, nth_, b, e);
  const uint64_t init = pack(b, e);
  if (w.compare_exchange_strong(v, init, std::memory_order_acq_rel)) return init;
  return v;  // another thread installed it (the same value) or already took items
}

bool WorkRanges::next(int64_t& b, int64_t& e) {
  if (!ranges_ || nth_ <= 1) {
    if (static_done_) return false;
    static_done_ = true;
    split_range(n_, ith_, nth_, b, e);
    return b < e;
  }
  while (true) {
    const int t = victim_ < 0 ? ith_ : victim_;
    std::atomic<uint64_t>& w = ranges_[t];
    uint64_t v = get(t);
    while (lo(v) < hi(v)) {
      // Guided steps: a quarter of what is left in one's own range (half of another's), at
      // most step_, at least one item. The takes shrink toward a range's end, so less of it is
      // held by a thread that is still working when another runs out of items.
      const int64_t left = hi(v) - lo(v);
      const int64_t take = std::max<int64_t>(1, std::min(step_, victim_ < 0 ? left / 4 : left / 2));
      // own range: from the front (keeps one stream per thread); another's: from the back
      const uint64_t nv = victim_ < 0 ? pack(lo(v) + take, hi(v)) : pack(lo(v), hi(v) - take);
      if (w.compare_exchange_weak(v, nv, std::memory_order_acq_rel)) {
        if (victim_ < 0) {
          b = lo(v);
          e = b + take;
        } else {
          e = hi(v);
          b = e - take;
        }
        return true;
      }
    }
    // this range is empty: the next victim (every other share once)
    int nx = victim_ < 0 ? ith_ + 1 : victim_ + 1;
    if (nx >= nth_) nx = 0;
    if (nx == ith_) return false;
    victim_ = nx;
  }
}

}  // namespace pyfast
