// The backend-independent half of a device plan (device_plan.h).
#include "core/device_plan.h"

#include <algorithm>
#include <stdexcept>

#include "core/arena.h"
#include "pyfast/cpu.h"

namespace pyfast {

namespace {
size_t align_to(size_t n, size_t a) { return a ? (n + a - 1) / a * a : n; }
std::string node_label(const Node& nd, int i) { return nd.name.empty() ? "#" + std::to_string(i) : nd.name; }
}  // namespace

void fill_tensor(KernelParams& P, int t, const Node& n) {
  for (int d = 0; d < 4; ++d) {
    const int k = n.shape.ndim - 1 - d;
    P.ne[t][d] = k >= 0 ? (int32_t)n.shape.dims[k] : 1;
    P.nb[t][d] = k >= 0 ? (int32_t)n.shape.strides[k] : 0;
  }
}

// ---- DeviceMemory ----------------------------------------------------------------------------

void DeviceMemory::bind(const void* host, size_t nbytes, std::shared_ptr<DeviceBuffer> buf, const char* kind) {
  if (!buf || buf->size() < nbytes)
    throw std::invalid_argument(std::string("[") + kind + "] bind_host: buffer smaller than the host range");
  std::lock_guard<std::mutex> lk(mu_);
  bound_[(uintptr_t)host] = Bound{nbytes, std::move(buf)};
}

void DeviceMemory::unbind(const void* host) {
  std::lock_guard<std::mutex> lk(mu_);
  bound_.erase((uintptr_t)host);
}

std::shared_ptr<DeviceBuffer> DeviceMemory::bound(const uint8_t* p, size_t n, size_t& off) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = bound_.upper_bound((uintptr_t)p);
  if (it == bound_.begin()) return nullptr;
  --it;
  const uintptr_t lo = it->first;
  if ((uintptr_t)p + n > lo + it->second.n) return nullptr;
  off = (uintptr_t)p - lo;
  return it->second.buf;
}

std::shared_ptr<DeviceBuffer> DeviceMemory::weight(const uint8_t* p, size_t n,
                                                   const std::function<std::shared_ptr<DeviceBuffer>(size_t)>& make) {
  std::lock_guard<std::mutex> lk(mu_);
  auto key = std::make_pair((uintptr_t)p, n);
  auto it = weights_.find(key);
  if (it != weights_.end())
    if (auto b = it->second.lock()) return b;
  auto b = make(n);
  b->write(0, p, n);
  weights_[key] = b;
  return b;
}

// ---- DevicePlanBase --------------------------------------------------------------------------

