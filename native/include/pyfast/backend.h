// The backend interface: a device that can hold buffers and run (part of) a plan.
//
// Every backend implements three things (ggml's backend vtable / MLX's device split):
// - `Backend`: the device (name, kind, memory), `supports(node)` (does it have a kernel for this
//   node with these sources), buffers in its memory, and `compile`, which turns a graph into a
//   `DevicePlan` replayed with new inputs;
// - `DeviceBuffer`: bytes in the device's memory with explicit host <-> device copies;
// - `DevicePlan`: the compiled graph. Nodes the device lacks run on the CPU with the copies that
//   moves data between the two made explicit as plan steps (listed by `describe()`), never
//   decided per token.
//
// The CPU is always there and is the reference: its plan is `pyfast::Plan` (plan.h). A backend
// registers itself from one function compiled in under its CMake option (`register_backends`),
// and `list_devices()` / `open_device()` find it at run time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pyfast/graph.h"
#include "pyfast/threadpool.h"

namespace pyfast {

struct DeviceInfo {
  std::string name;          // "cpu", "vulkan:0"
  std::string kind;          // "cpu", "vulkan"
  int index = 0;             // within its kind
  std::string description;   // the driver's device name
  uint64_t memory_bytes = 0; // device-local memory (host RAM for the CPU)
  uint64_t max_buffer_range = 0;  // largest range one kernel argument may span (0: no limit)
  bool integer_dot = false;       // an opened device uses integer dot product instructions
};

// Bytes in a device's memory. read / write / zero are synchronous.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual size_t size() const = 0;
  virtual void write(size_t offset, const void* src, size_t n) = 0;  // host -> device
  virtual void read(size_t offset, void* dst, size_t n) = 0;         // device -> host
  virtual void zero(size_t offset, size_t n) = 0;
};

// A graph compiled for one device, replayed with new input data. Inputs and outputs keep host
// memory (Node::data) so callers set and read them as with a CPU plan.
class DevicePlan {
 public:
  virtual ~DevicePlan() = default;
  virtual void run() = 0;
  // One line per step: dispatches on the device, CPU fallback nodes, and the copies between them.
  virtual std::string describe() const = 0;
  int n_device_nodes = 0;  // kernels run on the device
  int n_host_nodes = 0;    // kernels run on the CPU (the device lacks them)
  int n_copies = 0;        // explicit device <-> host copies per run
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const DeviceInfo& info() const = 0;
  // Whether this device has a kernel for `node` (op, dtypes, shapes) reading `src`.
  virtual bool supports(const Node& node, const Node* const* src) const = 0;
  virtual std::shared_ptr<DeviceBuffer> alloc(size_t nbytes) = 0;
  // Persistent state (KV cache, recurrent planes) whose owner keeps a host buffer of the same
  // size: graphs that name host range [host, host + nbytes) as an external tensor use `buf`
  // instead. The device copy is the authoritative one; the owner copies explicitly.
  virtual void bind_host(const void* host, size_t nbytes, std::shared_ptr<DeviceBuffer> buf) = 0;
  virtual void unbind_host(const void* host) = 0;
  // Compiles `graph` (nodes the device lacks run on the CPU threads of `pool`).
  virtual std::unique_ptr<DevicePlan> compile(Graph& graph, std::shared_ptr<ThreadPool> pool) = 0;
};

// Registration: each backend adds a kind with a function listing its devices and one opening
// device `index` (throwing std::runtime_error naming the device when it cannot).
struct BackendFactory {
  std::string kind;
  std::function<std::vector<DeviceInfo>()> list;
  std::function<std::shared_ptr<Backend>(int index)> open;
  std::string unavailable;  // why this kind has no devices ("" when it may have some)
};
void register_backend(BackendFactory f);
const std::vector<BackendFactory>& backend_factories();

// Every device: the CPU first, then each compiled-in backend's.
std::vector<DeviceInfo> list_devices();
// "cpu" returns nullptr (plans run as pyfast::Plan); "vulkan:0" / "vulkan" open that device
// (opened once and shared). Unknown kinds or indices throw std::invalid_argument naming them.
std::shared_ptr<Backend> open_device(const std::string& name);

// Whether `op` writes its source `s` in place (set_rows: the destination; ssm_conv and
// gated_delta_net: the state planes). A device plan copies such sources back after a CPU node.
bool op_writes_src(Op op, int s);

// Runs one node's CPU kernel on every thread of `pool` (the fallback path of device plans).
// work: scratch of at least cpu_work_size(node, src, pool->size()) bytes.
void cpu_run_node(ThreadPool* pool, Node& node, const Node* const* src, uint8_t* work, size_t work_size);

}  // namespace pyfast
