// Plan compilation: execution order, a liveness-based arena for intermediates, the shared work
// buffer, and replay on the thread pool.
#include "pyfast/plan.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/arena.h"
#include "pyfast/cpu.h"

namespace pyfast {

namespace {

using arena::kAlign;
using arena::align_up;

uint8_t* alloc_aligned(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, n ? align_up(n) : kAlign) != 0) throw std::bad_alloc();
  std::memset(p, 0, n ? align_up(n) : kAlign);
  return static_cast<uint8_t*>(p);
}

// Op profile (environment variable PYFAST_PROFILE=1): the time each op's kernel shares took,
// summed over threads, and the time threads waited for each other between groups; printed to
// stderr when the process exits. PYFAST_PROFILE=2 also lists the matmuls (and matmul_id, by the
// experts it selected) by weight type, shape and rows, with the weight bytes read per second of
// thread time, and the groups of nodes (see Plan::run) after which threads waited longest.
// Off, it costs one predictable branch per share.
struct OpProfile {
  bool on = false, detail = false;
  std::atomic<uint64_t> ns[(int)Op::count + 1] = {}, calls[(int)Op::count + 1] = {};
  struct MatmulStat {
    uint64_t ns = 0, runs = 0, bytes = 0;
  };
  std::mutex mu;
  std::map<std::string, MatmulStat> matmuls;
  std::map<std::string, MatmulStat> waits;  // by the ops of the group waited for (ns, runs = waits)
  OpProfile() {
    const char* e = std::getenv("PYFAST_PROFILE");
    on = e && *e && std::strcmp(e, "0") != 0;
    detail = on && std::strcmp(e, "2") == 0;
  }
  ~OpProfile() {
    if (!on) return;
    if (detail && !matmuls.empty()) {
      std::fprintf(stderr, "pyfast matmul profile (thread time):\n%-44s %8s %10s %10s %14s\n", "weight (N x K), rows", "runs",
                   "ms", "us/run", "GB/s/thread");
      for (const auto& kv : matmuls) {
        const MatmulStat& m = kv.second;
        std::fprintf(stderr, "%-44s %8llu %10.1f %10.2f %14.2f\n", kv.first.c_str(), (unsigned long long)m.runs,
                     m.ns / 1e6, m.ns / 1e3 / (double)(m.runs ? m.runs : 1), m.ns ? (double)m.bytes / (double)m.ns : 0.0);
      }
    }
    if (detail && !waits.empty()) {
      std::vector<const std::pair<const std::string, MatmulStat>*> by_time;
      for (const auto& kv : waits) by_time.push_back(&kv);
      std::sort(by_time.begin(), by_time.end(), [](const auto* a, const auto* b) { return a->second.ns > b->second.ns; });
      std::fprintf(stderr, "pyfast wait profile (thread time waiting for a group's last share, longest first):\n%-60s %8s %10s %10s\n",
                   "group (ops; * fused matmuls)", "waits", "ms", "us/wait");
      for (size_t i = 0; i < by_time.size() && i < 12; ++i) {
        const MatmulStat& w = by_time[i]->second;
        std::fprintf(stderr, "%-60s %8llu %10.1f %10.2f\n", by_time[i]->first.c_str(), (unsigned long long)w.runs,
                     w.ns / 1e6, w.ns / 1e3 / (double)w.runs);
      }
    }
    uint64_t total = 0;
    for (int i = 0; i <= (int)Op::count; ++i) total += ns[i].load();
    if (!total) return;
    std::fprintf(stderr, "pyfast profile (thread time, all plans):\n%-16s %10s %12s %10s %7s\n", "op", "shares",
                 "ms", "us/share", "share");
    for (int i = 0; i <= (int)Op::count; ++i) {
      const uint64_t t = ns[i].load(), c = calls[i].load();
      if (!c) continue;
      std::fprintf(stderr, "%-16s %10llu %12.1f %10.2f %6.1f%%\n", i == (int)Op::count ? "(wait)" : op_name((Op)i),
                   (unsigned long long)c, t / 1e6, t / 1e3 / (double)c, 100.0 * (double)t / (double)total);
    }
  }
  static uint64_t now() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void add(int op, uint64_t t) {
    ns[op].fetch_add(t, std::memory_order_relaxed);
    calls[op].fetch_add(1, std::memory_order_relaxed);
  }
  // One share of a matmul of x by the weights ws (several: fused); the first share of a run
  // counts the weights' bytes.
  void add_matmul(const Node& x, const Node* const* ws, int n_w, bool first, uint64_t t) {
    const Node& w = *ws[0];
    int64_t N = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < n_w; ++i) {
      N += ws[i]->shape[-2];
      bytes += span_bytes(ws[i]->dtype, ws[i]->shape);
    }
    const int64_t K = w.shape[-1], M = K ? x.shape.numel() / K : 0;
    char key[96];
    std::snprintf(key, sizeof key, "%s%s %lld x %lld%s, %lld", dtype_name(w.dtype), w.packed ? " x16" : "",
                  (long long)N, (long long)K, n_w > 1 ? " (fused)" : w.shape.ndim > 2 ? " (experts)" : "", (long long)M);
    record(key, first, bytes, t);
  }
  // One share of matmul_id (w[E, N, K], ids[T, k]); the first share counts the bytes of the
  // distinct experts the ids select.
  void add_matmul_id(const Node& x, const Node& w, const Node& ids, bool first, uint64_t t) {
    const int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
    uint64_t bytes = 0;
    if (first) {
      std::vector<char> used((size_t)E, 0);
      int64_t n_used = 0;
      for (int64_t a = 0; a < ids.shape[0]; ++a)
        for (int64_t b = 0; b < ids.shape[1]; ++b) {
          const int32_t e = *reinterpret_cast<const int32_t*>(ids.data + a * ids.shape.strides[0] + b * ids.shape.strides[1]);
          if (e >= 0 && e < E && !used[(size_t)e]) {
            used[(size_t)e] = 1;
            ++n_used;
          }
        }
      bytes = (uint64_t)n_used * (uint64_t)w.shape.strides[0];
    }
    const int64_t rows = K ? x.shape.numel() / K : 0;
    char key[96];
    std::snprintf(key, sizeof key, "%s%s %lld x %lld (selected experts), %lld", dtype_name(w.dtype), w.packed ? " x16" : "",
                  (long long)N, (long long)K, (long long)rows);
    record(key, first, bytes, t);
  }
  void add_wait(const std::string& group, uint64_t t) {  // (Plan::group_ops_)
    std::lock_guard<std::mutex> lk(mu);
    MatmulStat& w = waits[group];
    w.ns += t;
    w.runs += 1;
  }
  void record(const char* key, bool first, uint64_t bytes, uint64_t t) {
    std::lock_guard<std::mutex> lk(mu);
    MatmulStat& m = matmuls[key];
    m.ns += t;
    if (first) {
      m.runs += 1;
      m.bytes += bytes;
    }
  }
};
OpProfile g_profile;

}  // namespace

