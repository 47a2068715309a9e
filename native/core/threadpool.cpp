#include "pyfast/threadpool.h"

#include <chrono>
#include <climits>
#include <cstdlib>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PYFAST_FUTEX 1
#else
#define PYFAST_FUTEX 0
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PYFAST_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PYFAST_PAUSE() __asm__ __volatile__("yield")
#else
#define PYFAST_PAUSE() ((void)0)
#endif

namespace pyfast {

namespace {

// Spin budgets. Ops are short, so a barrier normally completes within a few microseconds; a
// thread still waiting after that is most likely waiting for a descheduled thread, and sleeping
// hands its core over. Workers idle between runs sleep after a short spin too.
// PYFAST_SPIN_US overrides all three (0: sleep at once).
struct Spin {
  int64_t barrier_ns = 30000, start_ns = 30000, done_ns = 30000;
  Spin() {
    if (const char* e = std::getenv("PYFAST_SPIN_US")) {
      const int64_t ns = std::atoll(e) * 1000;
      if (ns >= 0) barrier_ns = start_ns = done_ns = ns;
    }
  }
};
const Spin& spin() {
  static const Spin s;
  return s;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#if PYFAST_FUTEX
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
inline void futex_wait(std::atomic<uint32_t>* w, uint32_t old) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAIT_PRIVATE, old, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<uint32_t>* w) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
#endif

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  spin();  // read the environment once, before any thread waits
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
  stop_ = true;
  generation_.fetch_add(1, std::memory_order_seq_cst);
  wake_all(generation_);
  for (auto& t : threads_) t.join();
}

void ThreadPool::wait_while(std::atomic<uint32_t>& word, uint32_t old, int64_t spin_ns) {
  if (word.load(std::memory_order_acquire) != old) return;
  if (spin_ns > 0) {
    const int64_t t0 = now_ns();
    for (int i = 1;; ++i) {
      PYFAST_PAUSE();
      if (word.load(std::memory_order_acquire) != old) return;
      if ((i & 7) == 0 && now_ns() - t0 > spin_ns) break;
    }
  }
  // Announce the sleep before the last check: a waker changes the word and then reads
  // sleepers_ (both seq_cst), so either it sees this sleeper or this thread sees the new word.
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
#if PYFAST_FUTEX
  while (word.load(std::memory_order_seq_cst) == old) futex_wait(&word, old);
#else
  {
    std::unique_lock<std::mutex> lk(sleep_mu_);
    sleep_cv_.wait(lk, [&] { return word.load(std::memory_order_seq_cst) != old; });
  }
#endif
  sleepers_.fetch_sub(1, std::memory_order_seq_cst);
}

void ThreadPool::wake_all(std::atomic<uint32_t>& word) {
  if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
#if PYFAST_FUTEX
  futex_wake(&word);
#else
  (void)word;
  { std::lock_guard<std::mutex> lk(sleep_mu_); }
  sleep_cv_.notify_all();
#endif
}

void ThreadPool::worker(int ith) {
  uint32_t seen = 0;
  for (;;) {
    wait_while(generation_, seen, spin().start_ns);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    try {
      (*task_)(ith);
    } catch (...) {
      std::lock_guard<std::mutex> lk(error_mu_);
      if (!error_) error_ = std::current_exception();
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      done_.fetch_add(1, std::memory_order_seq_cst);
      wake_all(done_);
    }
  }
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (n_threads_ == 1) {
    fn(0);
    return;
  }
  const uint32_t done = done_.load(std::memory_order_acquire);
  task_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes task_ and pending_
  wake_all(generation_);
  std::exception_ptr own;
  try {
    fn(0);
  } catch (...) {
    own = std::current_exception();
  }
  wait_while(done_, done, spin().done_ns);
  task_ = nullptr;
  if (own) std::rethrow_exception(own);
  if (error_) {
    std::exception_ptr e;
    std::swap(e, error_);
    std::rethrow_exception(e);
  }
}

void ThreadPool::wait_until(std::atomic<uint32_t>& counter, uint32_t target) {
  for (;;) {
    const uint32_t c = counter.load(std::memory_order_acquire);
    if ((int32_t)(c - target) >= 0) return;
    wait_while(counter, c, spin().barrier_ns);
  }
}

void ThreadPool::barrier() {
  if (n_threads_ == 1) return;
  const uint32_t phase = barrier_phase_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == n_threads_ - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_phase_.fetch_add(1, std::memory_order_seq_cst);
    wake_all(barrier_phase_);
    return;
  }
  wait_while(barrier_phase_, phase, spin().barrier_ns);
}

}  // namespace pyfast
