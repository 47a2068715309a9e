// Measured memory read bandwidth: the roofline that token generation is judged against (each
// generated token streams every weight once). The buffer is allocated the way the model loader
// keeps weights (anonymous memory advised to use transparent huge pages: in a VM, 4 KiB pages
// cost a large share of the bandwidth in page walks) and is much larger than the caches. Each
// thread streams its own contiguous slice; two read loops are tried (64-bit scalar loads with
// eight accumulators, and 64-byte vector loads where the CPU has AVX-512) and the best pass of
// either is reported, for every thread count alike.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

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

#if defined(__x86_64__) || defined(_M_X64)
// 64-byte loads, four accumulators; n a multiple of 256 (slices are whole 4 KiB pages).
__attribute__((target("avx512f"))) uint64_t read_slice_avx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
  }
  return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}
#endif

// Anonymous memory as the model loader allocates weights (bind_core.cpp HostBuffer), aligned to
// 2 MiB so that every part of it can be a huge page.
struct ProbeBuffer {
  uint8_t* p = nullptr;
  void* base = nullptr;
  size_t alloc = 0;
  bool mapped = false;
  explicit ProbeBuffer(size_t n) {
    constexpr size_t kHuge = size_t(2) << 20;
#if defined(__unix__) || defined(__APPLE__)
    alloc = n + kHuge;
    base = mmap(nullptr, alloc, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    mapped = true;
    p = reinterpret_cast<uint8_t*>(((uintptr_t)base + kHuge - 1) & ~(uintptr_t)(kHuge - 1));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, n, MADV_HUGEPAGE);
#endif
#else
    if (posix_memalign(&base, 4096, n) != 0) throw std::bad_alloc();
    p = static_cast<uint8_t*>(base);
#endif
  }
  ~ProbeBuffer() {
#if defined(__unix__) || defined(__APPLE__)
    if (mapped) munmap(base, alloc);
#else
    std::free(base);
#endif
  }
};

}  // namespace

double cpu_read_bandwidth(size_t nbytes, ThreadPool* pool, int reps) {
  if (nbytes < (size_t(1) << 20)) throw std::invalid_argument("read bandwidth: use at least 1 MiB");
  if (reps < 1) throw std::invalid_argument("read bandwidth: reps must be >= 1");
  nbytes &= ~size_t(4095);
  ProbeBuffer mem(nbytes);
  uint8_t* buf = mem.p;
  for (size_t i = 0; i < nbytes; ++i) buf[i] = (uint8_t)(i * 131u);
  const int nth = pool ? pool->size() : 1;
  std::vector<uint64_t> sink(nth * 8, 0);
  using Reader = uint64_t (*)(const uint8_t*, size_t);
  std::vector<Reader> readers = {read_slice};
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_features().avx512f) readers.push_back(read_slice_avx512);
#endif
  double best = 0.0;
  for (Reader rd : readers) {
    for (int r = 0; r < reps + 1; ++r) {  // the first pass warms the TLB and the threads
      const auto t0 = std::chrono::steady_clock::now();
      auto body = [&](int ith) {
        int64_t b, e;
        split_range((int64_t)(nbytes / 4096), ith, nth, b, e);
        sink[ith * 8] += rd(buf + b * 4096, (size_t)(e - b) * 4096);
      };
      if (pool) pool->run(body);
      else body(0);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0 && dt > 0) best = std::max(best, (double)nbytes / dt);
    }
  }
  volatile uint64_t keep = 0;
  for (uint64_t s : sink) keep = keep + s;
  (void)keep;
  return best;
}

}  // namespace pyfast
