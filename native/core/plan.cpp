// Plan compilation: execution order, a liveness-based arena for intermediates, the shared work
// buffer, and replay on the thread pool.
#include "pyfast/plan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>

#include "pyfast/cpu.h"

namespace pyfast {

namespace {

constexpr size_t kAlign = 64;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

uint8_t* alloc_aligned(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, n ? align_up(n) : kAlign) != 0) throw std::bad_alloc();
  std::memset(p, 0, n ? align_up(n) : kAlign);
  return static_cast<uint8_t*>(p);
}

// First-fit offset allocator over a virtual arena; records the high-water mark.
class ArenaAllocator {
 public:
  size_t alloc(size_t n) {
    n = align_up(n);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= n) {
        const size_t off = it->first, sz = it->second;
        free_.erase(it);
        if (sz > n) free_[off + n] = sz - n;
        return off;
      }
    }
    // Grow at the end (merging with a trailing free block if there is one).
    size_t off = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) { off = last->first; free_.erase(last); }
    }
    top_ = std::max(top_, off + n);
    return off;
  }
  void release(size_t off, size_t n) {
    n = align_up(n);
    auto it = free_.emplace(off, n).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) { it->second += next->second; free_.erase(next); }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) { prev->second += it->second; free_.erase(it); }
    }
  }
  size_t high_water() const { return top_; }

 private:
  std::map<size_t, size_t> free_;
  size_t top_ = 0;
};

}  // namespace

Plan::Plan(std::shared_ptr<Graph> graph, std::shared_ptr<ThreadPool> pool)
    : graph_(std::move(graph)), pool_(std::move(pool)) {
  auto& nodes = graph_->nodes();
  const int n = (int)nodes.size();
  if (graph_->outputs().empty()) throw std::invalid_argument("[plan] graph has no outputs");

  // Memory root of each node (views and in-place ops alias their source).
  std::vector<int> root(n);
  for (int i = 0; i < n; ++i) root[i] = nodes[i].view_src >= 0 ? root[nodes[i].view_src] : i;

  // Only nodes the outputs depend on are run.
  std::vector<char> needed(n, 0);
  for (auto& o : graph_->outputs()) needed[o.second] = 1;
  for (int i = n - 1; i >= 0; --i) {
    if (!needed[i]) continue;
    const Node& nd = nodes[i];
    for (int s = 0; s < nd.n_src; ++s) needed[nd.src[s]] = 1;
    if (nd.view_src >= 0) needed[nd.view_src] = 1;
  }

  // Last use of each memory root (outputs live to the end).
  std::vector<int> last_use(n, -1);
  for (int i = 0; i < n; ++i) {
    if (!needed[i]) continue;
    last_use[root[i]] = std::max(last_use[root[i]], i);
    const Node& nd = nodes[i];
    for (int s = 0; s < nd.n_src; ++s) last_use[root[nd.src[s]]] = std::max(last_use[root[nd.src[s]]], i);
  }
  for (auto& o : graph_->outputs()) last_use[root[o.second]] = n;

  // Inputs get their own persistent allocations; intermediates share the arena.
  std::vector<size_t> offset(n, 0);
  std::vector<std::vector<int>> frees_at(n + 1);
  ArenaAllocator arena;
  for (int i = 0; i < n; ++i) {
    Node& nd = nodes[i];
    if (nd.kind == NodeKind::input) {
      const size_t sz = span_bytes(nd.dtype, nd.shape);
      nd.data = alloc_aligned(sz);
      owned_.push_back(nd.data);
      stats_.input_bytes += sz;
      in_[nd.name] = i;
    } else if (needed[i] && nd.kind == NodeKind::computed && root[i] == i) {
      offset[i] = arena.alloc(span_bytes(nd.dtype, nd.shape));
      if (last_use[i] < n) frees_at[last_use[i]].push_back(i);
    }
    // Sources whose last use is this node are released after its output was placed.
    for (int r : frees_at[i]) arena.release(offset[r], span_bytes(nodes[r].dtype, nodes[r].shape));
  }
  stats_.arena_bytes = arena.high_water();
  arena_ = alloc_aligned(stats_.arena_bytes);

  // Resolve data pointers in order (views follow their source).
  size_t work = 0;
  const int nth = pool_ ? pool_->size() : 1;
  for (int i = 0; i < n; ++i) {
    Node& nd = nodes[i];
    if (nd.kind != NodeKind::computed) continue;
    if (nd.view_src >= 0) nd.data = nodes[nd.view_src].data ? nodes[nd.view_src].data + nd.view_offset : nullptr;
    else if (needed[i]) nd.data = arena_ + offset[i];
    if (!needed[i]) continue;
    ++stats_.n_nodes;
    if (!op_is_view(nd.op)) {
      exec_.push_back(i);
      const Node* srcs[kMaxSrc];
      for (int s = 0; s < nd.n_src; ++s) srcs[s] = &nodes[nd.src[s]];
      work = std::max(work, cpu_work_size(nd, srcs, nth));
    }
  }
  stats_.n_kernels = (int)exec_.size();
  work_size_ = work;
  stats_.work_bytes = work;
  if (work) {
    work_ = alloc_aligned(work);
    owned_.push_back(work_);
  }
  for (auto& o : graph_->outputs()) out_[o.first] = o.second;
}

Plan::~Plan() {
  std::free(arena_);
  for (uint8_t* p : owned_) std::free(p);
}

Node& Plan::input(const std::string& name) {
  auto it = in_.find(name);
  if (it == in_.end()) throw std::invalid_argument("[plan] no input named '" + name + "'");
  return graph_->at(it->second);
}

const Node& Plan::output(const std::string& name) const {
  auto it = out_.find(name);
  if (it == out_.end()) throw std::invalid_argument("[plan] no output named '" + name + "'");
  return graph_->at(it->second);
}

void Plan::run() {
  auto& nodes = graph_->nodes();
  const CpuIsa isa = cpu_isa();
  const int nth = pool_ ? pool_->size() : 1;
  auto body = [&](int ith) {
    ComputeParams p;
    p.ith = ith;
    p.nth = nth;
    p.wdata = work_;
    p.wsize = work_size_;
    p.pool = pool_.get();
    p.isa = isa;
    const Node* srcs[kMaxSrc];
    for (size_t k = 0; k < exec_.size(); ++k) {
      Node& nd = nodes[exec_[k]];
      for (int s = 0; s < nd.n_src; ++s) srcs[s] = &nodes[nd.src[s]];
      switch (nd.op) {
#define X(name, n_src, is_view) case Op::name: if (!is_view) cpu_##name(p, nd, srcs); break;
#include "pyfast/ops.def"
#undef X
        default: break;
      }
      p.barrier();
    }
  };
  if (pool_) pool_->run(body);
  else body(0);
}

}  // namespace pyfast