Liveness liveness(const Graph& g) {
  const auto& nodes = g.nodes();
  const int n = (int)nodes.size();
  Liveness lv;
  // Memory root of each node (views and in-place ops alias their source).
  lv.root.resize(n);
  for (int i = 0; i < n; ++i) lv.root[i] = nodes[i].view_src >= 0 ? lv.root[nodes[i].view_src] : i;
  // Only nodes the outputs depend on are run.
  lv.needed.assign(n, 0);
  for (auto& o : g.outputs()) lv.needed[o.second] = 1;
  for (int i = n - 1; i >= 0; --i) {
    if (!lv.needed[i]) continue;
    const Node& nd = nodes[i];
    for (int s = 0; s < nd.n_src; ++s) lv.needed[nd.src[s]] = 1;
    if (nd.view_src >= 0) lv.needed[nd.view_src] = 1;
  }
  // Last use of each memory root (outputs live to the end).
  lv.last_use.assign(n, -1);
  for (int i = 0; i < n; ++i) {
    if (!lv.needed[i]) continue;
    lv.last_use[lv.root[i]] = std::max(lv.last_use[lv.root[i]], i);
    const Node& nd = nodes[i];
    for (int s = 0; s < nd.n_src; ++s) lv.last_use[lv.root[nd.src[s]]] = std::max(lv.last_use[lv.root[nd.src[s]]], i);
  }
  for (auto& o : g.outputs()) lv.last_use[lv.root[o.second]] = n;
  return lv;
}

