// The Vulkan backend: device discovery, and the Vulkan side of device plans (the plan's layout,
// host shadow, CPU fallback nodes, weights cache and bound state are core/device_plan.h).
// Steps are recorded into command buffers at compile time; run() submits them, running CPU
// nodes between submissions.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "core/device_plan.h"
#include "pyfast/cpu.h"
#include "pyfast/plan.h"
#include "vulkan/vk_context.h"

namespace pyfast {
namespace vk {

namespace {

VkInstance g_instance = VK_NULL_HANDLE;
std::string g_instance_error;

VkInstance instance() {
  static std::once_flag once;
  std::call_once(once, [] {
    VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
    app.pApplicationName = "pyfast";
    app.apiVersion = VK_API_VERSION_1_1;
    VkInstanceCreateInfo ci{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
    ci.pApplicationInfo = &app;
    std::vector<const char*> exts;
    uint32_t n = 0;
    if (vkEnumerateInstanceExtensionProperties(nullptr, &n, nullptr) == VK_SUCCESS) {
      std::vector<VkExtensionProperties> ep(n);
      vkEnumerateInstanceExtensionProperties(nullptr, &n, ep.data());
      for (auto& e : ep)  // MoltenVK lists its devices only with portability enumeration
        if (std::strcmp(e.extensionName, "VK_KHR_portability_enumeration") == 0) {
          exts.push_back("VK_KHR_portability_enumeration");
          ci.flags |= 0x00000001;  // VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
        }
    }
    ci.enabledExtensionCount = (uint32_t)exts.size();
    ci.ppEnabledExtensionNames = exts.data();
    VkResult r = vkCreateInstance(&ci, nullptr, &g_instance);
    if (r != VK_SUCCESS) {
      g_instance = VK_NULL_HANDLE;
      g_instance_error = r == VK_ERROR_INCOMPATIBLE_DRIVER
                             ? "no Vulkan driver (ICD) is installed"
                             : "vkCreateInstance failed (VkResult " + std::to_string((int)r) + ")";
    }
  });
  return g_instance;
}

std::vector<VkPhysicalDevice> physical_devices() {
  VkInstance inst = instance();
  if (!inst) return {};
  uint32_t n = 0;
  vkEnumeratePhysicalDevices(inst, &n, nullptr);
  std::vector<VkPhysicalDevice> d(n);
  if (n) vkEnumeratePhysicalDevices(inst, &n, d.data());
  return d;
}

size_t align_to(size_t n, size_t a) { return a ? (n + a - 1) / a * a : n; }

class VulkanBackend;

// The Vulkan side of a device plan (core/device_plan.h): steps are recorded into one command
// buffer per segment at compile time; run() submits them, running CPU nodes between submissions.
class VkPlan : public DevicePlanBase {
 public:
  VkPlan(VulkanBackend& be, Graph& g, std::shared_ptr<ThreadPool> pool);
  ~VkPlan() override;

 protected:
  std::vector<Dispatch> node_dispatch(const Node& nd, const Node* const* src) override {
    auto d = op_dispatch(*ctx_, nd, src);
    n_disp_ += d.size();
    return d;
  }
  size_t node_scratch(const Node& nd, const Node* const* src) override { return op_scratch_bytes(*ctx_, nd, src); }
  std::shared_ptr<DeviceBuffer> new_device_buffer(size_t n) override {
    return std::make_shared<Buffer>(ctx_, n, Buffer::Kind::device);
  }
  HostMem allocate(size_t input_bytes, size_t arena_bytes) override;
  void record_dispatch(int node, Dispatch& d, const std::vector<Operand>& ops) override;
  void record_copy(size_t off, size_t n, bool to_host) override;
  void end_segment() override;
  void submit(size_t s) override { ctx_->submit_wait(cbs_[s], fence_); }

 private:
  VkCommandBuffer cb();  // the open command buffer (begun on first use)
  void barrier(VkCommandBuffer cb);
  std::shared_ptr<Context> ctx_;
  std::vector<VkCommandBuffer> cbs_;
  bool open_ = false;
  std::shared_ptr<Buffer> arena_, shadow_, inputs_, params_;
  VkDescriptorPool dpool_ = VK_NULL_HANDLE;
  VkFence fence_ = VK_NULL_HANDLE;
  size_t salign_ = 64, pslot_ = 0, n_disp_ = 0, k_dev_ = 0;
};

class VulkanBackend : public Backend {
 public:
  explicit VulkanBackend(std::shared_ptr<Context> ctx) : ctx_(std::move(ctx)) {
    ctx_->dummy = std::make_shared<Buffer>(ctx_, 256, Buffer::Kind::device);
  }
  const DeviceInfo& info() const override { return ctx_->info; }
  bool supports(const Node& node, const Node* const* src) const override { return op_supported(*ctx_, node, src); }
  std::shared_ptr<DeviceBuffer> alloc(size_t nbytes) override {
    return std::make_shared<Buffer>(ctx_, nbytes, Buffer::Kind::device);
  }
  void bind_host(const void* host, size_t nbytes, std::shared_ptr<DeviceBuffer> buf) override {
    if (buf && !std::dynamic_pointer_cast<Buffer>(buf)) throw std::invalid_argument("[vulkan] bind_host: not a Vulkan buffer");
    mem_.bind(host, nbytes, std::move(buf), "vulkan");
  }
  void unbind_host(const void* host) override { mem_.unbind(host); }
  std::unique_ptr<DevicePlan> compile(Graph& graph, std::shared_ptr<ThreadPool> pool) override {
    return std::unique_ptr<DevicePlan>(new VkPlan(*this, graph, std::move(pool)));
  }
  std::shared_ptr<Context> ctx_;
  DeviceMemory mem_;
};

VkPlan::VkPlan(VulkanBackend& be, Graph& g, std::shared_ptr<ThreadPool> pool)
    : DevicePlanBase(g, std::move(pool), "vulkan"), ctx_(be.ctx_) {
  salign_ = std::max<size_t>(ctx_->props.limits.minStorageBufferOffsetAlignment, 64);
  VkFenceCreateInfo fi{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
  check(vkCreateFence(ctx_->dev, &fi, nullptr, &fence_), "vkCreateFence");
  build(be, be.mem_, salign_);
}

DevicePlanBase::HostMem VkPlan::allocate(size_t input_bytes, size_t arena_bytes) {
  // Inputs: host-visible, read by the shaders directly. Arena: device-local; shadow: host-visible.
  inputs_ = std::make_shared<Buffer>(ctx_, input_bytes, Buffer::Kind::upload);
  if (!inputs_->mapped()) throw std::runtime_error("[vulkan] input buffer is not host-visible");
  arena_ = std::make_shared<Buffer>(ctx_, arena_bytes, Buffer::Kind::device);
  shadow_ = std::make_shared<Buffer>(ctx_, arena_bytes, Buffer::Kind::readback);
  if (!shadow_->mapped()) throw std::runtime_error("[vulkan] shadow buffer is not host-visible");
  // Dispatch parameters and descriptor sets (every dispatch is known by now).
  const size_t palign = std::max<size_t>(ctx_->props.limits.minUniformBufferOffsetAlignment, 16);
  pslot_ = align_to(sizeof(Params), palign);
  const size_t n_sets = std::max<size_t>(n_disp_, 1);
  params_ = std::make_shared<Buffer>(ctx_, pslot_ * n_sets, Buffer::Kind::upload);
  VkDescriptorPoolSize ps[2] = {{VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER, (uint32_t)n_sets},
                                {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, (uint32_t)n_sets * kMaxBindings}};
  VkDescriptorPoolCreateInfo dpi{VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO};
  dpi.maxSets = (uint32_t)n_sets;
  dpi.poolSizeCount = 2;
  dpi.pPoolSizes = ps;
  check(vkCreateDescriptorPool(ctx_->dev, &dpi, nullptr, &dpool_), "vkCreateDescriptorPool");
  return HostMem{inputs_->mapped(), shadow_->mapped()};
}

VkCommandBuffer VkPlan::cb() {
  if (!open_) {
    VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
    ai.commandPool = ctx_->cmd_pool;
    ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
    ai.commandBufferCount = 1;
    VkCommandBuffer c;
    {
      std::lock_guard<std::mutex> lk(ctx_->cmd_mu);
      check(vkAllocateCommandBuffers(ctx_->dev, &ai, &c), "vkAllocateCommandBuffers");
    }
    VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
    check(vkBeginCommandBuffer(c, &bi), "vkBeginCommandBuffer");
    cbs_.push_back(c);
    open_ = true;
  }
  return cbs_.back();
}

void VkPlan::end_segment() {
  check(vkEndCommandBuffer(cb()), "vkEndCommandBuffer");
  open_ = false;
}

void VkPlan::barrier(VkCommandBuffer c) {
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT | VK_ACCESS_HOST_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT |
                     VK_ACCESS_TRANSFER_WRITE_BIT | VK_ACCESS_HOST_READ_BIT;
  vkCmdPipelineBarrier(c, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                       VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                       0, 1, &mb, 0, nullptr, 0, nullptr);
}

void VkPlan::record_copy(size_t off, size_t n, bool to_host) {
  VkCommandBuffer c = cb();
  VkBufferCopy r{off, off, n};
  if (to_host) vkCmdCopyBuffer(c, arena_->handle(), shadow_->handle(), 1, &r);
  else vkCmdCopyBuffer(c, shadow_->handle(), arena_->handle(), 1, &r);
  barrier(c);
}

void VkPlan::record_dispatch(int, Dispatch& d, const std::vector<Operand>& ops) {
  VkCommandBuffer c = cb();
  // Bind each tensor at an aligned offset; the shader adds the remainder (Params::ofs).
  VkDescriptorBufferInfo bi[kMaxBindings];
  for (int t = 0; t < kMaxBindings; ++t) bi[t] = {ctx_->dummy->handle(), 0, VK_WHOLE_SIZE};
  for (size_t t = 0; t < ops.size(); ++t) {
    const Operand& o = ops[t];
    const Buffer* b = o.mem == Mem::inputs ? inputs_.get() : o.mem == Mem::arena ? arena_.get()
                                                                                  : static_cast<const Buffer*>(o.ext);
    const size_t base = o.off / salign_ * salign_;
    const size_t range = std::min(align_to(o.off - base + o.span, 4), b->size() - base);
    bi[t] = {b->handle(), base, range};
    d.params.ofs[t] = (uint32_t)(o.off - base);
  }
  params_->write(k_dev_ * pslot_, &d.params, sizeof(Params));
  VkDescriptorSetAllocateInfo dai{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO};
  dai.descriptorPool = dpool_;
  dai.descriptorSetCount = 1;
  dai.pSetLayouts = &ctx_->dsl;
  VkDescriptorSet set;
  check(vkAllocateDescriptorSets(ctx_->dev, &dai, &set), "vkAllocateDescriptorSets");
  VkDescriptorBufferInfo pbi{params_->handle(), k_dev_ * pslot_, sizeof(Params)};
  VkWriteDescriptorSet w[2]{};
  w[0].sType = w[1].sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET;
  w[0].dstSet = w[1].dstSet = set;
  w[0].dstBinding = 0;
  w[0].descriptorCount = 1;
  w[0].descriptorType = VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER;
  w[0].pBufferInfo = &pbi;
  w[1].dstBinding = 1;
  w[1].descriptorCount = kMaxBindings;
  w[1].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
  w[1].pBufferInfo = bi;
  vkUpdateDescriptorSets(ctx_->dev, 2, w, 0, nullptr);
  vkCmdBindPipeline(c, VK_PIPELINE_BIND_POINT_COMPUTE, ctx_->pipeline(d.kernel, d.spec));
  vkCmdBindDescriptorSets(c, VK_PIPELINE_BIND_POINT_COMPUTE, ctx_->layout, 0, 1, &set, 0, nullptr);
  const uint32_t gx = std::min<uint32_t>(std::max<uint32_t>(d.groups, 1), 65535);
  const uint32_t gy = (std::max<uint32_t>(d.groups, 1) + gx - 1) / gx;
  vkCmdDispatch(c, gx, gy, 1);
  barrier(c);
  ++k_dev_;
}

VkPlan::~VkPlan() {
  {
    std::lock_guard<std::mutex> lk(ctx_->cmd_mu);
    for (auto c : cbs_) vkFreeCommandBuffers(ctx_->dev, ctx_->cmd_pool, 1, &c);
  }
  if (dpool_) vkDestroyDescriptorPool(ctx_->dev, dpool_, nullptr);
  if (fence_) vkDestroyFence(ctx_->dev, fence_, nullptr);
}

std::shared_ptr<Context> open_context(int index) {
  auto devs = physical_devices();
  if (index < 0 || index >= (int)devs.size())
    throw std::invalid_argument("device 'vulkan:" + std::to_string(index) + "' does not exist (" +
                                std::to_string(devs.size()) + " Vulkan device(s))");
  return std::make_shared<Context>(instance(), devs[index], index);
}

}  // namespace

}  // namespace vk

void register_vulkan_backend() {
  BackendFactory f;
  f.kind = "vulkan";
  f.list = [] {
    std::vector<DeviceInfo> out;
    auto devs = vk::physical_devices();
    for (size_t i = 0; i < devs.size(); ++i) out.push_back(vk::describe(devs[i], (int)i));
    return out;
  };
  f.open = [](int index) -> std::shared_ptr<Backend> {
    return std::make_shared<vk::VulkanBackend>(vk::open_context(index));
  };
  f.unavailable = "";
  register_backend(std::move(f));
}

}  // namespace pyfast
