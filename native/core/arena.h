// The plan arena: intermediates share one allocation, placed by a first-fit offset allocator
// in node order and released after their last use (shared by the CPU and device plans).
#pragma once
#include <algorithm>
#include <cstddef>
#include <iterator>
#include <map>

namespace pyfast {
namespace arena {

constexpr size_t kAlign = 64;
inline size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// First-fit offset allocator over a virtual arena; records the high-water mark.
class Allocator {
 public:
  size_t alloc(size_t n) {
    n = align_up(n);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= n) {
        const size_t off = it->first, sz = it->second;
        free_.erase(it);
        if (sz > n) free_[off + n] = sz - n;
        return off;
      }
    }
    // Grow at the end (merging with a trailing free block if there is one).
    size_t off = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) { off = last->first; free_.erase(last); }
    }
    top_ = std::max(top_, off + n);
    return off;
  }
  void release(size_t off, size_t n) {
    n = align_up(n);
    auto it = free_.emplace(off, n).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) { it->second += next->second; free_.erase(next); }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) { prev->second += it->second; free_.erase(it); }
    }
  }
  size_t high_water() const { return top_; }

 private:
  std::map<size_t, size_t> free_;
  size_t top_ = 0;
};

}  // namespace arena
}  // namespace pyfast
