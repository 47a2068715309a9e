// The CUDA backend: devices found through the CUDA runtime (linked statically, so importing
// pyfast needs no libcudart; the driver, libcuda, is looked up when the first call is made), device
// buffers, and the CUDA side of device plans (core/device_plan.h holds the layout, host shadow,
// CPU fallback nodes, weights cache and bound state).
//
// A plan records its steps per segment (input upload, kernel launches, arena <-> shadow copies);
// the first run of a segment captures them into a CUDA graph on the plan's stream, later runs
// replay the graph (PYFAST_CUDA_GRAPH=0 launches the steps one by one instead). Every CUDA call
// is checked; a failure is a std::runtime_error naming the call and the device.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/device_plan.h"
#include "cuda/cuda_kernels.h"

namespace pyfast {
namespace cu {

namespace {

void check(cudaError_t e, const char* what, int dev = -1) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error
  throw std::runtime_error(std::string("[cuda] ") + (dev >= 0 ? "cuda:" + std::to_string(dev) + ": " : "") + what +
                           " failed: " + cudaGetErrorString(e));
}

// Why there are no CUDA devices ("" when the runtime found some).
std::string probe(int& count) {
  count = 0;
  if (void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    dlclose(h);
  } else {
    return "no CUDA driver on this machine (libcuda.so.1 not found)";
  }
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    count = 0;
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice)
      return std::string("no usable CUDA driver or device (") + cudaGetErrorString(e) + ")";
    return std::string("the CUDA runtime cannot start (") + cudaGetErrorString(e) + ")";
  }
  return count ? "" : "no CUDA device found";
}

DeviceInfo describe(int index) {
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, index), "cudaGetDeviceProperties", index);
  DeviceInfo d;
  d.kind = "cuda";
  d.index = index;
  d.name = "cuda:" + std::to_string(index);
  d.description = std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ")";
  d.memory_bytes = p.totalGlobalMem;
  d.max_buffer_range = (uint64_t)INT32_MAX;  // the kernels' byte offsets are 32-bit
  d.integer_dot = true;                      // __dp4a (sm_61 and later)
  return d;
}

struct Device {
  int index = 0;
  DeviceInfo info;
  cudaStream_t copy_stream = nullptr;  // synchronous buffer reads / writes
  std::mutex copy_mu;
  explicit Device(int i) : index(i) {
    check(cudaSetDevice(i), "cudaSetDevice", i);
    check(cudaFree(nullptr), "initialising the device", i);
    info = describe(i);
    check(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking), "cudaStreamCreate", i);
  }
  ~Device() {
    if (copy_stream) {
      cudaSetDevice(index);
      cudaStreamDestroy(copy_stream);
    }
  }
};

// Device memory; read / write / zero complete before they return.
class CudaBuffer : public DeviceBuffer {
 public:
  CudaBuffer(std::shared_ptr<Device> dev, size_t n) : dev_(std::move(dev)), size_(n) {
    check(cudaSetDevice(dev_->index), "cudaSetDevice", dev_->index);
    const cudaError_t e = cudaMalloc(&ptr_, n ? n : 16);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error("[cuda] " + dev_->info.name + ": cannot allocate " + std::to_string(n) +
                               " bytes of device memory (" + cudaGetErrorString(e) + ")");
    }
  }
  ~CudaBuffer() override {
    cudaSetDevice(dev_->index);
    cudaFree(ptr_);
  }
  size_t size() const override { return size_; }
  void write(size_t off, const void* src, size_t n) override {
    if (off + n > size_) throw std::out_of_range("[cuda] buffer write out of range");
    if (!n) return;
    std::lock_guard<std::mutex> lk(dev_->copy_mu);
    check(cudaSetDevice(dev_->index), "cudaSetDevice", dev_->index);
    check(cudaMemcpyAsync(ptr_ + off, src, n, cudaMemcpyHostToDevice, dev_->copy_stream), "cudaMemcpy (to device)", dev_->index);
    check(cudaStreamSynchronize(dev_->copy_stream), "cudaStreamSynchronize", dev_->index);
  }
  void read(size_t off, void* dst, size_t n) override {
    if (off + n > size_) throw std::out_of_range("[cuda] buffer read out of range");
    if (!n) return;
    std::lock_guard<std::mutex> lk(dev_->copy_mu);
    check(cudaSetDevice(dev_->index), "cudaSetDevice", dev_->index);
    check(cudaMemcpyAsync(dst, ptr_ + off, n, cudaMemcpyDeviceToHost, dev_->copy_stream), "cudaMemcpy (to host)", dev_->index);
    check(cudaStreamSynchronize(dev_->copy_stream), "cudaStreamSynchronize", dev_->index);
  }
  void zero(size_t off, size_t n) override {
    if (off + n > size_) throw std::out_of_range("[cuda] buffer zero out of range");
    if (!n) return;
    std::lock_guard<std::mutex> lk(dev_->copy_mu);
    check(cudaSetDevice(dev_->index), "cudaSetDevice", dev_->index);
    check(cudaMemsetAsync(ptr_ + off, 0, n, dev_->copy_stream), "cudaMemset", dev_->index);
    check(cudaStreamSynchronize(dev_->copy_stream), "cudaStreamSynchronize", dev_->index);
  }
  uint8_t* ptr() const { return ptr_; }

 private:
  std::shared_ptr<Device> dev_;
  uint8_t* ptr_ = nullptr;
  size_t size_ = 0;
};

