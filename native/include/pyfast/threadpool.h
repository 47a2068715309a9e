// A persistent pool of worker threads that run a task on every thread (ggml style: each op is
// split by (ith, nth) and threads meet at a barrier between ops). Workers sleep on a condition
// variable between runs; the barrier spins briefly and then yields, so idle cores are not burnt.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pyfast {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // Runs fn(ith) on every thread (the caller is thread 0) and returns when all are done.
  void run(const std::function<void(int)>& fn);
  // All threads of the current run must call this the same number of times.
  void barrier();

 private:
  void worker(int ith);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int)>* task_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  std::condition_variable done_cv_;
  bool stop_ = false;
  alignas(64) std::atomic<int> barrier_count_{0};
  alignas(64) std::atomic<int> barrier_phase_{0};
};

}  // namespace pyfast