bool cpu_matmul_syncs(const Node& dst, const Node* const* src, int nth);  // kernels/matmul.cpp
bool cpu_argmax_syncs(const Node& dst, const Node* const* src, int nth);  // kernels/elementwise.cpp
bool cpu_matmul_id_syncs(const Node& dst, const Node* const* src, int nth);  // kernels/moe.cpp
bool cpu_matmul_fusable(const Node& a, const Node* const* asrc, const Node& b, const Node* const* bsrc);
void cpu_matmul_multi(const ComputeParams& p, Node* const* dsts, const Node* const* ws, int nw, const Node& x);

namespace {

// Kernels that split their work by (ith, nth) alone, keep per-share scratch at an ith-indexed
// place, write only their output and never call p.barrier(): any thread may run any share of
// them. (Ops not listed here, e.g. ones added later, run as before: each thread its own share.)
bool op_shareable(const Node& nd, const Node* const* srcs, int nth) {
  switch (nd.op) {
    case Op::get_rows: case Op::add: case Op::mul: case Op::scale: case Op::rms_norm: case Op::rope:
    case Op::softmax: case Op::attention: case Op::silu: case Op::swiglu: case Op::set_rows: case Op::cpy:
    case Op::sigmoid: case Op::softplus: case Op::relu: case Op::l2_norm: case Op::concat: case Op::sum:
    case Op::topk: case Op::gather:
    case Op::ssm_conv: case Op::gated_delta_net:  // they also write their state source (op_writes_src)
      return true;
    case Op::matmul:
      return !cpu_matmul_syncs(nd, srcs, nth);
    case Op::matmul_id:
      return !cpu_matmul_id_syncs(nd, srcs, nth);
    case Op::argmax:
      return !cpu_argmax_syncs(nd, srcs, nth);
    default:
      return false;
  }
}

// Scheduling data of a plan, kept after the kernels' scratch in the work allocation (see run()).
struct Sched {
  size_t n_exec = 0, stride = 0;  // claim flags per share index: stride bytes (cache lines)
  uint32_t* group_end = nullptr;  // [n_exec] for a group's first node: one past its last node
  uint64_t* wofs = nullptr;       // [n_exec] offset of the node's scratch in the work area
  uint8_t* shareable = nullptr;   // [n_exec]
  std::atomic<uint8_t>* claimed = nullptr;  // [nth][stride]: share s of node k started (per run)
  size_t rstride = 0;                       // words per node in `ranges` (nth, padded to a cache line)
  std::atomic<uint64_t>* ranges = nullptr;  // [n_exec][rstride]: per-run work ranges (ComputeParams)
};

size_t range_stride(int nth) { return ((size_t)nth + 7) & ~(size_t)7; }

size_t claim_stride(size_t n_exec) { return (n_exec + 63) & ~(size_t)63; }

size_t sched_bytes(size_t n_exec, int nth) {
  return align_up(n_exec * 4) + align_up(n_exec * 8) + align_up(n_exec) + align_up(claim_stride(n_exec) * (size_t)nth) +
         n_exec * range_stride(nth) * 8;
}

Sched sched_at(uint8_t* base, size_t n_exec, int nth) {
  Sched sc;
  sc.n_exec = n_exec;
  sc.stride = claim_stride(n_exec);
  size_t off = 0;
  sc.group_end = reinterpret_cast<uint32_t*>(base + off);
  off += align_up(n_exec * 4);
  sc.wofs = reinterpret_cast<uint64_t*>(base + off);
  off += align_up(n_exec * 8);
  sc.shareable = base + off;
  off += align_up(n_exec);
  static_assert(sizeof(std::atomic<uint8_t>) == 1, "claim flags");
  sc.claimed = reinterpret_cast<std::atomic<uint8_t>*>(base + off);
  off += align_up(claim_stride(n_exec) * (size_t)nth);
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "work ranges");
  sc.rstride = range_stride(nth);
  sc.ranges = reinterpret_cast<std::atomic<uint64_t>*>(base + off);
  return sc;
}

}  // namespace

std::shared_ptr<uint8_t> ArenaPool::acquire(size_t nbytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (cur_ && size_ >= nbytes) return cur_;
  // grow by at least half, so a run of slightly larger plans does not allocate each time
  const size_t n = std::max(nbytes, size_ + size_ / 2);
  cur_ = std::shared_ptr<uint8_t>(alloc_aligned(n), [](uint8_t* p) { std::free(p); });
  size_ = n;
  all_.erase(std::remove_if(all_.begin(), all_.end(), [](auto& e) { return e.first.expired(); }), all_.end());
  all_.emplace_back(cur_, n);
  return cur_;
}

