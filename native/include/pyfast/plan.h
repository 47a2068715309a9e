// A plan: a graph compiled once (order, arena by liveness, work buffers) and replayed with new
// input data. Decoding reuses plans; it never rebuilds a graph per token.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "pyfast/backend.h"
#include "pyfast/graph.h"
#include "pyfast/threadpool.h"

namespace pyfast {

struct PlanStats {
  size_t arena_bytes = 0;
  size_t input_bytes = 0;
  size_t work_bytes = 0;
  int n_nodes = 0;
  int n_kernels = 0;
};

// Which nodes a graph's outputs need, the memory root of each node (views and in-place ops alias
// their source's memory) and the last node reading each root (outputs: n_nodes).
struct Liveness {
  std::vector<int> root, last_use;
  std::vector<char> needed;
};
Liveness liveness(const Graph& g);

// Arena memory shared by the plans of one context. Its plans run one at a time and a plan's
// outputs are read before the next one runs, so they can all place their intermediates in one
// buffer as large as the largest plan's, instead of one buffer each (a server caches dozens of
// plans). A plan that needs more than the current buffer gets a larger one, which becomes the
// current; plans made earlier move to it when they next run (Plan::run), so the old buffer is
// freed once no plan holds it. (Output views of a plan are valid until the next run of any plan
// of the pool, as the arena's contents always were.)
class ArenaPool {
 public:
  std::shared_ptr<uint8_t> acquire(size_t nbytes);
  std::shared_ptr<uint8_t> current() const;
  size_t current_bytes() const;
  size_t live_bytes() const;  // every buffer some plan still holds

 private:
  mutable std::mutex mu_;
  std::shared_ptr<uint8_t> cur_;
  size_t size_ = 0;
  std::vector<std::pair<std::weak_ptr<uint8_t>, size_t>> all_;
};

class Plan {
 public:
  // backend: null for the CPU; otherwise the graph is compiled for that device (DevicePlan).
  // arenas: share intermediate memory with the other plans of a context (CPU plans only).
  Plan(std::shared_ptr<Graph> graph, std::shared_ptr<ThreadPool> pool, std::shared_ptr<Backend> backend = nullptr,
       std::shared_ptr<ArenaPool> arenas = nullptr);
  ~Plan();

  Node& input(const std::string& name);
  const Node& output(const std::string& name) const;
  void run();
  const PlanStats& stats() const { return stats_; }
  const Graph& graph() const { return *graph_; }
  const DevicePlan* device_plan() const { return dev_.get(); }

 private:
  std::shared_ptr<Graph> graph_;
  std::shared_ptr<ThreadPool> pool_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<DevicePlan> dev_;  // set when compiled for a device other than the CPU
  std::vector<int> exec_;  // node ids with a kernel, in order
  std::vector<std::vector<int>> multi_;  // per exec_ entry: the matmuls it runs as one (or empty)
  std::vector<std::string> group_ops_;    // PYFAST_PROFILE=2: per group start, its ops (wait profile)
  static constexpr int kMaxMulti = 8;
  uint8_t* arena_ = nullptr;
  std::shared_ptr<uint8_t> shared_arena_;  // arena_ from an ArenaPool (not freed by the plan)
  std::shared_ptr<ArenaPool> arenas_;
  void rebase(std::shared_ptr<uint8_t> to);  // move every node in the arena to another buffer
  uint8_t* work_ = nullptr;
  size_t work_size_ = 0;
  std::vector<uint8_t*> owned_;
  std::unordered_map<std::string, int> in_, out_;
  PlanStats stats_;
};

}  // namespace pyfast
