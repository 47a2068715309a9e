// Vulkan instance, devices, buffers and pipelines.
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "vulkan/vk_context.h"

namespace pyfast {
namespace vk {

void fail(VkResult r, const char* what) {
  throw std::runtime_error(std::string("[vulkan] ") + what + " failed (VkResult " + std::to_string((int)r) + ")");
}

DeviceInfo describe(VkPhysicalDevice phys, int index) {
  VkPhysicalDeviceProperties p;
  vkGetPhysicalDeviceProperties(phys, &p);
  VkPhysicalDeviceMemoryProperties mp;
  vkGetPhysicalDeviceMemoryProperties(phys, &mp);
  DeviceInfo d;
  d.kind = "vulkan";
  d.index = index;
  d.name = "vulkan:" + std::to_string(index);
  d.description = p.deviceName;
  for (uint32_t h = 0; h < mp.memoryHeapCount; ++h)
    if (mp.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
      d.memory_bytes = std::max<uint64_t>(d.memory_bytes, mp.memoryHeaps[h].size);
  d.max_buffer_range = p.limits.maxStorageBufferRange;
  return d;
}

// ---- buffers ---------------------------------------------------------------------------------

Buffer::Buffer(std::shared_ptr<Context> ctx, size_t n, Kind kind) : ctx_(std::move(ctx)), size_(n) {
  VkBufferCreateInfo bi{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bi.size = n ? (n + 15) / 16 * 16 : 16;
  bi.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_UNIFORM_BUFFER_BIT |
             VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT;
  bi.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  check(vkCreateBuffer(ctx_->dev, &bi, nullptr, &buf_), "vkCreateBuffer");
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(ctx_->dev, buf_, &req);
  VkMemoryAllocateInfo ai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  ai.allocationSize = req.size;
  ai.memoryTypeIndex = ctx_->memory_type(req.memoryTypeBits, kind);
  VkResult r = vkAllocateMemory(ctx_->dev, &ai, nullptr, &mem_);
  if (r != VK_SUCCESS) {
    vkDestroyBuffer(ctx_->dev, buf_, nullptr);
    throw std::runtime_error("[vulkan] " + ctx_->info.name + ": cannot allocate " + std::to_string(n) +
                             " bytes of device memory (VkResult " + std::to_string((int)r) + ")");
  }
  check(vkBindBufferMemory(ctx_->dev, buf_, mem_, 0), "vkBindBufferMemory");
  const VkMemoryPropertyFlags f = ctx_->mem_props.memoryTypes[ai.memoryTypeIndex].propertyFlags;
  if (f & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) {
    void* p = nullptr;
    check(vkMapMemory(ctx_->dev, mem_, 0, VK_WHOLE_SIZE, 0, &p), "vkMapMemory");
    map_ = static_cast<uint8_t*>(p);
    if (kind != Kind::readback) std::memset(map_, 0, bi.size);
  }
}

Buffer::~Buffer() {
  if (map_) vkUnmapMemory(ctx_->dev, mem_);
  vkDestroyBuffer(ctx_->dev, buf_, nullptr);
  vkFreeMemory(ctx_->dev, mem_, nullptr);
}

void Buffer::write(size_t offset, const void* src, size_t n) {
  if (offset + n > size_) throw std::out_of_range("[vulkan] buffer write out of range");
  if (!n) return;
  if (map_) {
    std::memcpy(map_ + offset, src, n);
    return;
  }
  Buffer staging(ctx_, n, Kind::upload);
  std::memcpy(staging.map_, src, n);
  ctx_->copy(staging.buf_, 0, buf_, offset, n);
}

void Buffer::read(size_t offset, void* dst, size_t n) {
  if (offset + n > size_) throw std::out_of_range("[vulkan] buffer read out of range");
  if (!n) return;
  if (map_) {
    std::memcpy(dst, map_ + offset, n);
    return;
  }
  Buffer staging(ctx_, n, Kind::readback);
  ctx_->copy(buf_, offset, staging.buf_, 0, n);
  std::memcpy(dst, staging.map_, n);
}

void Buffer::zero(size_t offset, size_t n) {
  if (offset + n > size_) throw std::out_of_range("[vulkan] buffer zero out of range");
  if (map_) {
    std::memset(map_ + offset, 0, n);
    return;
  }
  std::vector<uint8_t> z(n, 0);
  write(offset, z.data(), n);
}

// ---- context ---------------------------------------------------------------------------------

Context::Context(VkInstance inst, VkPhysicalDevice p, int index) : phys(p) {
  (void)inst;
  vkGetPhysicalDeviceProperties(phys, &props);
  vkGetPhysicalDeviceMemoryProperties(phys, &mem_props);
  info = describe(phys, index);

  uint32_t nq = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(phys, &nq, nullptr);
  std::vector<VkQueueFamilyProperties> qf(nq);
  vkGetPhysicalDeviceQueueFamilyProperties(phys, &nq, qf.data());
  int fam = -1;
  for (uint32_t i = 0; i < nq; ++i)  // prefer a compute family without graphics (dedicated)
    if ((qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) && !(qf[i].queueFlags & VK_QUEUE_GRAPHICS_BIT)) { fam = (int)i; break; }
  if (fam < 0)
    for (uint32_t i = 0; i < nq; ++i)
      if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) { fam = (int)i; break; }
  if (fam < 0) throw std::runtime_error("[vulkan] " + info.name + " (" + info.description + ") has no compute queue");
  queue_family = (uint32_t)fam;

  VkPhysicalDeviceFeatures have{};
  vkGetPhysicalDeviceFeatures(phys, &have);
  if (!have.shaderStorageBufferArrayDynamicIndexing)
    throw std::runtime_error("[vulkan] " + info.name + " (" + info.description +
                             ") lacks shaderStorageBufferArrayDynamicIndexing, which pyfast's shaders need");
  VkPhysicalDeviceFeatures want{};
  want.shaderStorageBufferArrayDynamicIndexing = VK_TRUE;
  const float prio = 1.0f;
  VkDeviceQueueCreateInfo qi{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qi.queueFamilyIndex = queue_family;
  qi.queueCount = 1;
  qi.pQueuePriorities = &prio;
  std::vector<const char*> exts;
  uint32_t ne = 0;
  vkEnumerateDeviceExtensionProperties(phys, nullptr, &ne, nullptr);
  std::vector<VkExtensionProperties> ep(ne);
  vkEnumerateDeviceExtensionProperties(phys, nullptr, &ne, ep.data());
  bool has_dot_ext = false;
  for (auto& e : ep) {  // MoltenVK: a portability-subset device must enable the extension
    if (std::strcmp(e.extensionName, "VK_KHR_portability_subset") == 0) exts.push_back("VK_KHR_portability_subset");
    if (std::strcmp(e.extensionName, VK_KHR_SHADER_INTEGER_DOT_PRODUCT_EXTENSION_NAME) == 0) has_dot_ext = true;
  }
  // Integer dot products (quantized matmul): the extension's feature, when the device has it.
  VkPhysicalDeviceShaderIntegerDotProductFeaturesKHR dot{};
  dot.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES_KHR;
  if (has_dot_ext) {
    VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
    f2.pNext = &dot;
    vkGetPhysicalDeviceFeatures2(phys, &f2);
    int_dot = dot.shaderIntegerDotProduct == VK_TRUE;
    if (const char* e = std::getenv("PYFAST_VULKAN_INT_DOT"))  // 0: unpacked products (tests both)
      if (std::strcmp(e, "0") == 0) int_dot = false;
    if (int_dot) exts.push_back(VK_KHR_SHADER_INTEGER_DOT_PRODUCT_EXTENSION_NAME);
  }
  info.integer_dot = int_dot;
  VkPhysicalDeviceFeatures2 feats{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  feats.features = want;
  dot.pNext = nullptr;
  dot.shaderIntegerDotProduct = VK_TRUE;
  if (int_dot) feats.pNext = &dot;
  VkDeviceCreateInfo di{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  di.pNext = &feats;
  di.queueCreateInfoCount = 1;
  di.pQueueCreateInfos = &qi;
  di.pEnabledFeatures = nullptr;
  di.enabledExtensionCount = (uint32_t)exts.size();
  di.ppEnabledExtensionNames = exts.data();
  check(vkCreateDevice(phys, &di, nullptr, &dev), "vkCreateDevice");
  vkGetDeviceQueue(dev, queue_family, 0, &queue);

  VkCommandPoolCreateInfo ci{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
  ci.flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
  ci.queueFamilyIndex = queue_family;
  check(vkCreateCommandPool(dev, &ci, nullptr, &cmd_pool), "vkCreateCommandPool");

  VkDescriptorSetLayoutBinding b[2]{};
  b[0].binding = 0;
  b[0].descriptorType = VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER;
  b[0].descriptorCount = 1;
  b[0].stageFlags = VK_SHADER_STAGE_COMPUTE_BIT;
  b[1].binding = 1;
  b[1].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
  b[1].descriptorCount = kMaxBindings;
  b[1].stageFlags = VK_SHADER_STAGE_COMPUTE_BIT;
  VkDescriptorSetLayoutCreateInfo li{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO};
  li.bindingCount = 2;
  li.pBindings = b;
  check(vkCreateDescriptorSetLayout(dev, &li, nullptr, &dsl), "vkCreateDescriptorSetLayout");
  VkPipelineLayoutCreateInfo pi{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  pi.setLayoutCount = 1;
  pi.pSetLayouts = &dsl;
  check(vkCreatePipelineLayout(dev, &pi, nullptr, &layout), "vkCreatePipelineLayout");
}

Context::~Context() {
  if (!dev) return;
  vkDeviceWaitIdle(dev);
  dummy.reset();
  for (auto& p : pipes_) vkDestroyPipeline(dev, p.second, nullptr);
  for (auto& m : modules_) vkDestroyShaderModule(dev, m.second, nullptr);
  vkDestroyPipelineLayout(dev, layout, nullptr);
  vkDestroyDescriptorSetLayout(dev, dsl, nullptr);
  vkDestroyCommandPool(dev, cmd_pool, nullptr);
  vkDestroyDevice(dev, nullptr);
}

uint32_t Context::memory_type(uint32_t bits, Buffer::Kind kind) const {
  auto find = [&](VkMemoryPropertyFlags need, VkMemoryPropertyFlags avoid) -> int {
    for (uint32_t i = 0; i < mem_props.memoryTypeCount; ++i) {
      const VkMemoryPropertyFlags f = mem_props.memoryTypes[i].propertyFlags;
      if ((bits & (1u << i)) && (f & need) == need && !(f & avoid)) return (int)i;
    }
    return -1;
  };
  int t = -1;
  const VkMemoryPropertyFlags host = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
  switch (kind) {
    case Buffer::Kind::device:
      t = find(VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, 0);
      break;
    case Buffer::Kind::upload:
      t = find(host, 0);
      break;
    case Buffer::Kind::readback:
      t = find(host | VK_MEMORY_PROPERTY_HOST_CACHED_BIT, 0);
      if (t < 0) t = find(host, 0);
      break;
  }
  if (t < 0) t = find(0, 0);
  if (t < 0) throw std::runtime_error("[vulkan] " + info.name + ": no memory type for a buffer");
  return (uint32_t)t;
}

VkPipeline Context::pipeline(const std::string& name, const std::vector<int32_t>& spec) {
  std::lock_guard<std::mutex> lk(pipe_mu_);
  auto key = std::make_pair(name, spec);
  auto it = pipes_.find(key);
  if (it != pipes_.end()) return it->second;
  VkShaderModule mod;
  auto mit = modules_.find(name);
  if (mit == modules_.end()) {
    const Spirv* s = find_spirv(name);
    if (!s) throw std::runtime_error("[vulkan] no shader named '" + name + "' was built into this module");
    VkShaderModuleCreateInfo mi{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
    mi.codeSize = s->bytes;
    mi.pCode = s->code;
    check(vkCreateShaderModule(dev, &mi, nullptr, &mod), "vkCreateShaderModule");
    modules_[name] = mod;
  } else {
    mod = mit->second;
  }
  std::vector<VkSpecializationMapEntry> ents(spec.size());
  for (size_t i = 0; i < spec.size(); ++i) {
    ents[i].constantID = (uint32_t)i;
    ents[i].offset = (uint32_t)(i * 4);
    ents[i].size = 4;
  }
  VkSpecializationInfo si{};
  si.mapEntryCount = (uint32_t)ents.size();
  si.pMapEntries = ents.data();
  si.dataSize = spec.size() * 4;
  si.pData = spec.data();
  VkComputePipelineCreateInfo ci{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
  ci.stage.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO;
  ci.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  ci.stage.module = mod;
  ci.stage.pName = "main";
  ci.stage.pSpecializationInfo = spec.empty() ? nullptr : &si;
  ci.layout = layout;
  VkPipeline p;
  check(vkCreateComputePipelines(dev, VK_NULL_HANDLE, 1, &ci, nullptr, &p), "vkCreateComputePipelines");
  pipes_[key] = p;
  return p;
}

void Context::submit_wait(VkCommandBuffer cb, VkFence fence) {
  VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
  si.commandBufferCount = 1;
  si.pCommandBuffers = &cb;
  {
    std::lock_guard<std::mutex> lk(queue_mu);
    check(vkQueueSubmit(queue, 1, &si, fence), "vkQueueSubmit");
  }
  check(vkWaitForFences(dev, 1, &fence, VK_TRUE, UINT64_MAX), "vkWaitForFences");
  check(vkResetFences(dev, 1, &fence), "vkResetFences");
}

void Context::copy(VkBuffer src, size_t src_off, VkBuffer dst, size_t dst_off, size_t n) {
  VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
  ai.commandPool = cmd_pool;
  ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
  ai.commandBufferCount = 1;
  VkCommandBuffer cb;
  std::lock_guard<std::mutex> lk(cmd_mu);  // the command pool is not thread-safe
  check(vkAllocateCommandBuffers(dev, &ai, &cb), "vkAllocateCommandBuffers");
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
  vkBeginCommandBuffer(cb, &bi);
  VkBufferCopy c{src_off, dst_off, n};
  vkCmdCopyBuffer(cb, src, dst, 1, &c);
  vkEndCommandBuffer(cb);
  VkFenceCreateInfo fi{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
  VkFence f;
  check(vkCreateFence(dev, &fi, nullptr, &f), "vkCreateFence");
  submit_wait(cb, f);
  vkDestroyFence(dev, f, nullptr);
  vkFreeCommandBuffers(dev, cmd_pool, 1, &cb);
}

}  // namespace vk
}  // namespace pyfast