// Pinned host memory (the plan's inputs and shadow: graph-capturable async copies).
struct PinnedHost {
  uint8_t* p = nullptr;
  PinnedHost(size_t n, int dev) {
    check(cudaMallocHost(&p, n ? n : 16), "cudaMallocHost", dev);
    std::memset(p, 0, n ? n : 16);
  }
  ~PinnedHost() { cudaFreeHost(p); }
};

class CudaBackend;

class CudaPlan : public DevicePlanBase {
 public:
  CudaPlan(CudaBackend& be, Graph& g, std::shared_ptr<ThreadPool> pool);
  ~CudaPlan() override;

 protected:
  std::vector<Dispatch> node_dispatch(const Node& nd, const Node* const* src) override { return op_dispatch(nd, src); }
  size_t node_scratch(const Node& nd, const Node* const* src) override { return op_scratch_bytes(nd, src); }
  std::shared_ptr<DeviceBuffer> new_device_buffer(size_t n) override { return std::make_shared<CudaBuffer>(dev_, n); }
  HostMem allocate(size_t input_bytes, size_t arena_bytes) override;
  void record_dispatch(int node, Dispatch& d, const std::vector<Operand>& ops) override;
  void record_copy(size_t off, size_t n, bool to_host) override;
  void end_segment() override { segs_.emplace_back(); }
  void submit(size_t s) override;

 private:
  struct Step {
    LaunchFn fn = nullptr;  // a launch, else a copy
    LaunchArgs args{};
    uint32_t groups = 1;
    int32_t spec[4] = {0, 0, 0, 0};
    void* dst = nullptr;
    const void* src = nullptr;
    size_t n = 0;
    cudaMemcpyKind dir = cudaMemcpyDefault;
  };
  void issue(const std::vector<Step>& steps);
  std::shared_ptr<Device> dev_;
  cudaStream_t stream_ = nullptr;
  std::vector<std::vector<Step>> segs_{1};
  std::vector<cudaGraphExec_t> graphs_;
  bool use_graphs_ = true;
  std::unique_ptr<PinnedHost> in_host_, shadow_;
  std::shared_ptr<CudaBuffer> in_dev_, arena_;
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int index) : dev_(std::make_shared<Device>(index)) {}
  const DeviceInfo& info() const override { return dev_->info; }
  bool supports(const Node& node, const Node* const* src) const override { return op_supported(node, src); }
  std::shared_ptr<DeviceBuffer> alloc(size_t nbytes) override { return std::make_shared<CudaBuffer>(dev_, nbytes); }
  void bind_host(const void* host, size_t nbytes, std::shared_ptr<DeviceBuffer> buf) override {
    if (buf && !std::dynamic_pointer_cast<CudaBuffer>(buf)) throw std::invalid_argument("[cuda] bind_host: not a CUDA buffer");
    mem_.bind(host, nbytes, std::move(buf), "cuda");
  }
  void unbind_host(const void* host) override { mem_.unbind(host); }
  std::unique_ptr<DevicePlan> compile(Graph& graph, std::shared_ptr<ThreadPool> pool) override {
    return std::unique_ptr<DevicePlan>(new CudaPlan(*this, graph, std::move(pool)));
  }
  std::shared_ptr<Device> dev_;
  DeviceMemory mem_;
};

CudaPlan::CudaPlan(CudaBackend& be, Graph& g, std::shared_ptr<ThreadPool> pool)
    : DevicePlanBase(g, std::move(pool), "cuda"), dev_(be.dev_) {
  const char* e = std::getenv("PYFAST_CUDA_GRAPH");
  use_graphs_ = !(e && std::strcmp(e, "0") == 0);
  check(cudaSetDevice(dev_->index), "cudaSetDevice", dev_->index);
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate", dev_->index);
  build(be, be.mem_, 256);
  segs_.pop_back();  // the empty one the last end_segment() opened
  graphs_.assign(segs_.size(), nullptr);
}

