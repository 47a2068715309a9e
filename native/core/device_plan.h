// The backend-independent half of a device plan (used by the Vulkan and CUDA backends).
//
// A device plan is compiled once per graph: every needed node runs on the device when the
// backend supports it, otherwise on the CPU. Memory:
// - intermediates share a device arena laid out like the CPU plan's (first fit by liveness,
//   plus a scratch region some kernels need while they run); a host shadow of the same size
//   receives what the host must see (outputs, sources of CPU nodes) and sends what the CPU
//   produced;
// - inputs live in one host-visible buffer (Node::data points at it);
// - externals are either persistent state bound to a device buffer by its owner (KV cache,
//   recurrent planes: Backend::bind_host, kept in a DeviceMemory) or read-only weights,
//   uploaded once and shared by every plan that names the same host bytes.
// DevicePlanBase walks the nodes once and hands the backend its steps in order (dispatches,
// copies between arena and shadow, segment ends before CPU nodes); run() replays segments and
// runs the CPU nodes between them with the explicit pulls / pushes of bound state they need.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "pyfast/backend.h"
#include "pyfast/plan.h"

namespace pyfast {

// Parameters of one kernel launch. Tensor 0 is the output, tensor 1 + i the node's source i
// (or the slots a Dispatch names). Dims and byte strides are stored innermost first and padded
// with 1 / 0. The layout is the std140 block of the Vulkan shaders (vulkan/shaders/common.glsl).
struct KernelParams {
  int32_t ne[9][4];
  int32_t nb[9][4];
  uint32_t ofs[12];  // byte offset of each tensor inside its bound range
  int32_t ip[8];
  float fp[8];
};
static_assert(sizeof(KernelParams) == 400, "KernelParams must match the std140 block in common.glsl");
constexpr int kMaxBindings = 9;
void fill_tensor(KernelParams& P, int t, const Node& n);

// A node runs as one or more dispatches; each binds tensors by slot: kOut (the node's output), a
// source index, or kScratch (a region of the node's scratch bytes that the plan reserves for the
// node alone while it runs).
constexpr int kOut = -1, kScratch = -2;
struct Dispatch {
  std::string kernel;           // shader / kernel name (shown by describe())
  std::vector<int32_t> spec;    // specialization constants (Vulkan) / kernel selectors (CUDA)
  KernelParams params{};
  uint32_t groups = 1;          // linear workgroup (block) count
  std::vector<int> bind;        // binding b -> tensor slot (empty: the output, then every source)
};

// Bound persistent state and the weights cache of one device.
class DeviceMemory {
 public:
  void bind(const void* host, size_t nbytes, std::shared_ptr<DeviceBuffer> buf, const char* kind);
  void unbind(const void* host);
  // The device buffer behind host bytes [p, p + n): bound state, else nullptr.
  std::shared_ptr<DeviceBuffer> bound(const uint8_t* p, size_t n, size_t& off);
  // A device copy of read-only host bytes (weights), shared while some plan holds it.
  std::shared_ptr<DeviceBuffer> weight(const uint8_t* p, size_t n,
                                       const std::function<std::shared_ptr<DeviceBuffer>(size_t)>& make);

 private:
  struct Bound {
    size_t n;
    std::shared_ptr<DeviceBuffer> buf;
  };
  std::mutex mu_;
  std::map<uintptr_t, Bound> bound_;
  std::map<std::pair<uintptr_t, size_t>, std::weak_ptr<DeviceBuffer>> weights_;
};

class DevicePlanBase : public DevicePlan {
 public:
  void run() override;
  std::string describe() const override { return desc_.str(); }

 protected:
  // Where a tensor operand lives on the device.
  enum class Mem { inputs, arena, external };
  struct Operand {
    Mem mem = Mem::arena;
    DeviceBuffer* ext = nullptr;  // Mem::external: the weight / bound-state buffer
    size_t off = 0;               // byte offset in its buffer
    size_t span = 0;              // bytes the operand spans
    const Node* node = nullptr;   // nullptr for scratch
  };
  // Host memory of the plan the backend allocates: inputs (kernels read them from the device's
  // side, see upload_inputs) and the arena's shadow.
  struct HostMem {
    uint8_t* inputs = nullptr;
    uint8_t* shadow = nullptr;
  };

  DevicePlanBase(Graph& g, std::shared_ptr<ThreadPool> pool, const char* kind) : g_(g), pool_(std::move(pool)), kind_(kind) {}
  // Compiles the plan; derived constructors call it once their own state is ready.
  // in_align: alignment of each input's offset in the input buffer.
  void build(Backend& be, DeviceMemory& mem, size_t in_align);

  // Backend hooks, called by build() in step order.
  virtual std::vector<Dispatch> node_dispatch(const Node& nd, const Node* const* src) = 0;
  virtual size_t node_scratch(const Node& nd, const Node* const* src) = 0;
  virtual std::shared_ptr<DeviceBuffer> new_device_buffer(size_t n) = 0;
  virtual HostMem allocate(size_t input_bytes, size_t arena_bytes) = 0;
  // ops[b]: the operand at binding b (d.bind resolved); d.params already has shapes of nodes.
  virtual void record_dispatch(int node, Dispatch& d, const std::vector<Operand>& ops) = 0;
  virtual void record_copy(size_t arena_off, size_t n, bool to_host) = 0;
  // The current segment ends (a CPU node follows); later steps go to a new segment.
  virtual void end_segment() = 0;
  // Runs segment `s` on the device and waits for it.
  virtual void submit(size_t s) = 0;

  Graph& g_;
  std::shared_ptr<ThreadPool> pool_;
  const char* kind_;

 private:
  struct Sync {  // bound state a CPU node reads (pulled first) or writes (pushed after)
    std::shared_ptr<DeviceBuffer> buf;
    size_t off = 0;
    uint8_t* host = nullptr;
    size_t n = 0;
  };
  struct HostStep {
    int node = -1;
    std::vector<Sync> pull, push;
  };
  std::vector<std::vector<HostStep>> host_;  // per segment: run after it completes
  std::vector<std::shared_ptr<DeviceBuffer>> keep_;  // weights and bound state this plan uses
  std::vector<uint8_t> work_;
  std::ostringstream desc_;
};

}  // namespace pyfast