void DevicePlanBase::build(Backend& be, DeviceMemory& mem, size_t in_align) {
  auto& nodes = g_.nodes();
  const int n = (int)nodes.size();
  const Liveness lv = liveness(g_);
  const int nth = pool_ ? pool_->size() : 1;
  const std::string tag = std::string("[") + kind_ + "] ";

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

  // Inputs: one buffer, each at an aligned offset.
  std::vector<size_t> in_off(n, 0);
  size_t in_total = 0;
  for (int i = 0; i < n; ++i)
    if (nodes[i].kind == NodeKind::input) {
      in_off[i] = in_total;
      in_total = align_to(in_total + span_bytes(nodes[i].dtype, nodes[i].shape), in_align);
    }

  // Each device node's dispatches, and the scratch some need while they run.
  std::vector<std::vector<Dispatch>> disp(n);
  std::vector<size_t> scratch(n, 0), scratch_off(n, 0);
  for (int i : exec) {
    if (!on_dev[i]) continue;
    const Node* srcs[kMaxSrc];
    for (int s = 0; s < nodes[i].n_src; ++s) srcs[s] = &nodes[nodes[i].src[s]];
    disp[i] = node_dispatch(nodes[i], srcs);
    scratch[i] = node_scratch(nodes[i], srcs);
  }
  // Intermediates: the arena (device) and its shadow (host), same offsets.
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
  const HostMem hm = allocate(std::max<size_t>(in_total, 64), arena_bytes);

  // Locations (device) and host pointers (Node::data) of every needed node.
  std::vector<Operand> loc(n);
  std::vector<std::shared_ptr<DeviceBuffer>> ext_buf(n);  // bound state of an external, if any
  for (int i = 0; i < n; ++i) {
    Node& nd = nodes[i];
    if (nd.kind == NodeKind::input) {  // every input has memory, needed or not (callers set them all)
      nd.data = hm.inputs + in_off[i];
      loc[i] = Operand{Mem::inputs, nullptr, in_off[i]};
      continue;
    }
    if (!lv.needed[i]) continue;
    if (nd.kind == NodeKind::external) {
      const size_t span = span_bytes(nd.dtype, nd.shape);
      size_t off = 0;
      std::shared_ptr<DeviceBuffer> b = mem.bound(nd.data, span, off);
      if (b) {
        ext_buf[i] = b;
      } else {
        b = mem.weight(nd.data, span, [&](size_t k) { return new_device_buffer(k); });
        off = 0;
      }
      keep_.push_back(b);
      loc[i] = Operand{Mem::external, b.get(), off};
    } else if (nd.view_src >= 0) {
      const Node& s = nodes[nd.view_src];
      nd.data = s.data ? s.data + nd.view_offset : nullptr;
      loc[i] = loc[nd.view_src];
      loc[i].off += (size_t)nd.view_offset;
    } else {
      nd.data = hm.shadow + offset[i];
      loc[i] = Operand{Mem::arena, nullptr, offset[i]};
    }
  }
  for (int i = 0; i < n; ++i)  // views of bound state inherit the binding
    if (lv.needed[i] && nodes[i].view_src >= 0 && !ext_buf[i] && ext_buf[lv.root[i]]) ext_buf[i] = ext_buf[lv.root[i]];

  // Where the newest value of each memory root is: device (arena / input / bound state) or the
  // host (shadow, after a CPU node). Inputs and weights are valid on both.
  enum : uint8_t { kBoth = 0, kDev = 1, kHost = 2 };
  std::vector<uint8_t> where(n, kBoth);
  size_t work = 0;
  host_.assign(1, {});

  auto copy_root = [&](int r, bool to_host) {
    const size_t sz = span_bytes(nodes[r].dtype, nodes[r].shape);
    record_copy(offset[r], sz, to_host);
    ++n_copies;
    desc_ << (to_host ? "  copy device->host " : "  copy host->device ") << node_label(nodes[r], r) << " (" << sz
          << " bytes)\n";
  };
  auto is_computed_root = [&](int r) { return nodes[r].kind == NodeKind::computed; };

  for (int i : exec) {
    Node& nd = nodes[i];
    const Node* srcs[kMaxSrc];
    for (int s = 0; s < nd.n_src; ++s) srcs[s] = &nodes[nd.src[s]];
    if (on_dev[i]) {
      for (int s = 0; s < nd.n_src; ++s) {
        const int r = lv.root[nd.src[s]];
        if (is_computed_root(r) && where[r] == kHost) {
          copy_root(r, false);
          where[r] = kBoth;
        }
      }
      for (Dispatch& d : disp[i]) {
        std::vector<int> slots = d.bind;
        if (slots.empty()) {
          slots.push_back(kOut);
          for (int s = 0; s < nd.n_src; ++s) slots.push_back(s);
        }
        std::vector<Operand> ops(slots.size());
        for (size_t t = 0; t < slots.size(); ++t) {
          if (slots[t] == kScratch) {
            ops[t] = Operand{Mem::arena, nullptr, scratch_off[i], scratch[i], nullptr};
            continue;
          }
          const int id = slots[t] == kOut ? i : nd.src[slots[t]];
          ops[t] = loc[id];
          ops[t].span = span_bytes(nodes[id].dtype, nodes[id].shape);
          ops[t].node = &nodes[id];
          fill_tensor(d.params, (int)t, nodes[id]);
        }
        record_dispatch(i, d, ops);
        desc_ << "device " << op_name(nd.op) << " " << node_label(nd, i) << " [" << d.kernel << "]\n";
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
          copy_root(r, true);
          where[r] = kBoth;
        }
        if (ext_buf[nd.src[s]]) {  // bound state: read its device bytes into the host buffer
          const Node& sn = nodes[nd.src[s]];
          size_t off = 0;
          auto b = mem.bound(sn.data, span_bytes(sn.dtype, sn.shape), off);
          if (b) hs.pull.push_back(Sync{b, off, sn.data, span_bytes(sn.dtype, sn.shape)});
        }
      }
      // Bound state the CPU writes (tensor t, whose memory root is r): back to the device after.
      auto written = [&](const Node& t, int r) -> Sync {
        size_t off = 0;
        auto b = mem.bound(t.data, span_bytes(t.dtype, t.shape), off);
        if (!b)
          throw std::invalid_argument(tag + "'" + nodes[r].name + "' is written by " + op_name(nd.op) +
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
      desc_ << "cpu    " << op_name(nd.op) << " " << node_label(nd, i) << "\n";
      end_segment();
      host_.back().push_back(std::move(hs));
      host_.emplace_back();
    }
  }
  // Outputs come back to the host.
  for (auto& o : g_.outputs()) {
    const int r = lv.root[o.second];
    if (is_computed_root(r) && where[r] == kDev) {
      copy_root(r, true);
      where[r] = kBoth;
    } else if (nodes[r].kind == NodeKind::external && ext_buf[r]) {
      throw std::invalid_argument(tag + "output '" + o.first + "' is bound device state; read it from its buffer");
    }
  }
  end_segment();
  work_.assign(arena::align_up(work) + 64, 0);
}

void DevicePlanBase::run() {
  auto& nodes = g_.nodes();
  for (size_t s = 0; s < host_.size(); ++s) {
    submit(s);
    for (auto& h : host_[s]) {
      Node& nd = nodes[h.node];
      const Node* srcs[kMaxSrc];
      for (int i = 0; i < nd.n_src; ++i) srcs[i] = &nodes[nd.src[i]];
      for (auto& p : h.pull) p.buf->read(p.off, p.host, p.n);
      cpu_run_node(pool_.get(), nd, srcs, work_.data(), work_.size());
      for (auto& p : h.push) p.buf->write(p.off, p.host, p.n);
    }
  }
}

}  // namespace pyfast