CudaPlan::~CudaPlan() {
  cudaSetDevice(dev_->index);
  for (auto g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  if (stream_) cudaStreamDestroy(stream_);
}

DevicePlanBase::HostMem CudaPlan::allocate(size_t input_bytes, size_t arena_bytes) {
  in_host_.reset(new PinnedHost(input_bytes, dev_->index));
  shadow_.reset(new PinnedHost(arena_bytes, dev_->index));
  in_dev_ = std::make_shared<CudaBuffer>(dev_, input_bytes);
  arena_ = std::make_shared<CudaBuffer>(dev_, arena_bytes);
  Step up;  // every run starts by uploading the inputs the caller set
  up.dst = in_dev_->ptr();
  up.src = in_host_->p;
  up.n = input_bytes;
  up.dir = cudaMemcpyHostToDevice;
  segs_.back().push_back(up);
  return HostMem{in_host_->p, shadow_->p};
}

void CudaPlan::record_dispatch(int, Dispatch& d, const std::vector<Operand>& ops) {
  Step st;
  st.fn = find_kernel(d.kernel);
  if (!st.fn) throw std::logic_error("[cuda] no launcher for kernel '" + d.kernel + "'");
  st.args.P = d.params;
  for (int t = 0; t < 12; ++t) st.args.P.ofs[t] = 0;
  for (size_t t = 0; t < ops.size() && t < (size_t)kMaxBindings; ++t) {
    const Operand& o = ops[t];
    uint8_t* base = o.mem == Mem::inputs ? in_dev_->ptr()
                    : o.mem == Mem::arena ? arena_->ptr()
                                          : static_cast<CudaBuffer*>(o.ext)->ptr();
    st.args.B[t] = base + o.off;
  }
  st.groups = std::max<uint32_t>(d.groups, 1);
  for (size_t i = 0; i < d.spec.size() && i < 4; ++i) st.spec[i] = d.spec[i];
  segs_.back().push_back(st);
}

void CudaPlan::record_copy(size_t off, size_t n, bool to_host) {
  Step st;
  st.n = n;
  if (to_host) {
    st.dst = shadow_->p + off;
    st.src = arena_->ptr() + off;
    st.dir = cudaMemcpyDeviceToHost;
  } else {
    st.dst = arena_->ptr() + off;
    st.src = shadow_->p + off;
    st.dir = cudaMemcpyHostToDevice;
  }
  segs_.back().push_back(st);
}

void CudaPlan::issue(const std::vector<Step>& steps) {
  for (const Step& st : steps) {
    if (st.fn) st.fn(st.args, st.groups, st.spec, stream_);
    else check(cudaMemcpyAsync(st.dst, st.src, st.n, st.dir, stream_), "cudaMemcpyAsync", dev_->index);
  }
}

void CudaPlan::submit(size_t s) {
  if (s >= segs_.size() || segs_[s].empty()) return;
  check(cudaSetDevice(dev_->index), "cudaSetDevice", dev_->index);
  if (use_graphs_ && !graphs_[s]) {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
      try {
        issue(segs_[s]);
      } catch (const std::exception&) {
      }
      e = cudaStreamEndCapture(stream_, &graph);
    }
    if (e == cudaSuccess && graph) e = cudaGraphInstantiate(&graphs_[s], graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) {  // launch step by step from now on (and report any real error there)
      cudaGetLastError();
      graphs_[s] = nullptr;
      use_graphs_ = false;
    }
  }
  if (use_graphs_ && graphs_[s]) check(cudaGraphLaunch(graphs_[s], stream_), "cudaGraphLaunch", dev_->index);
  else issue(segs_[s]);
  check(cudaGetLastError(), "a kernel launch", dev_->index);
  check(cudaStreamSynchronize(stream_), "running the plan", dev_->index);
}

}  // namespace

}  // namespace cu

void register_cuda_backend() {
  int count = 0;
  const std::string why = cu::probe(count);
  BackendFactory f;
  f.kind = "cuda";
  f.list = [] {
    int n = 0;
    std::vector<DeviceInfo> out;
    if (!cu::probe(n).empty()) return out;
    for (int i = 0; i < n; ++i) out.push_back(cu::describe(i));
    return out;
  };
  f.open = [](int index) -> std::shared_ptr<Backend> { return std::make_shared<cu::CudaBackend>(index); };
  f.unavailable = why;
  register_backend(std::move(f));
}

}  // namespace pyfast
