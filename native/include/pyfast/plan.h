// A plan: a graph compiled once (order, arena by liveness, work buffers) and replayed with new
// input data. Decoding reuses plans; it never rebuilds a graph per token.
#pragma once
#include <memory>
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

class Plan {
 public:
  // backend: null for the CPU; otherwise the graph is compiled for that device (DevicePlan).
  Plan(std::shared_ptr<Graph> graph, std::shared_ptr<ThreadPool> pool, std::shared_ptr<Backend> backend = nullptr);
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
  static constexpr int kMaxMulti = 8;
  uint8_t* arena_ = nullptr;
  uint8_t* work_ = nullptr;
  size_t work_size_ = 0;
  std::vector<uint8_t*> owned_;
  std::unordered_map<std::string, int> in_, out_;
  PlanStats stats_;
};

}  // namespace pyfast
