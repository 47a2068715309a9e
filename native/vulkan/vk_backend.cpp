// The Vulkan backend: device discovery, persistent buffers and plans.
//
// A plan is compiled once per graph: every needed node runs on the device when `op_supported`
// says so, otherwise on the CPU. Memory:
// - intermediates share a device-local arena laid out like the CPU plan's (first fit by
//   liveness); a host-visible shadow of the same size receives what the host must see
//   (outputs, sources of CPU nodes) and sends what the CPU produced;
// - inputs live in one host-visible buffer that kernels read directly (Node::data points at it);
// - externals are either persistent state bound to a device buffer by its owner (KV cache,
//   recurrent planes: Backend::bind_host) or read-only weights, uploaded once and shared by
//   every plan that names the same host bytes.
// The steps (dispatches, copies between arena and shadow, CPU nodes) are recorded into command
// buffers at compile time; run() submits them, running CPU nodes between submissions.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "core/arena.h"
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

// Where a tensor's bytes are on the device.
struct Loc {
  VkBuffer buf = VK_NULL_HANDLE;
  size_t size = 0;  // of buf
  size_t off = 0;
};

class VkPlan : public DevicePlan {
 public:
  VkPlan(VulkanBackend& be, Graph& g, std::shared_ptr<ThreadPool> pool);
  ~VkPlan() override;
  void run() override;
  std::string describe() const override { return desc_.str(); }

 private:
  // Bound state a CPU node reads (pulled into its host buffer first) or writes (pushed after).
  struct Sync {
    std::shared_ptr<Buffer> buf;
    size_t off = 0;
    uint8_t* host = nullptr;
    size_t n = 0;
  };
  struct HostStep {
    int node = -1;
    std::vector<Sync> pull, push;
  };
  struct Segment {
    VkCommandBuffer cb = VK_NULL_HANDLE;
    std::vector<HostStep> host;  // run after the command buffer completes
  };
  std::shared_ptr<Context> ctx_;
  Graph& g_;
  std::shared_ptr<ThreadPool> pool_;
  std::vector<Segment> segs_;
  std::shared_ptr<Buffer> arena_, shadow_, inputs_, params_;
  std::vector<std::shared_ptr<DeviceBuffer>> keep_;  // weights and bound state this plan uses
  VkDescriptorPool dpool_ = VK_NULL_HANDLE;
  VkFence fence_ = VK_NULL_HANDLE;
  std::vector<uint8_t> work_;
  std::ostringstream desc_;
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
    if (!buf || buf->size() < nbytes) throw std::invalid_argument("[vulkan] bind_host: buffer smaller than the host range");
    std::lock_guard<std::mutex> lk(mu_);
    bound_[(uintptr_t)host] = Bound{nbytes, std::dynamic_pointer_cast<Buffer>(buf)};
  }
  void unbind_host(const void* host) override {
    std::lock_guard<std::mutex> lk(mu_);
    bound_.erase((uintptr_t)host);
  }
  std::unique_ptr<DevicePlan> compile(Graph& graph, std::shared_ptr<ThreadPool> pool) override {
    return std::unique_ptr<DevicePlan>(new VkPlan(*this, graph, std::move(pool)));
  }

  // The device buffer behind host bytes [p, p + n): bound state, else `nullptr`.
  std::shared_ptr<Buffer> bound(const uint8_t* p, size_t n, size_t& off) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = bound_.upper_bound((uintptr_t)p);
    if (it == bound_.begin()) return nullptr;
    --it;
    const uintptr_t lo = it->first;
    if ((uintptr_t)p + n > lo + it->second.n) return nullptr;
    off = (uintptr_t)p - lo;
    return it->second.buf;
  }
  // A device copy of read-only host bytes (weights), shared while some plan holds it.
  std::shared_ptr<Buffer> weight(const uint8_t* p, size_t n) {
    std::lock_guard<std::mutex> lk(mu_);
    auto key = std::make_pair((uintptr_t)p, n);
    auto it = weights_.find(key);
    if (it != weights_.end())
      if (auto b = it->second.lock()) return b;
    auto b = std::make_shared<Buffer>(ctx_, n, Buffer::Kind::device);
    b->write(0, p, n);
    weights_[key] = b;
    return b;
  }
  std::shared_ptr<Context> ctx_;

 private:
  struct Bound {
    size_t n;
    std::shared_ptr<Buffer> buf;
  };
  std::mutex mu_;
  std::map<uintptr_t, Bound> bound_;
  std::map<std::pair<uintptr_t, size_t>, std::weak_ptr<Buffer>> weights_;
};

