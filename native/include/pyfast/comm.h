// Communicators for tensor parallelism: a sum-allreduce over the ranks of a group, used by the
// `allreduce` op. A graph names its communicator by the integer id it was registered under, so a
// compiled plan replays without holding Python objects.
//
// Implementations: `LocalComm` (one rank: a copy; the op harness and single-process runs) and
// `MpiComm` (MPI_Allreduce through a function pointer and handles the caller resolved from the
// MPI library already loaded in the process, e.g. by mpi4py: pyfast links no MPI library and
// needs no MPI headers to build). The NCCL communicator for device buffers lives with the CUDA
// backend (cuda/comm_nccl.cpp).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace pyfast {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string kind() const = 0;
  // recv[i] = sum over ranks of send[i], i < n (send and recv do not overlap), host memory.
  virtual void allreduce_sum_f32(const float* send, float* recv, int64_t n) = 0;
  // The same sum where only rank 0 reads it (the output head's logits): MPI sends it to rank 0
  // alone and zero-fills the others' recv, half the traffic. Default: the allreduce.
  virtual void reduce_sum_f32_root(const float* send, float* recv, int64_t n) { allreduce_sum_f32(send, recv, n); }
  // Device memory (a communicator between GPUs, e.g. NCCL): the same sum enqueued on `stream`
  // (a cudaStream_t). Host-only communicators return false from on_device and throw here.
  virtual bool on_device() const { return false; }
  virtual void allreduce_sum_f32_device(const float* send, float* recv, int64_t n, void* stream);

  // Time spent inside allreduce calls (wall clock, the calling thread), their number and bytes.
  std::atomic<uint64_t> ns{0}, calls{0}, bytes{0};
};

// A process-wide table of communicators; ids are never reused.
int comm_register(std::shared_ptr<Communicator> c);
void comm_unregister(int id);
// Throws std::invalid_argument when no communicator has this id.
std::shared_ptr<Communicator> comm_get(int id);

// A single rank: the sum is the input.
std::shared_ptr<Communicator> make_local_comm();

// MPI through the C API of an already loaded MPI library: `allreduce_fn` is the address of
// MPI_Allreduce (`reduce_fn` of MPI_Reduce, 0: reduce_sum_f32_root uses the allreduce), `comm`,
// `dtype_float`, `op_sum` the handle values of the communicator, MPI_FLOAT and MPI_SUM (pointers
// in Open MPI, ints in MPICH; both are passed in one register).
std::shared_ptr<Communicator> make_mpi_comm(uintptr_t allreduce_fn, uintptr_t comm, uintptr_t dtype_float,
                                            uintptr_t op_sum, int rank, int size, uintptr_t reduce_fn = 0);

#if defined(PYFAST_HAVE_NCCL)
// NCCL between GPUs (cuda/comm_nccl.cpp): libnccl is opened at run time from `lib` (e.g. the
// nvidia-nccl-cu13 wheel's libnccl.so.2), so importing pyfast never needs it. nccl_unique_id makes
// the id rank 0 shares with the others (over MPI); each rank then joins on its CUDA device.
std::string nccl_unique_id(const std::string& lib);
std::shared_ptr<Communicator> make_nccl_comm(const std::string& lib, const std::string& unique_id, int rank, int size,
                                             int cuda_device);
#endif

}  // namespace pyfast
