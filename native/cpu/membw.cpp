// Measured memory read bandwidth: the roofline that token generation is judged against (each
// generated token streams every weight once). Threads read disjoint slices of a buffer much
// larger than the caches; the best of several passes is reported.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "pyfast/cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace pyfast {

namespace {

// Sums 64-bit words with independent accumulators (keeps loads, not adds, the bottleneck).
uint64_t read_slice(const uint8_t* p, size_t n) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  const size_t nw = n / sizeof(uint64_t);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  size_t i = 0;
  for (; i + 8 <= nw; i += 8) {
    a0 += w[i]; a1 += w[i + 1]; a2 += w[i + 2]; a3 += w[i + 3];
    a4 += w[i + 4]; a5 += w[i + 5]; a6 += w[i + 6]; a7 += w[i + 7];
  }
  for (; i < nw; ++i) a0 += w[i];
  return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

}  // namespace

double cpu_read_bandwidth(size_t nbytes, ThreadPool* pool, int reps) {
  if (nbytes < (size_t(1) << 20)) throw std::invalid_argument("read bandwidth: use at least 1 MiB");
  if (reps < 1) throw std::invalid_argument("read bandwidth: reps must be >= 1");
  nbytes &= ~size_t(4095);
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, nbytes) != 0) throw std::bad_alloc();
  uint8_t* buf = static_cast<uint8_t*>(mem);
  for (size_t i = 0; i < nbytes; ++i) buf[i] = (uint8_t)(i * 131u);
  const int nth = pool ? pool->size() : 1;
  std::vector<uint64_t> sink(nth * 8, 0);
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {  // the first pass warms the TLB and the threads
    const auto t0 = std::chrono::steady_clock::now();
    auto body = [&](int ith) {
      int64_t b, e;
      split_range((int64_t)(nbytes / 4096), ith, nth, b, e);
      sink[ith * 8] += read_slice(buf + b * 4096, (size_t)(e - b) * 4096);
    };
    if (pool) pool->run(body);
    else body(0);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0 && dt > 0) best = std::max(best, (double)nbytes / dt);
  }
  volatile uint64_t keep = 0;
  for (uint64_t s : sink) keep = keep + s;
  (void)keep;
  std::free(mem);
  return best;
}

}  // namespace pyfast
