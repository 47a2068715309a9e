// A persistent pool of worker threads that run a task on every thread (ggml style: each op is
// split by (ith, nth) and threads meet at a barrier between ops).
//
// Waiting never burns a core for long: a thread that has to wait (a worker for the next run, the
// caller for the workers to finish, any thread at a barrier) spins for a few microseconds and then
// sleeps on a futex (Linux; a mutex / condition variable elsewhere) until it is woken. Wakes are
// only issued when someone sleeps, so a quiet machine pays no system calls. When other processes
// compete for the cores this keeps the pool's threads from taking CPU from the thread everybody
// waits for (and the scheduler favours threads that sleep and wake).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
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
  // Runs fn(ith) on every thread (the caller is thread 0) and returns when all are done. An
  // exception thrown by fn on a worker is rethrown here (after all threads finished).
  void run(const std::function<void(int)>& fn);
  // All threads of the current run must call this the same number of times.
  void barrier();
  // Waits (spinning briefly, then sleeping) until counter - target >= 0 (mod 2^32); counter only
  // grows. Whoever raises a counter that others may wait on calls notify(counter) afterwards.
  void wait_until(std::atomic<uint32_t>& counter, uint32_t target);
  void notify(std::atomic<uint32_t>& counter) { wake_all(counter); }

 private:
  // Waits until `word` differs from `old`: spins for up to spin_ns, then sleeps.
  void wait_while(std::atomic<uint32_t>& word, uint32_t old, int64_t spin_ns);
  // Wakes every thread sleeping on `word` (after it was changed), if any sleeps.
  void wake_all(std::atomic<uint32_t>& word);
  void worker(int ith);

  int n_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* task_ = nullptr;
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex error_mu_;
  // Threads sleeping in wait_while (any word): wakes are skipped while this is 0.
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};  // +1 per run (workers wait on it)
  alignas(64) std::atomic<int> pending_{0};          // workers still in the current run
  alignas(64) std::atomic<uint32_t> done_{0};        // +1 when the last worker finishes a run
  alignas(64) std::atomic<int> barrier_count_{0};
  alignas(64) std::atomic<uint32_t> barrier_phase_{0};
  // Fallback sleeping (no futex).
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
};

}  // namespace pyfast
