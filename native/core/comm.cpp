#include "pyfast/comm.h"

#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace pyfast {

namespace {

std::mutex g_mu;
std::unordered_map<int, std::shared_ptr<Communicator>> g_comms;
int g_next = 1;

uint64_t now_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

class LocalComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string kind() const override { return "local"; }
  void allreduce_sum_f32(const float* send, float* recv, int64_t n) override {
    if (n > 0) std::memcpy(recv, send, (size_t)n * sizeof(float));
    calls.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add((uint64_t)n * 4, std::memory_order_relaxed);
  }
};

// int MPI_Allreduce(const void*, void*, int, MPI_Datatype, MPI_Op, MPI_Comm). The handles are
// passed as pointer-sized integers: identical to a pointer handle (Open MPI) and, on the 64-bit
// ABIs pyfast builds for, read as its low 32 bits by an int handle (MPICH).
using AllreduceFn = int (*)(const void*, void*, int, uintptr_t, uintptr_t, uintptr_t);
// int MPI_Reduce(const void*, void*, int, MPI_Datatype, MPI_Op, int root, MPI_Comm)
using ReduceFn = int (*)(const void*, void*, int, uintptr_t, uintptr_t, int, uintptr_t);

class MpiComm final : public Communicator {
 public:
  MpiComm(uintptr_t fn, uintptr_t comm, uintptr_t dt, uintptr_t op, int rank, int size, uintptr_t reduce_fn)
      : fn_(reinterpret_cast<AllreduceFn>(fn)), reduce_(reinterpret_cast<ReduceFn>(reduce_fn)), comm_(comm), dt_(dt),
        op_(op), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "mpi"; }
  void allreduce_sum_f32(const float* send, float* recv, int64_t n) override {
    const uint64_t t0 = now_ns();
    constexpr int64_t kChunk = 1 << 30;  // MPI counts are int
    for (int64_t i = 0; i < n; i += kChunk) {
      const int c = (int)std::min<int64_t>(kChunk, n - i);
      const int rc = fn_(send + i, recv + i, c, dt_, op_, comm_);
      if (rc != 0) throw std::runtime_error("[allreduce] MPI_Allreduce failed with error code " + std::to_string(rc));
    }
    ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    calls.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add((uint64_t)n * 4, std::memory_order_relaxed);
  }
  void reduce_sum_f32_root(const float* send, float* recv, int64_t n) override {
    if (!reduce_) return allreduce_sum_f32(send, recv, n);
    const uint64_t t0 = now_ns();
    constexpr int64_t kChunk = 1 << 30;
    for (int64_t i = 0; i < n; i += kChunk) {
      const int c = (int)std::min<int64_t>(kChunk, n - i);
      const int rc = reduce_(send + i, recv + i, c, dt_, op_, 0, comm_);
      if (rc != 0) throw std::runtime_error("[allreduce] MPI_Reduce failed with error code " + std::to_string(rc));
    }
    if (rank_ != 0 && n > 0) std::memset(recv, 0, (size_t)n * sizeof(float));
    ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    calls.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add((uint64_t)n * 4, std::memory_order_relaxed);
  }

 private:
  AllreduceFn fn_;
  ReduceFn reduce_;
  uintptr_t comm_, dt_, op_;
  int rank_, size_;
};

}  // namespace

void Communicator::allreduce_sum_f32_device(const float*, float*, int64_t, void*) {
  throw std::invalid_argument("[allreduce] the " + kind() + " communicator does not reduce device memory");
}

int comm_register(std::shared_ptr<Communicator> c) {
  if (!c) throw std::invalid_argument("[comm] null communicator");
  std::lock_guard<std::mutex> lk(g_mu);
  const int id = g_next++;
  g_comms[id] = std::move(c);
  return id;
}

void comm_unregister(int id) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_comms.erase(id);
}

std::shared_ptr<Communicator> comm_get(int id) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_comms.find(id);
  if (it == g_comms.end()) throw std::invalid_argument("[allreduce] no communicator with id " + std::to_string(id));
  return it->second;
}

std::shared_ptr<Communicator> make_local_comm() { return std::make_shared<LocalComm>(); }

std::shared_ptr<Communicator> make_mpi_comm(uintptr_t allreduce_fn, uintptr_t comm, uintptr_t dtype_float,
                                            uintptr_t op_sum, int rank, int size, uintptr_t reduce_fn) {
  if (!allreduce_fn) throw std::invalid_argument("[comm] MPI_Allreduce address is null");
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("[comm] bad rank " + std::to_string(rank) + " of " + std::to_string(size));
  return std::make_shared<MpiComm>(allreduce_fn, comm, dtype_float, op_sum, rank, size, reduce_fn);
}

}  // namespace pyfast