void fill_tensor(Params& P, int t, const Node& n) {
  for (int d = 0; d < 4; ++d) {
    const int k = n.shape.ndim - 1 - d;
    P.ne[t][d] = k >= 0 ? (int32_t)n.shape.dims[k] : 1;
    P.nb[t][d] = k >= 0 ? (int32_t)n.shape.strides[k] : 0;
  }
}

VkPlan::VkPlan(VulkanBackend& be, Graph& g, std::shared_ptr<ThreadPool> pool)
    : ctx_(be.ctx_), g_(g), pool_(std::move(pool)) {
  auto& nodes = g.nodes();
  const int n = (int)nodes.size();
  const Liveness lv = liveness(g);
  const int nth = pool_ ? pool_->size() : 1;

  // Which nodes run where.
  std::vector<char> on_dev(n, 0);
  std::vector<int> exec;
  for (int i = 0; i < n; ++i) {
    Node& nd = nodes[i];
    if (!lv.needed[i] || nd.kind != NodeKind::computed || op_is_view(nd.op)) continue;
    const Node* srcs[kMaxSrc];
    for (int s = 0; s < nd.n_src; ++s) srcs[s] = &nodes[nd.src[s]];
    on_dev[i] = be.supports(nd, srcs);
    exec.push_back(i);
  }

  // Inputs: one host-visible buffer.
  const size_t salign = std::max<size_t>(ctx_->props.limits.minStorageBufferOffsetAlignment, 64);
  std::vector<Loc> loc(n);
  std::vector<size_t> in_off(n, 0);
  size_t in_total = 0;
  for (int i = 0; i < n; ++i)
    if (nodes[i].kind == NodeKind::input) {
      in_off[i] = in_total;
      in_total = align_to(in_total + span_bytes(nodes[i].dtype, nodes[i].shape), salign);
    }
  inputs_ = std::make_shared<Buffer>(ctx_, std::max<size_t>(in_total, 64), Buffer::Kind::upload);
  if (!inputs_->mapped()) throw std::runtime_error("[vulkan] input buffer is not host-visible");

  // Intermediates: the arena (device) and its shadow (host-visible), same offsets.
  // Each device node's dispatches (and the scratch some need while they run).
  std::vector<std::vector<Dispatch>> disp(n);
  std::vector<size_t> scratch(n, 0), scratch_off(n, 0);
  size_t n_disp = 0;
  for (int i : exec) {
    if (!on_dev[i]) continue;
    const Node* srcs[kMaxSrc];
    for (int s = 0; s < nodes[i].n_src; ++s) srcs[s] = &nodes[nodes[i].src[s]];
    disp[i] = op_dispatch(*ctx_, nodes[i], srcs);
    scratch[i] = op_scratch_bytes(*ctx_, nodes[i], srcs);
    n_disp += disp[i].size();
  }
  std::vector<size_t> offset(n, 0);
  std::vector<std::vector<int>> frees_at(n + 1);
  arena::Allocator alloc;
  for (int i = 0; i < n; ++i) {
    Node& nd = nodes[i];
    if (lv.needed[i] && nd.kind == NodeKind::computed && lv.root[i] == i) {
      offset[i] = alloc.alloc(span_bytes(nd.dtype, nd.shape));
      if (lv.last_use[i] < n) frees_at[lv.last_use[i]].push_back(i);
    }
    if (scratch[i]) scratch_off[i] = alloc.alloc(scratch[i]);  // only while node i runs
    for (int r : frees_at[i]) alloc.release(offset[r], span_bytes(nodes[r].dtype, nodes[r].shape));
    if (scratch[i]) alloc.release(scratch_off[i], scratch[i]);
  }
  const size_t arena_bytes = std::max<size_t>(alloc.high_water(), 64);
  arena_ = std::make_shared<Buffer>(ctx_, arena_bytes, Buffer::Kind::device);
  shadow_ = std::make_shared<Buffer>(ctx_, arena_bytes, Buffer::Kind::readback);
  if (!shadow_->mapped()) throw std::runtime_error("[vulkan] shadow buffer is not host-visible");

  // Locations (device) and host pointers (Node::data) of every needed node.
  std::vector<std::shared_ptr<Buffer>> ext_buf(n);  // bound state of an external, if any
  for (int i = 0; i < n; ++i) {
    Node& nd = nodes[i];
    if (nd.kind == NodeKind::input) {  // every input has memory, needed or not (callers set them all)
      nd.data = inputs_->mapped() + in_off[i];
      loc[i] = Loc{inputs_->handle(), inputs_->size(), in_off[i]};
      continue;
    }
    if (!lv.needed[i]) continue;
    if (nd.kind == NodeKind::input) {
      nd.data = inputs_->mapped() + in_off[i];
      loc[i] = Loc{inputs_->handle(), inputs_->size(), in_off[i]};
    } else if (nd.kind == NodeKind::external) {
      const size_t span = span_bytes(nd.dtype, nd.shape);
      size_t off = 0;
      std::shared_ptr<Buffer> b = be.bound(nd.data, span, off);
      if (b) {
        ext_buf[i] = b;
      } else {
        b = be.weight(nd.data, span);
        off = 0;
      }
      keep_.push_back(b);
      loc[i] = Loc{b->handle(), b->size(), off};
    } else if (nd.view_src >= 0) {
      const Node& s = nodes[nd.view_src];
      nd.data = s.data ? s.data + nd.view_offset : nullptr;
      loc[i] = loc[nd.view_src];
      loc[i].off += (size_t)nd.view_offset;
      if (lv.root[i] != i && nodes[lv.root[i]].kind == NodeKind::external) ext_buf[i] = ext_buf[lv.root[i]];
    } else {
      nd.data = shadow_->mapped() + offset[i];
      loc[i] = Loc{arena_->handle(), arena_->size(), offset[i]};
    }
  }
  for (int i = 0; i < n; ++i)  // views of bound state inherit the binding
    if (lv.needed[i] && nodes[i].view_src >= 0 && !ext_buf[i] && ext_buf[lv.root[i]]) ext_buf[i] = ext_buf[lv.root[i]];

  // Dispatch parameters and descriptor sets.
  const size_t palign = std::max<size_t>(ctx_->props.limits.minUniformBufferOffsetAlignment, 16);
  const size_t pslot = align_to(sizeof(Params), palign);
  const size_t n_sets = std::max<size_t>(n_disp, 1);
  params_ = std::make_shared<Buffer>(ctx_, pslot * n_sets, Buffer::Kind::upload);
  VkDescriptorPoolSize ps[2] = {{VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER, (uint32_t)n_sets},
                                {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, (uint32_t)n_sets * kMaxBindings}};
  VkDescriptorPoolCreateInfo dpi{VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO};
  dpi.maxSets = (uint32_t)n_sets;
  dpi.poolSizeCount = 2;
  dpi.pPoolSizes = ps;
  check(vkCreateDescriptorPool(ctx_->dev, &dpi, nullptr, &dpool_), "vkCreateDescriptorPool");
  VkFenceCreateInfo fi{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
  check(vkCreateFence(ctx_->dev, &fi, nullptr, &fence_), "vkCreateFence");

  // Where the newest value of each memory root is: device (arena / input / bound state) or the
  // host (shadow, after a CPU node). Inputs and weights are valid on both.
  enum : uint8_t { kBoth = 0, kDev = 1, kHost = 2 };
  std::vector<uint8_t> where(n, kBoth);
  size_t work = 0;

  auto begin_cb = [&]() {
    VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
    ai.commandPool = ctx_->cmd_pool;
    ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
    ai.commandBufferCount = 1;
    Segment s;
    {
      std::lock_guard<std::mutex> lk(ctx_->cmd_mu);
      check(vkAllocateCommandBuffers(ctx_->dev, &ai, &s.cb), "vkAllocateCommandBuffers");
    }
    VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
    check(vkBeginCommandBuffer(s.cb, &bi), "vkBeginCommandBuffer");
    segs_.push_back(std::move(s));
  };
  auto barrier = [&](VkCommandBuffer cb) {
    VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
    mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT | VK_ACCESS_HOST_WRITE_BIT;
    mb.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT |
                       VK_ACCESS_TRANSFER_WRITE_BIT | VK_ACCESS_HOST_READ_BIT;
    vkCmdPipelineBarrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                         VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                         0, 1, &mb, 0, nullptr, 0, nullptr);
  };
  // Copy a computed root's bytes between arena and shadow.
  auto copy_root = [&](VkCommandBuffer cb, int r, bool to_host) {
    const size_t o = offset[r], sz = span_bytes(nodes[r].dtype, nodes[r].shape);
    VkBufferCopy c{o, o, sz};
    if (to_host) vkCmdCopyBuffer(cb, arena_->handle(), shadow_->handle(), 1, &c);
    else vkCmdCopyBuffer(cb, shadow_->handle(), arena_->handle(), 1, &c);
    barrier(cb);
    ++n_copies;
    desc_ << (to_host ? "  copy device->host " : "  copy host->device ") << (nodes[r].name.empty() ? "#" + std::to_string(r) : nodes[r].name)
          << " (" << sz << " bytes)\n";
  };
  auto is_computed_root = [&](int r) { return nodes[r].kind == NodeKind::computed; };

  begin_cb();
  size_t k_dev = 0;
  for (int i : exec) {
    Node& nd = nodes[i];
    const Node* srcs[kMaxSrc];
    for (int s = 0; s < nd.n_src; ++s) srcs[s] = &nodes[nd.src[s]];
    VkCommandBuffer cb = segs_.back().cb;
    if (on_dev[i]) {
      for (int s = 0; s < nd.n_src; ++s) {
        const int r = lv.root[nd.src[s]];
        if (is_computed_root(r) && where[r] == kHost) {
          copy_root(cb, r, false);
          where[r] = kBoth;
        }
      }
      for (Dispatch& d : disp[i]) {
        // Bind each tensor at an aligned offset; the shader adds the remainder (Params::ofs).
        VkDescriptorBufferInfo bi[kMaxBindings];
        for (int t = 0; t < kMaxBindings; ++t) bi[t] = {ctx_->dummy->handle(), 0, VK_WHOLE_SIZE};
        auto bind_at = [&](int t, const Loc& l, size_t span) {
          const size_t base = l.off / salign * salign;
          const size_t range = std::min(align_to(l.off - base + span, 4), l.size - base);
          bi[t] = {l.buf, base, range};
          d.params.ofs[t] = (uint32_t)(l.off - base);
        };
        auto bind = [&](int t, int id) {
          bind_at(t, loc[id], span_bytes(nodes[id].dtype, nodes[id].shape));
          fill_tensor(d.params, t, nodes[id]);
        };
        std::vector<int> slots = d.bind;
        if (slots.empty()) {
          slots.push_back(kOut);
          for (int s = 0; s < nd.n_src; ++s) slots.push_back(s);
        }
        for (size_t t = 0; t < slots.size(); ++t) {
          if (slots[t] == kOut) bind((int)t, i);
          else if (slots[t] == kScratch) bind_at((int)t, Loc{arena_->handle(), arena_->size(), scratch_off[i]}, scratch[i]);
          else bind((int)t, nd.src[slots[t]]);
        }
        params_->write(k_dev * pslot, &d.params, sizeof(Params));
        VkDescriptorSetAllocateInfo dai{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO};
        dai.descriptorPool = dpool_;
        dai.descriptorSetCount = 1;
        dai.pSetLayouts = &ctx_->dsl;
        VkDescriptorSet set;
        check(vkAllocateDescriptorSets(ctx_->dev, &dai, &set), "vkAllocateDescriptorSets");
        VkDescriptorBufferInfo pbi{params_->handle(), k_dev * pslot, sizeof(Params)};
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
        vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, ctx_->pipeline(d.shader, d.spec));
        vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, ctx_->layout, 0, 1, &set, 0, nullptr);
        const uint32_t gx = std::min<uint32_t>(std::max<uint32_t>(d.groups, 1), 65535);
        const uint32_t gy = (std::max<uint32_t>(d.groups, 1) + gx - 1) / gx;
        vkCmdDispatch(cb, gx, gy, 1);
        barrier(cb);
        ++k_dev;
        desc_ << "device " << op_name(nd.op) << " " << (nd.name.empty() ? "#" + std::to_string(i) : nd.name) << " ["
              << d.shader << "]\n";
      }
      ++n_device_nodes;
      where[lv.root[i]] = nodes[lv.root[i]].kind == NodeKind::computed ? kDev : kBoth;
    } else {
      // A CPU node: its computed sources come to the shadow, then this segment ends.
      HostStep hs;
      hs.node = i;
      for (int s = 0; s < nd.n_src; ++s) {
        const int r = lv.root[nd.src[s]];
        if (is_computed_root(r) && where[r] == kDev) {
          copy_root(cb, r, true);
          where[r] = kBoth;
        }
        if (ext_buf[nd.src[s]]) {  // bound state: read its device bytes into the host buffer
          const Node& sn = nodes[nd.src[s]];
          size_t off = 0;
          auto b = be.bound(sn.data, span_bytes(sn.dtype, sn.shape), off);
          if (b) hs.pull.push_back(Sync{b, off, sn.data, span_bytes(sn.dtype, sn.shape)});
        }
      }
      // Bound state the CPU writes (tensor t, whose memory root is r): back to the device after.
      auto written = [&](const Node& t, int r) -> Sync {
        size_t off = 0;
        auto b = be.bound(t.data, span_bytes(t.dtype, t.shape), off);
        if (!b)
          throw std::invalid_argument("[vulkan] '" + nodes[r].name + "' is written by " + op_name(nd.op) +
                                      " on the CPU but has no device buffer bound (bind it with Buffer(device=...))");
        return Sync{b, off, t.data, span_bytes(t.dtype, t.shape)};
      };
      // Sources the op writes in place (recurrent state planes).
      for (int s = 0; s < nd.n_src; ++s) {
        const int rs = lv.root[nd.src[s]];
        if (!op_writes_src(nd.op, s) || rs == lv.root[i]) continue;  // aliased with the output: below
        if (nodes[rs].kind == NodeKind::external) hs.push.push_back(written(nodes[nd.src[s]], rs));
        else if (is_computed_root(rs)) where[rs] = kHost;
      }
      const int r = lv.root[i];
      if (nodes[r].kind == NodeKind::external) {  // set_rows into bound state
        hs.pull.push_back(written(nd, r));  // the rows it leaves alone
        hs.push.push_back(hs.pull.back());
      } else {
        where[r] = kHost;
      }
      work = std::max(work, cpu_work_size(nd, srcs, nth));
      ++n_host_nodes;
      desc_ << "cpu    " << op_name(nd.op) << " " << (nd.name.empty() ? "#" + std::to_string(i) : nd.name) << "\n";
      check(vkEndCommandBuffer(cb), "vkEndCommandBuffer");
      segs_.back().host.push_back(std::move(hs));
      begin_cb();
    }
  }
  // Outputs come back to the host.
  for (auto& o : g.outputs()) {
    const int r = lv.root[o.second];
    if (is_computed_root(r) && where[r] == kDev) {
      copy_root(segs_.back().cb, r, true);
      where[r] = kBoth;
    } else if (nodes[r].kind == NodeKind::external && ext_buf[r]) {
      throw std::invalid_argument("[vulkan] output '" + o.first + "' is bound device state; read it from its buffer");
    }
  }
  check(vkEndCommandBuffer(segs_.back().cb), "vkEndCommandBuffer");
  work_.assign(arena::align_up(work) + 64, 0);
}

VkPlan::~VkPlan() {
  {
    std::lock_guard<std::mutex> lk(ctx_->cmd_mu);
    for (auto& s : segs_) vkFreeCommandBuffers(ctx_->dev, ctx_->cmd_pool, 1, &s.cb);
  }
  if (dpool_) vkDestroyDescriptorPool(ctx_->dev, dpool_, nullptr);
  if (fence_) vkDestroyFence(ctx_->dev, fence_, nullptr);
}

void VkPlan::run() {
  auto& nodes = g_.nodes();
  for (auto& s : segs_) {
    ctx_->submit_wait(s.cb, fence_);
    for (auto& h : s.host) {
      Node& nd = nodes[h.node];
      const Node* srcs[kMaxSrc];
      for (int i = 0; i < nd.n_src; ++i) srcs[i] = &nodes[nd.src[i]];
      for (auto& p : h.pull) p.buf->read(p.off, p.host, p.n);
      cpu_run_node(pool_.get(), nd, srcs, work_.data(), work_.size());
      for (auto& p : h.push) p.buf->write(p.off, p.host, p.n);
    }
  }
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
