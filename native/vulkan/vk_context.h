// Vulkan device state shared by the backend's buffers, pipelines and plans.
#pragma once
#include <vulkan/vulkan.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/device_plan.h"
#include "pyfast/backend.h"

namespace pyfast {
namespace vk {

[[noreturn]] void fail(VkResult r, const char* what);
// Name, description, device-local memory and binding range of physical device `index`.
DeviceInfo describe(VkPhysicalDevice phys, int index);
inline void check(VkResult r, const char* what) {
  if (r != VK_SUCCESS) fail(r, what);
}

// Kernel parameters, one block per dispatch (core/device_plan.h; std140 `Params` in common.glsl).
using Params = KernelParams;

class Context;

// A VkBuffer with its own memory. Host-visible buffers stay mapped.
class Buffer : public DeviceBuffer {
 public:
  enum class Kind { device, upload, readback };
  Buffer(std::shared_ptr<Context> ctx, size_t n, Kind kind);
  ~Buffer() override;
  size_t size() const override { return size_; }
  void write(size_t offset, const void* src, size_t n) override;
  void read(size_t offset, void* dst, size_t n) override;
  void zero(size_t offset, size_t n) override;
  VkBuffer handle() const { return buf_; }
  uint8_t* mapped() const { return map_; }

 private:
  std::shared_ptr<Context> ctx_;
  VkBuffer buf_ = VK_NULL_HANDLE;
  VkDeviceMemory mem_ = VK_NULL_HANDLE;
  uint8_t* map_ = nullptr;
  size_t size_ = 0;
};

struct Pipeline {
  VkPipeline pipe = VK_NULL_HANDLE;
};

class Context : public std::enable_shared_from_this<Context> {
 public:
  Context(VkInstance inst, VkPhysicalDevice phys, int index);
  ~Context();
  VkDevice dev = VK_NULL_HANDLE;
  VkPhysicalDevice phys = VK_NULL_HANDLE;
  VkQueue queue = VK_NULL_HANDLE;
  uint32_t queue_family = 0;
  VkCommandPool cmd_pool = VK_NULL_HANDLE;
  VkDescriptorSetLayout dsl = VK_NULL_HANDLE;
  VkPipelineLayout layout = VK_NULL_HANDLE;
  VkPhysicalDeviceProperties props{};
  VkPhysicalDeviceMemoryProperties mem_props{};
  DeviceInfo info;
  std::mutex queue_mu;  // vkQueueSubmit from several threads
  std::mutex cmd_mu;    // the command pool (allocating / freeing command buffers)
  std::shared_ptr<Buffer> dummy;  // bound to unused binding slots
  bool int_dot = false;           // shaderIntegerDotProduct (4x8-bit packed dot products) enabled

  // Memory type for a buffer kind (device-local first; host-visible for upload / readback).
  uint32_t memory_type(uint32_t bits, Buffer::Kind kind) const;
  // The pipeline for shader `name` with specialization constants `spec` (ids 0..n-1).
  VkPipeline pipeline(const std::string& name, const std::vector<int32_t>& spec);
  // One-shot copy between buffers (blocking).
  void copy(VkBuffer src, size_t src_off, VkBuffer dst, size_t dst_off, size_t n);
  // Submit and wait.
  void submit_wait(VkCommandBuffer cb, VkFence fence);

 private:
  std::mutex pipe_mu_;
  std::map<std::pair<std::string, std::vector<int32_t>>, VkPipeline> pipes_;
  std::map<std::string, VkShaderModule> modules_;
};

// Op support and kernel launch description (vk_ops.cpp; Dispatch in core/device_plan.h).
bool op_supported(const Context& ctx, const Node& node, const Node* const* src);
size_t op_scratch_bytes(const Context& ctx, const Node& node, const Node* const* src);
std::vector<Dispatch> op_dispatch(const Context& ctx, const Node& node, const Node* const* src);

// The embedded SPIR-V (generated at build time from shaders/*.comp).
struct Spirv {
  const char* name;
  const uint32_t* code;
  size_t bytes;
};
const Spirv* find_spirv(const std::string& name);

}  // namespace vk
}  // namespace pyfast
