// A plan: a graph compiled once (order, arena by liveness, work buffers) and replayed with new
// input data. Decoding reuses plans; it never rebuilds a graph per token.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

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

class Plan {
 public:
  Plan(std::shared_ptr<Graph> graph, std::shared_ptr<ThreadPool> pool);
  ~Plan();

  Node& input(const std::string& name);
  const Node& output(const std::string& name) const;
  void run();
  const PlanStats& stats() const { return stats_; }
  const Graph& graph() const { return *graph_; }

 private:
  std::shared_ptr<Graph> graph_;
  std::shared_ptr<ThreadPool> pool_;
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
