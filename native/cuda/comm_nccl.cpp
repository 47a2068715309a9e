// NCCL communicator (pyfast/comm.h) for the allreduce op on CUDA device memory. Compiled with the
// CUDA backend when nccl.h is found (CMake PYFAST_NCCL); libnccl itself is opened at run time
// (dlopen) from the path the caller gives, so the extension never needs it to import.
#if defined(PYFAST_HAVE_NCCL)
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "pyfast/comm.h"

namespace pyfast {

namespace {

struct NcclApi {
  void* lib = nullptr;
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
};

template <typename F>
void sym(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) throw std::runtime_error(std::string("[nccl] symbol ") + name + " not found in libnccl");
}

const NcclApi& api(const std::string& path) {
  static std::mutex mu;
  static NcclApi a;
  static std::string loaded;
  std::lock_guard<std::mutex> lk(mu);
  if (a.lib) {
    if (path != loaded) throw std::invalid_argument("[nccl] already using " + loaded + ", not " + path);
    return a;
  }
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!lib) throw std::runtime_error("[nccl] cannot open " + path + ": " + dlerror());
  NcclApi n;
  n.lib = lib;
  sym(lib, "ncclGetUniqueId", n.get_unique_id);
  sym(lib, "ncclCommInitRank", n.comm_init_rank);
  sym(lib, "ncclCommDestroy", n.comm_destroy);
  sym(lib, "ncclAllReduce", n.all_reduce);
  sym(lib, "ncclGetErrorString", n.error_string);
  a = n;
  loaded = path;
  return a;
}

void check(const NcclApi& a, ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("[nccl] ") + what + ": " + a.error_string(r));
}

class NcclComm final : public Communicator {
 public:
  NcclComm(const NcclApi& a, ncclComm_t c, int rank, int size, int dev) : a_(a), c_(c), rank_(rank), size_(size), dev_(dev) {}
  ~NcclComm() override {
    if (c_) a_.comm_destroy(c_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "nccl"; }
  bool on_device() const override { return true; }
  void allreduce_sum_f32_device(const float* send, float* recv, int64_t n, void* stream) override {
    check(a_, a_.all_reduce(send, recv, (size_t)n, ncclFloat32, ncclSum, c_, static_cast<cudaStream_t>(stream)),
          "ncclAllReduce");
    calls.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add((uint64_t)n * 4, std::memory_order_relaxed);
  }
  // Host buffers: staged through device memory on a private stream (tests; graphs use the above).
  void allreduce_sum_f32(const float* send, float* recv, int64_t n) override {
    const auto t0 = std::chrono::steady_clock::now();
    cudaSetDevice(dev_);
    float* d = nullptr;
    cudaStream_t s = nullptr;
    if (cudaMalloc(&d, (size_t)std::max<int64_t>(n, 1) * 4) != cudaSuccess) throw std::runtime_error("[nccl] cudaMalloc failed");
    cudaStreamCreate(&s);
    cudaMemcpyAsync(d, send, (size_t)n * 4, cudaMemcpyHostToDevice, s);
    allreduce_sum_f32_device(d, d, n, s);
    cudaMemcpyAsync(recv, d, (size_t)n * 4, cudaMemcpyDeviceToHost, s);
    const cudaError_t e = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    cudaFree(d);
    if (e != cudaSuccess) throw std::runtime_error(std::string("[nccl] ") + cudaGetErrorString(e));
    ns.fetch_add((uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                 std::memory_order_relaxed);
  }

 private:
  const NcclApi& a_;
  ncclComm_t c_;
  int rank_, size_, dev_;
};

}  // namespace

std::string nccl_unique_id(const std::string& lib) {
  const NcclApi& a = api(lib);
  ncclUniqueId id;
  check(a, a.get_unique_id(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

std::shared_ptr<Communicator> make_nccl_comm(const std::string& lib, const std::string& unique_id, int rank, int size,
                                             int cuda_device) {
  const NcclApi& a = api(lib);
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal))
    throw std::invalid_argument("[nccl] the unique id must be " + std::to_string(sizeof(id.internal)) + " bytes");
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  if (cudaSetDevice(cuda_device) != cudaSuccess)
    throw std::invalid_argument("[nccl] no CUDA device " + std::to_string(cuda_device));
  ncclComm_t c = nullptr;
  check(a, a.comm_init_rank(&c, size, id, rank), "ncclCommInitRank");
  return std::make_shared<NcclComm>(a, c, rank, size, cuda_device);
}

}  // namespace pyfast
#endif  // PYFAST_HAVE_NCCL
