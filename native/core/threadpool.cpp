#include "pyfast/threadpool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PYFAST_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PYFAST_PAUSE() __asm__ __volatile__("yield")
#else
#define PYFAST_PAUSE() ((void)0)
#endif

namespace pyfast {

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    ++generation_;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int ith) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (stop_) return;
      task = task_;
    }
    (*task)(ith);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (n_threads_ == 1) {
    fn(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    task_ = &fn;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  cv_.notify_all();
  fn(0);
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  task_ = nullptr;
}

void ThreadPool::barrier() {
  if (n_threads_ == 1) return;
  const int phase = barrier_phase_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == n_threads_ - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_phase_.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  // Spin briefly (ops are short), then yield the core.
  for (int spins = 0; barrier_phase_.load(std::memory_order_acquire) == phase; ++spins) {
    if (spins < 20000) PYFAST_PAUSE();
    else std::this_thread::yield();
  }
}

}  // namespace pyfast