std::shared_ptr<uint8_t> ArenaPool::current() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cur_;
}

size_t ArenaPool::current_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return size_;
}

size_t ArenaPool::live_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t t = 0;
  for (auto& e : all_)
    if (!e.first.expired()) t += e.second;
  return t;
}

Plan::Plan(std::shared_ptr<Graph> graph, std::shared_ptr<ThreadPool> pool, std::shared_ptr<Backend> backend,
           std::shared_ptr<ArenaPool> arenas)
    : graph_(std::move(graph)), pool_(std::move(pool)), backend_(std::move(backend)) {
  auto& nodes = graph_->nodes();
  const int n = (int)nodes.size();
  if (graph_->outputs().empty()) throw std::invalid_argument("[plan] graph has no outputs");
  if (backend_) {
    dev_ = backend_->compile(*graph_, pool_);
    for (auto& i : graph_->inputs()) in_[i.first] = i.second;
    for (auto& o : graph_->outputs()) out_[o.first] = o.second;
    return;
  }

  const Liveness lv = liveness(*graph_);
  const std::vector<int>& root = lv.root;
  const std::vector<char>& needed = lv.needed;
  const std::vector<int>& last_use = lv.last_use;

  // Inputs get their own persistent allocations; intermediates share the arena.
  std::vector<size_t> offset(n, 0);
  std::vector<std::vector<int>> frees_at(n + 1);
  arena::Allocator arena;
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
  if (arenas) {
    shared_arena_ = arenas->acquire(stats_.arena_bytes);
    arena_ = shared_arena_.get();
    arenas_ = std::move(arenas);
  } else {
    arena_ = alloc_aligned(stats_.arena_bytes);
  }

  // Resolve data pointers in order (views follow their source).
  const int nth = pool_ ? pool_->size() : 1;
  std::vector<size_t> node_work;
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
      node_work.push_back(align_up(cpu_work_size(nd, srcs, nth)));
    }
  }
  // Matmuls of one activation tensor that follow each other (q / k / v, gate / up) run as one
  // kernel: the activation rows are quantized once and there is one barrier instead of one per
  // matmul. Outputs are computed exactly as by separate matmuls. Nothing runs between them, so
  // their outputs' arena blocks are free when the first one runs (their only live source is the
  // shared activation tensor, which every one of them reads).
  {
    std::vector<int> ex;
    std::vector<size_t> nw;
    const Node* as[kMaxSrc];
    const Node* bs[kMaxSrc];
    for (size_t k = 0; k < exec_.size();) {
      const Node& a = nodes[exec_[k]];
      for (int s = 0; s < a.n_src; ++s) as[s] = &nodes[a.src[s]];
      std::vector<int> run{exec_[k]};
      size_t e = k + 1;
      for (; e < exec_.size() && a.op == Op::matmul && run.size() < (size_t)kMaxMulti; ++e) {
        const Node& b = nodes[exec_[e]];
        for (int s = 0; s < b.n_src; ++s) bs[s] = &nodes[b.src[s]];
        if (!cpu_matmul_fusable(a, as, b, bs)) break;
        run.push_back(exec_[e]);
      }
      ex.push_back(exec_[k]);
      nw.push_back(node_work[k]);
      multi_.push_back(run.size() > 1 ? run : std::vector<int>{});
      k = e;
    }
    exec_.swap(ex);
    node_work.swap(nw);
  }
  stats_.n_kernels = (int)exec_.size();

  // Groups: runs of consecutive nodes that may execute concurrently, so threads only wait for
  // each other at the end of a group. A node joins the current group when it and the group's
  // nodes are op_shareable and it neither reads memory a group node writes nor writes memory a
  // group node reads or writes (whole allocations: the arena block, input or external buffer
  // behind each tensor). Each node of a group gets its own part of the work buffer.
  const size_t n_exec = exec_.size();
  std::vector<uint32_t> group_end(n_exec, 0);
  std::vector<uint64_t> wofs(n_exec, 0);
  std::vector<uint8_t> shareable(n_exec, 0);
  struct Range { uintptr_t lo, hi; };
  auto range = [&](int id) -> Range {
    const Node& r = nodes[root[id]];
    const uintptr_t lo = (uintptr_t)r.data;
    if (!lo) return Range{0, UINTPTR_MAX};  // unknown: overlaps everything
    return Range{lo, lo + std::max<size_t>(span_bytes(r.dtype, r.shape), 1)};
  };
  auto overlap = [](const Range& a, const Range& b) { return a.lo < b.hi && b.lo < a.hi; };
  // The memory exec entry k reads and writes (its output, and sources it updates in place: the
  // recurrent state planes of ssm_conv and gated_delta_net).
  auto add_ranges = [&](size_t k, std::vector<Range>& rd, std::vector<Range>& wr) {
    for (int id : multi_[k].empty() ? std::vector<int>{exec_[k]} : multi_[k]) {
      wr.push_back(range(id));
      const Node& mn = nodes[id];
      for (int s = 0; s < mn.n_src; ++s) (op_writes_src(mn.op, s) ? wr : rd).push_back(range(mn.src[s]));
    }
  };
  // Whether exec entry k may run alongside (or before) nodes that read rd and write wr: it writes
  // nothing they read or write and reads nothing they write.
  std::vector<Range> krd, kwr;
  auto independent = [&](size_t k, const std::vector<Range>& rd, const std::vector<Range>& wr) {
    krd.clear();
    kwr.clear();
    add_ranges(k, krd, kwr);
    for (const Range& w : kwr) {
      for (const Range& g : wr) if (overlap(g, w)) return false;
      for (const Range& g : rd) if (overlap(g, w)) return false;
    }
    for (const Range& r : krd)
      for (const Range& g : wr) if (overlap(g, r)) return false;
    return true;
  };
  for (size_t k = 0; k < n_exec; ++k) {
    const Node& nd = nodes[exec_[k]];
    const Node* srcs[kMaxSrc];
    for (int s = 0; s < nd.n_src; ++s) srcs[s] = &nodes[nd.src[s]];
    shareable[k] = nth > 1 && op_shareable(nd, srcs, nth);
  }
  // Hoisting: a decode graph is mostly a chain, but beside it run short independent branches
  // (a layer's gate / decay terms beside its conv, a shared expert beside the routed ones). A
  // group takes, besides the nodes that follow it, shareable nodes up to kLookahead entries
  // further on that depend on none of the nodes they move ahead of (no memory written by one is
  // read or written by the other: whole allocations, the arena blocks included, so reusing a
  // block is a dependency too). Each such node runs earlier; the order of dependent nodes, and
  // so every result, stays as it was.
  if (nth > 1 && n_exec > 1) {
    constexpr size_t kLookahead = 12;
    std::vector<size_t> order;
    order.reserve(n_exec);
    std::vector<uint8_t> placed(n_exec, 0);
    std::vector<Range> rd, wr, srd, swr;  // the group's reads / writes, the skipped nodes' ones
    size_t first = 0;                     // the first entry not placed yet
    while (first < n_exec) {
      const size_t g = first;
      placed[g] = 1;
      order.push_back(g);
      rd.clear();
      wr.clear();
      srd.clear();
      swr.clear();
      add_ranges(g, rd, wr);
      size_t seen = 0;
      for (size_t j = g + 1; j < n_exec && seen < kLookahead; ++j) {
        if (placed[j]) continue;
        ++seen;
        if (shareable[g] && shareable[j] && independent(j, rd, wr) && independent(j, srd, swr)) {
          placed[j] = 1;
          order.push_back(j);
          add_ranges(j, rd, wr);
        } else {
          add_ranges(j, srd, swr);
        }
      }
      while (first < n_exec && placed[first]) ++first;
    }
    std::vector<int> ex(n_exec);
    std::vector<size_t> nw(n_exec);
    std::vector<std::vector<int>> mu(n_exec);
    std::vector<uint8_t> sh(n_exec);
    for (size_t i = 0; i < n_exec; ++i) {
      ex[i] = exec_[order[i]];
      nw[i] = node_work[order[i]];
      mu[i] = std::move(multi_[order[i]]);
      sh[i] = shareable[order[i]];
    }
    exec_.swap(ex);
    node_work.swap(nw);
    multi_.swap(mu);
    shareable.swap(sh);
  }
  std::vector<Range> rd, wr;  // reads / writes of the current group
  size_t g0 = 0, work = 0, gwork = 0;
  for (size_t k = 0; k < n_exec; ++k) {
    bool join = k > g0 && shareable[k] && shareable[g0] && independent(k, rd, wr);
    if (!join && k > 0) {
      group_end[g0] = (uint32_t)k;
      g0 = k;
      rd.clear();
      wr.clear();
      gwork = 0;
    }
    wofs[k] = gwork;
    gwork += node_work[k];
    work = std::max(work, gwork);
    add_ranges(k, rd, wr);
  }
  if (n_exec) group_end[g0] = (uint32_t)n_exec;

  work_size_ = work;
  stats_.work_bytes = work;
  work_ = alloc_aligned(align_up(work) + sched_bytes(n_exec, nth));
  owned_.push_back(work_);
  const Sched sc = sched_at(work_ + align_up(work), n_exec, nth);
  std::copy(group_end.begin(), group_end.end(), sc.group_end);
  std::copy(wofs.begin(), wofs.end(), sc.wofs);
  std::copy(shareable.begin(), shareable.end(), sc.shareable);
  for (auto& o : graph_->outputs()) out_[o.first] = o.second;
}

