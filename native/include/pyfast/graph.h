// The graph builder: records nodes and validates shapes and dtypes; it computes nothing.
// A bad argument throws std::invalid_argument("[op] ..."), which the binding turns into
// a Python ValueError.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "pyfast/ops.h"
#include "pyfast/tensor.h"

namespace pyfast {

constexpr int kMaxSrc = 8;

enum class NodeKind : int32_t {
  input,     // filled by the caller before each run (owned by the plan)
  external,  // memory owned by someone else (weights, KV cache); `data` set at record time
  computed,  // produced by an op; memory from the plan's arena (or aliasing a source for views)
};

struct OpParams {
  int32_t i[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
};

struct Node {
  int id = -1;
  Op op = Op::none;
  NodeKind kind = NodeKind::computed;
  DType dtype = DType::F32;
  Shape shape;
  int src[kMaxSrc] = {-1, -1, -1, -1, -1, -1, -1, -1};
  int n_src = 0;
  OpParams params;
  std::string name;
  // For view ops: the node whose memory this one aliases and the byte offset into it.
  int view_src = -1;
  int64_t view_offset = 0;
  // Resolved at plan time (computed/input) or record time (external).
  uint8_t* data = nullptr;
  // External quantized weight stored in the packed x16 layout (cpu/quant/quant.h); only matmul
  // (as the weight) and get_rows (as the table) read such a node.
  bool packed = false;
};

class Graph {
 public:
  Graph() = default;

  // Leaves.
  int input(const std::string& name, DType t, const std::vector<int64_t>& dims);
  int external(const std::string& name, DType t, const std::vector<int64_t>& dims, void* data,
               const std::vector<int64_t>& strides = {}, bool packed = false);

  // Ops (each returns the new node id).
  int get_rows(int table, int ids);
  int matmul(int x, int w);
  int add(int a, int b);
  int mul(int a, int b);
  int scale(int a, float s);
  int rms_norm(int a, float eps);
  // freq_factors (-1: none) divides each pair's angle; ext_factor / attn_factor / corr_low /
  // corr_high are YaRN's (ext_factor 0, attn_factor 1: plain rope)
  int rope(int x, int pos, int n_dims, int mode, float freq_base, float freq_scale, int freq_factors = -1,
           float ext_factor = 0.0f, float attn_factor = 1.0f, float corr_low = 0.0f, float corr_high = 0.0f);
  int softmax(int a, int mask, float scale);  // mask may be -1
  int attention(int q, int k, int v, int mask, int order, float scale);  // order may be -1
  int silu(int a);
  int swiglu(int gate, int up);
  int set_rows(int dst, int src, int idx);
  int cpy(int a, DType t);
  int argmax(int a);
  // Activations, reductions and routing (hybrid / MoE models).
  int sigmoid(int a);
  int softplus(int a);
  int relu(int a);
  int gelu(int a);
  int tanh(int a);
  int l2_norm(int a, float eps);
  int concat(int a, int b, int axis);
  int sum(int a, int axis);
  int topk(int a, int k);
  int topk_mask(int a, int k);
  int gather(int a, int ids);
  int matmul_id(int x, int w, int ids);
  // Recurrent ops. `seqs` is [n_seg, 4] i32 rows (t0, n_tokens, slot, src_plane): tokens
  // [t0, t0+n) belong to state slot `slot` and start from plane `src_plane`; the op writes
  // snapshot plane i = the state i tokens before the segment's end, for i < min(n, P).
  int ssm_conv(int x, int w, int state, int seqs);
  // broadcast: 0 = tiled (value head j uses key head j % Hk), 1 = interleaved (j / (Hv/Hk)).
  // chunk_min: segments with at least this many tokens use the chunked form (0 = never).
  int gated_delta_net(int q, int k, int v, int g, int beta, int state, int seqs, float scale, int broadcast,
                      int chunk_min);
  // Tensor parallelism: the sum of a over the ranks of communicator comm_id (comm.h), as f32;
  // root_only: only rank 0 needs it (the other ranks' output is unspecified: zeros over MPI).
  int allreduce(int a, int comm_id, bool root_only = false);
  int reshape(int a, const std::vector<int64_t>& dims);
  int view(int a, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides,
           int64_t offset);
  int permute(int a, const std::vector<int>& axes);

  void set_name(int id, const std::string& name) { at(id).name = name; }
  void mark_output(int id, const std::string& name);

  const Node& at(int id) const;
  Node& at(int id);
  int size() const { return (int)nodes_.size(); }
  const std::vector<Node>& nodes() const { return nodes_; }
  std::vector<Node>& nodes() { return nodes_; }
  const std::vector<std::pair<std::string, int>>& outputs() const { return outputs_; }
  const std::vector<std::pair<std::string, int>>& inputs() const { return inputs_; }

 private:
  int push(Node n);
  std::vector<Node> nodes_;
  std::vector<std::pair<std::string, int>> inputs_;
  std::vector<std::pair<std::string, int>> outputs_;
};

}  // namespace pyfast