Plan::~Plan() {
  if (!shared_arena_) std::free(arena_);
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


// Nodes run in groups (see the constructor); a group starts once every share (ith = 0..nth-1) of
// every node of the previous group is done, so threads wait for each other only between groups.
// The share of each node a thread runs is fixed by ith as before, but for kernels without
// internal barriers (op_shareable) a thread that is done with its own shares of a group also
// runs the shares no other thread has started yet (claimed atomically; each runs exactly once).
// So when a thread is descheduled (other processes compete for the cores) or slow to wake, the
// others carry on instead of waiting for it. Results do not change: a share computes the same
// values whichever thread runs it.
//
// A kernel may throw (e.g. an index out of range found in the data): the first exception is
// kept and rethrown here once every thread has stopped. Threads stop together after the group
// of the node that failed is done (fail_at names the node, so a thread that already started the
// next group cannot make the others stop early). A kernel with internal barriers must throw on
// all threads or none, before its first barrier.
void Plan::rebase(std::shared_ptr<uint8_t> to) {
  uint8_t* const old = arena_;
  const uintptr_t lo = (uintptr_t)old, hi = lo + stats_.arena_bytes;
  for (Node& nd : graph_->nodes())
    if (nd.kind == NodeKind::computed && nd.data && (uintptr_t)nd.data >= lo && (uintptr_t)nd.data < std::max(hi, lo + 1))
      nd.data = to.get() + (nd.data - old);
  arena_ = to.get();
  shared_arena_ = std::move(to);
}

void Plan::run() {
  if (dev_) {
    dev_->run();
    return;
  }
  if (arenas_) {  // the pool grew since this plan last ran: move to its current buffer
    std::shared_ptr<uint8_t> cur = arenas_->current();
    if (cur != shared_arena_) rebase(std::move(cur));
  }
  auto& nodes = graph_->nodes();
  const CpuIsa isa = cpu_isa();
  const int nth = pool_ ? pool_->size() : 1;
  const size_t n_exec = exec_.size();
  const Sched sc = sched_at(work_ + align_up(work_size_), n_exec, nth);
  if (nth > 1) {
    for (size_t i = 0; i < sc.stride * (size_t)nth; ++i) sc.claimed[i].store(0, std::memory_order_relaxed);
    for (size_t i = 0; i < n_exec * sc.rstride; ++i) sc.ranges[i].store(0, std::memory_order_relaxed);
  }
  std::atomic<size_t> fail_at{SIZE_MAX};
  std::exception_ptr err;
  std::mutex err_mu;
  std::atomic<uint32_t> done{0};  // shares finished, all nodes so far
  if (g_profile.detail && nth > 1 && group_ops_.empty()) {
    group_ops_.resize(n_exec);
    for (size_t k0 = 0; k0 < n_exec; k0 = sc.group_end[k0])
      for (size_t k = k0; k < sc.group_end[k0]; ++k) {
        if (k > k0) group_ops_[k0] += ' ';
        group_ops_[k0] += op_name(nodes[exec_[k]].op);
        if (!multi_[k].empty()) group_ops_[k0] += '*';
      }
  }
  static std::atomic<uint64_t> g_runs{0};
  const uint64_t run_id = g_runs.fetch_add(1, std::memory_order_relaxed) + 1;
  auto body = [&](int ith) {
    ComputeParams p;
    p.ith = ith;
    p.nth = nth;
    p.pool = pool_.get();
    p.isa = isa;
    p.run_id = run_id;
    const Node* srcs[kMaxSrc];
    auto share = [&](size_t k, int s) {
      Node& nd = nodes[exec_[k]];
      for (int i = 0; i < nd.n_src; ++i) srcs[i] = &nodes[nd.src[i]];
      p.ith = s;
      p.wdata = work_ + sc.wofs[k];
      p.wsize = work_size_ - sc.wofs[k];
      p.ranges = nth > 1 ? sc.ranges + k * sc.rstride : nullptr;
      const uint64_t t0 = g_profile.on ? OpProfile::now() : 0;
      try {
        if (!multi_[k].empty()) {  // fused matmuls (see the constructor)
          const std::vector<int>& mem = multi_[k];
          Node* dsts[kMaxMulti];
          const Node* ws[kMaxMulti];
          for (size_t i = 0; i < mem.size(); ++i) {
            dsts[i] = &nodes[mem[i]];
            ws[i] = &nodes[nodes[mem[i]].src[1]];
          }
          cpu_matmul_multi(p, dsts, ws, (int)mem.size(), nodes[nd.src[0]]);
        } else switch (nd.op) {
#define X(name, n_src, is_view) case Op::name: if (!is_view) cpu_##name(p, nd, srcs); break;
#include "pyfast/ops.def"
#undef X
          default: break;
        }
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu);
        if (!err) err = std::current_exception();
        if (k < fail_at.load()) fail_at.store(k);
      }
      if (g_profile.on) {
        const uint64_t t = OpProfile::now() - t0;
        g_profile.add((int)nd.op, t);
        if (g_profile.detail && nd.op == Op::matmul) {
          const Node* ws[kMaxMulti];
          int n_w = 0;
          if (!multi_[k].empty())
            for (int m : multi_[k]) ws[n_w++] = &nodes[nodes[m].src[1]];
          else
            ws[n_w++] = &nodes[nd.src[1]];
          g_profile.add_matmul(nodes[nd.src[0]], ws, n_w, s == 0, t);
        } else if (g_profile.detail && nd.op == Op::matmul_id) {
          g_profile.add_matmul_id(nodes[nd.src[0]], nodes[nd.src[1]], nodes[nd.src[2]], s == 0, t);
        }
      }
      p.ith = ith;
    };
    for (size_t k0 = 0; k0 < n_exec;) {
      const size_t k1 = sc.group_end[k0];
      if (nth == 1) {
        for (size_t k = k0; k < k1; ++k) share(k, 0);
      } else {
        const uint32_t target = (uint32_t)(k1 * (size_t)nth);
        auto finished = [&] {
          if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == target) pool_->notify(done);
        };
        // Own shares first, then (shareable nodes) the shares nobody has started yet.
        for (size_t k = k0; k < k1; ++k) {
          std::atomic<uint8_t>& cl = sc.claimed[(size_t)ith * sc.stride + k];
          if (sc.shareable[k] && (cl.load(std::memory_order_relaxed) || cl.exchange(1, std::memory_order_acq_rel)))
            continue;
          share(k, ith);
          finished();
        }
        for (int q = 1; q < nth; ++q) {
          const int s = (ith + q) % nth;
          for (size_t k = k0; k < k1; ++k) {
            if (!sc.shareable[k]) continue;
            if ((int32_t)(done.load(std::memory_order_acquire) - target) >= 0) break;
            std::atomic<uint8_t>& cl = sc.claimed[(size_t)s * sc.stride + k];
            if (cl.load(std::memory_order_relaxed) || cl.exchange(1, std::memory_order_acq_rel)) continue;
            share(k, s);
            finished();
          }
        }
        if (g_profile.on) {
          const uint64_t t0 = OpProfile::now();
          pool_->wait_until(done, target);
          const uint64_t t = OpProfile::now() - t0;
          g_profile.add((int)Op::count, t);
          if (g_profile.detail) g_profile.add_wait(group_ops_[k0], t);
        } else {
          pool_->wait_until(done, target);
        }
      }
      if (fail_at.load() < k1) break;
      k0 = k1;
    }
  };
  if (pool_) pool_->run(body);
  else body(0);
  if (err) std::rethrow_exception(err);
}

}  // namespace pyfast
