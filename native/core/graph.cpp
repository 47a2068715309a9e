// Op constructors: each records one node after validating its arguments. Nothing is computed
// here; errors are std::invalid_argument("[op] ...") so Python sees a ValueError naming the op.
#include "pyfast/graph.h"
#include "pyfast/comm.h"

#include "cpu/quant/quant.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace pyfast {

namespace {

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

std::string dims_str(const std::vector<int64_t>& d) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

void need_dtype(const char* op, const Node& n, DType t, const char* what) {
  if (n.dtype != t)
    fail(op, std::string(what) + " must be " + dtype_name(t) + ", got " + dtype_name(n.dtype));
}

void need_inner_contiguous(const char* op, const Node& n, const char* what) {
  if (dtype_block_size(n.dtype) == 1 && n.shape.dims[n.shape.ndim - 1] > 1 &&
      n.shape.strides[n.shape.ndim - 1] != (int64_t)dtype_type_size(n.dtype))
    fail(op, std::string(what) + " must be contiguous in its innermost dim");
}

std::vector<int64_t> dims_of(const Node& n) {
  return std::vector<int64_t>(n.shape.dims.begin(), n.shape.dims.begin() + n.shape.ndim);
}

// b broadcasts to a: right-aligned, each of b's dims equals a's or is 1.
bool broadcastable(const Shape& b, const Shape& a) {
  if (b.ndim > a.ndim) return false;
  for (int i = 0; i < b.ndim; ++i) {
    const int64_t db = b.dims[b.ndim - 1 - i], da = a.dims[a.ndim - 1 - i];
    if (db != da && db != 1) return false;
  }
  return true;
}

}  // namespace

const Node& Graph::at(int id) const {
  if (id < 0 || id >= (int)nodes_.size()) throw std::invalid_argument("invalid tensor id " + std::to_string(id));
  return nodes_[id];
}
Node& Graph::at(int id) {
  if (id < 0 || id >= (int)nodes_.size()) throw std::invalid_argument("invalid tensor id " + std::to_string(id));
  return nodes_[id];
}

int Graph::push(Node n) {
  for (int i = 0; i < n.n_src; ++i)  // a packed weight is only read where its layout is known
    if (n.src[i] >= 0 && n.src[i] < (int)nodes_.size() && nodes_[n.src[i]].packed &&
        !(((n.op == Op::matmul || n.op == Op::matmul_id) && i == 1) || (n.op == Op::get_rows && i == 0)))
      fail(op_name(n.op), "'" + nodes_[n.src[i]].name + "' is a packed weight: only matmul / matmul_id (as the "
                          "weight) and get_rows (as the table) read it");
  n.id = (int)nodes_.size();
  nodes_.push_back(std::move(n));
  return nodes_.back().id;
}

static Node make_node(Op op, DType t, const Shape& s, std::initializer_list<int> srcs) {
  Node n;
  n.op = op;
  n.kind = NodeKind::computed;
  n.dtype = t;
  n.shape = s;
  for (int id : srcs) n.src[n.n_src++] = id;
  return n;
}

static Shape shape_or_fail(const char* op, DType t, const std::vector<int64_t>& dims) {
  try {
    return make_shape(t, dims);
  } catch (const std::invalid_argument& e) {
    fail(op, std::string(e.what()) + " (shape " + dims_str(dims) + ")");
  }
}

int Graph::input(const std::string& name, DType t, const std::vector<int64_t>& dims) {
  if (!dtype_info(t).supported) fail("input", std::string("unsupported dtype ") + dtype_name(t));
  for (auto& kv : inputs_)
    if (kv.first == name) fail("input", "duplicate input name '" + name + "'");
  Node n = make_node(Op::none, t, shape_or_fail("input", t, dims), {});
  n.kind = NodeKind::input;
  n.name = name;
  int id = push(std::move(n));
  inputs_.emplace_back(name, id);
  return id;
}

int Graph::external(const std::string& name, DType t, const std::vector<int64_t>& dims, void* data,
                    const std::vector<int64_t>& strides, bool packed) {
  if (!data) fail("external", "null data for '" + name + "'");
  Node n = make_node(Op::none, t, shape_or_fail("external", t, dims), {});
  if (!strides.empty()) {
    if ((int)strides.size() != n.shape.ndim) fail("external", "strides must match the number of dims");
    for (int i = 0; i < n.shape.ndim; ++i) n.shape.strides[i] = strides[i];
  }
  if (packed) {
    // 2-D [N, K], or 3-D [E, N, K] experts (each expert's N rows packed on their own, which is the
    // layout of the [E * N, K] matrix since N % 16 == 0)
    const int rows_dim = n.shape.ndim - 2;
    if (!packable(t) || (n.shape.ndim != 2 && n.shape.ndim != 3) || n.shape.dims[rows_dim] % 16 != 0 || !strides.empty())
      fail("external", "packed '" + name + "': needs a contiguous 2-D (or 3-D experts) Q4_0 / Q4_1 / Q8_0 / Q4_K / "
                       "Q5_K / Q6_K tensor with rows a multiple of 16, got " + dtype_name(t) + " " + n.shape.str());
    n.packed = true;
  }
  n.kind = NodeKind::external;
  n.name = name;
  n.data = static_cast<uint8_t*>(data);
  return push(std::move(n));
}

void Graph::mark_output(int id, const std::string& name) {
  at(id);
  for (auto& kv : outputs_)
    if (kv.first == name) fail("output", "duplicate output name '" + name + "'");
  outputs_.emplace_back(name, id);
}

int Graph::get_rows(int table, int ids) {
  const Node& t = at(table);
  const Node& i = at(ids);
  if (t.shape.ndim < 2) fail("get_rows", "table must have at least 2 dims, got " + t.shape.str());
  if (!dtype_info(t.dtype).supported || t.dtype == DType::I32) fail("get_rows", std::string("unsupported table dtype ") + dtype_name(t.dtype));
  need_dtype("get_rows", i, DType::I32, "ids");
  if (i.shape.ndim != 1) fail("get_rows", "ids must be 1-D, got " + i.shape.str());
  need_inner_contiguous("get_rows", t, "table");
  std::vector<int64_t> d = dims_of(t);
  d[0] = i.shape.dims[0];
  return push(make_node(Op::get_rows, DType::F32, make_shape(DType::F32, d), {table, ids}));
}

int Graph::matmul(int x, int w) {
  const Node& a = at(x);
  const Node& b = at(w);
  need_dtype("matmul", a, DType::F32, "x");
  need_inner_contiguous("matmul", a, "x");
  if (b.shape.ndim != 2) fail("matmul", "w must be 2-D [N, K], got " + b.shape.str());
  switch (b.dtype) {
    case DType::F32: case DType::F16: case DType::BF16:
    case DType::Q8_0: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: break;
    default: fail("matmul", std::string("unsupported weight dtype ") + dtype_name(b.dtype));
  }
  need_inner_contiguous("matmul", b, "w");
  const int64_t K = a.shape.dims[a.shape.ndim - 1];
  if (b.shape.dims[1] != K)
    fail("matmul", "inner dims differ: x " + a.shape.str() + " vs w " + b.shape.str());
  if (dtype_is_quantized(b.dtype) && K % dtype_block_size(b.dtype) != 0)
    fail("matmul", "K must be a multiple of the weight block size");
  std::vector<int64_t> d = dims_of(a);
  d.back() = b.shape.dims[0];
  return push(make_node(Op::matmul, DType::F32, make_shape(DType::F32, d), {x, w}));
}

static void check_binary(Graph& g, const char* name, int a, int b) {
  const Node& x = g.at(a);
  const Node& y = g.at(b);
  need_dtype(name, x, DType::F32, "a");
  need_dtype(name, y, DType::F32, "b");
  if (!broadcastable(y.shape, x.shape))
    fail(name, "b " + y.shape.str() + " does not broadcast to a " + x.shape.str());
}

int Graph::add(int a, int b) {
  check_binary(*this, "add", a, b);
  return push(make_node(Op::add, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a, b}));
}

int Graph::mul(int a, int b) {
  check_binary(*this, "mul", a, b);
  return push(make_node(Op::mul, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a, b}));
}

int Graph::scale(int a, float s) {
  need_dtype("scale", at(a), DType::F32, "a");
  Node n = make_node(Op::scale, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a});
  n.params.f[0] = s;
  return push(std::move(n));
}

int Graph::rms_norm(int a, float eps) {
  need_dtype("rms_norm", at(a), DType::F32, "a");
  if (!(eps >= 0.0f)) fail("rms_norm", "eps must be >= 0");
  Node n = make_node(Op::rms_norm, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a});
  n.params.f[0] = eps;
  return push(std::move(n));
}

int Graph::rope(int x, int pos, int n_dims, int mode, float freq_base, float freq_scale, int freq_factors,
                float ext_factor, float attn_factor, float corr_low, float corr_high) {
  const Node& a = at(x);
  const Node& p = at(pos);
  need_dtype("rope", a, DType::F32, "x");
  need_dtype("rope", p, DType::I32, "pos");
  if (a.shape.ndim != 3) fail("rope", "x must be [n_tokens, n_head, head_dim], got " + a.shape.str());
  if (p.shape.ndim != 1 || p.shape.dims[0] != a.shape.dims[0])
    fail("rope", "pos must be [n_tokens] = [" + std::to_string(a.shape.dims[0]) + "], got " + p.shape.str());
  if (n_dims <= 0 || n_dims % 2 != 0 || n_dims > a.shape.dims[2] || n_dims > 1024)
    fail("rope", "n_dims must be even and in [2, min(head_dim, 1024)], got " + std::to_string(n_dims));
  if (mode != ROPE_NORMAL && mode != ROPE_NEOX) fail("rope", "mode must be 0 (normal) or 2 (neox)");
  if (!(freq_base > 0.0f) || !(freq_scale > 0.0f)) fail("rope", "freq_base and freq_scale must be > 0");
  if (!std::isfinite(ext_factor) || !std::isfinite(attn_factor) || !std::isfinite(corr_low) || !std::isfinite(corr_high))
    fail("rope", "ext_factor, attn_factor, corr_low and corr_high must be finite");
  Node n = make_node(Op::rope, DType::F32, make_shape(DType::F32, dims_of(a)), {x, pos});
  if (freq_factors >= 0) {
    const Node& f = at(freq_factors);
    need_dtype("rope", f, DType::F32, "freq_factors");
    if (f.shape.ndim != 1 || f.shape.dims[0] != n_dims / 2)
      fail("rope", "freq_factors must be [n_dims / 2] = [" + std::to_string(n_dims / 2) + "], got " + f.shape.str());
    n.src[n.n_src++] = freq_factors;
  }
  n.params.i[0] = n_dims;
  n.params.i[1] = mode;
  n.params.f[0] = freq_base;
  n.params.f[1] = freq_scale;
  n.params.f[2] = ext_factor;
  n.params.f[3] = attn_factor;
  n.params.f[4] = corr_low;
  n.params.f[5] = corr_high;
  return push(std::move(n));
}

int Graph::softmax(int a, int mask, float scale) {
  const Node& x = at(a);
  need_dtype("softmax", x, DType::F32, "a");
  Node n = make_node(Op::softmax, DType::F32, make_shape(DType::F32, dims_of(x)), {a});
  if (mask >= 0) {
    const Node& m = at(mask);
    need_dtype("softmax", m, DType::F32, "mask");
    if (!broadcastable(m.shape, x.shape)) fail("softmax", "mask " + m.shape.str() + " does not broadcast to " + x.shape.str());
    n.src[n.n_src++] = mask;
  }
  n.params.f[0] = scale;
  return push(std::move(n));
}

int Graph::attention(int q, int k, int v, int mask, int order, float scale) {
  const Node& Q = at(q);
  const Node& K = at(k);
  const Node& V = at(v);
  need_dtype("attention", Q, DType::F32, "q");
  if (Q.shape.ndim != 3 || K.shape.ndim != 3 || V.shape.ndim != 3)
    fail("attention", "q, k, v must be 3-D ([T, H, D]); got " + Q.shape.str() + ", " + K.shape.str() + ", " + V.shape.str());
  for (const Node* t : {&K, &V})  // (a q8_0 tensor's head dim is a multiple of 32 by construction)
    if (t->dtype != DType::F32 && t->dtype != DType::F16 && t->dtype != DType::Q8_0)
      fail("attention", std::string("k/v must be f32, f16 or q8_0, got ") + dtype_name(t->dtype));
  need_inner_contiguous("attention", Q, "q");
  need_inner_contiguous("attention", K, "k");
  need_inner_contiguous("attention", V, "v");
  const int64_t T = Q.shape.dims[0], Hq = Q.shape.dims[1], D = Q.shape.dims[2];
  const int64_t n_kv = K.shape.dims[0], Hkv = K.shape.dims[1];
  if (K.shape.dims[2] != D) fail("attention", "k head dim differs from q's");
  if (V.shape.dims[0] != n_kv || V.shape.dims[1] != Hkv) fail("attention", "v must match k in [n_kv, n_head_kv]");
  if (Hkv <= 0 || Hq % Hkv != 0) fail("attention", "n_head (" + std::to_string(Hq) + ") must be a multiple of n_head_kv (" + std::to_string(Hkv) + ")");
  if (mask < 0) fail("attention", "a mask [n_tokens, n_kv] is required");
  const Node& M = at(mask);
  need_dtype("attention", M, DType::F32, "mask");
  if (M.shape.ndim != 2 || M.shape.dims[0] != T || M.shape.dims[1] != n_kv)
    fail("attention", "mask must be [" + std::to_string(T) + ", " + std::to_string(n_kv) + "], got " + M.shape.str());
  need_inner_contiguous("attention", M, "mask");
  Node n = make_node(Op::attention, DType::F32, make_shape(DType::F32, {T, Hq, V.shape.dims[2]}), {q, k, v, mask});
  if (order >= 0) {
    const Node& O = at(order);
    need_dtype("attention", O, DType::I32, "order");
    if (O.shape.ndim != 1 || O.shape.dims[0] != n_kv) fail("attention", "order must be [n_kv]");
    n.src[n.n_src++] = order;
  }
  n.params.f[0] = scale;
  return push(std::move(n));
}

int Graph::silu(int a) {
  need_dtype("silu", at(a), DType::F32, "a");
  return push(make_node(Op::silu, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a}));
}

int Graph::swiglu(int gate, int up) {
  const Node& g = at(gate);
  const Node& u = at(up);
  need_dtype("swiglu", g, DType::F32, "gate");
  need_dtype("swiglu", u, DType::F32, "up");
  if (dims_of(g) != dims_of(u)) fail("swiglu", "gate " + g.shape.str() + " and up " + u.shape.str() + " differ");
  return push(make_node(Op::swiglu, DType::F32, make_shape(DType::F32, dims_of(g)), {gate, up}));
}

int Graph::set_rows(int dst, int src, int idx) {
  const Node& d = at(dst);
  const Node& s = at(src);
  const Node& i = at(idx);
  need_dtype("set_rows", s, DType::F32, "src");
  need_dtype("set_rows", i, DType::I32, "idx");
  switch (d.dtype) {
    case DType::F32: case DType::F16: case DType::BF16: case DType::Q8_0: case DType::Q4_0: case DType::Q4_1:
    case DType::Q5_0: case DType::Q5_1: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: break;
    default: fail("set_rows", std::string("unsupported dst dtype ") + dtype_name(d.dtype));
  }
  if (i.shape.ndim != 1) fail("set_rows", "idx must be 1-D");
  if (s.shape.dims[0] != i.shape.dims[0]) fail("set_rows", "src rows (" + std::to_string(s.shape.dims[0]) + ") != idx length (" + std::to_string(i.shape.dims[0]) + ")");
  const int64_t row_dst = d.shape.numel() / d.shape.dims[0];
  const int64_t row_src = s.shape.numel() / s.shape.dims[0];
  if (row_dst != row_src) fail("set_rows", "row sizes differ: dst " + d.shape.str() + " vs src " + s.shape.str());
  // Rows of dst must be contiguous (one row = dims[1:]).
  Shape inner = d.shape;
  inner.ndim = d.shape.ndim - 1;
  for (int k = 0; k < inner.ndim; ++k) { inner.dims[k] = d.shape.dims[k + 1]; inner.strides[k] = d.shape.strides[k + 1]; }
  if (inner.ndim > 0 && !is_contiguous(d.dtype, inner)) fail("set_rows", "dst rows must be contiguous");
  if (dtype_is_quantized(d.dtype) && row_dst % dtype_block_size(d.dtype) != 0) fail("set_rows", "row size must be a multiple of the block size");
  Node n = make_node(Op::set_rows, d.dtype, d.shape, {dst, src, idx});
  n.view_src = dst;  // writes in place: the result aliases dst
  n.view_offset = 0;
  return push(std::move(n));
}

int Graph::cpy(int a, DType t) {
  const Node& x = at(a);
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16: break;
    case DType::Q8_0: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      if (x.shape.dims[x.shape.ndim - 1] % dtype_block_size(t))
        fail("cpy", std::string("innermost dim must be a multiple of ") + std::to_string(dtype_block_size(t)) +
                        " to quantize to " + dtype_name(t));
      break;
    default: fail("cpy", std::string("unsupported target dtype ") + dtype_name(t));
  }
  if (x.dtype != DType::F32 && x.dtype != DType::F16 && x.dtype != DType::BF16 && !dtype_is_quantized(x.dtype))
    fail("cpy", std::string("unsupported source dtype ") + dtype_name(x.dtype));
  if (dtype_is_quantized(x.dtype) && t != DType::F32) fail("cpy", "quantized sources convert to f32 only");
  return push(make_node(Op::cpy, t, shape_or_fail("cpy", t, dims_of(x)), {a}));
}

int Graph::argmax(int a) {
  const Node& x = at(a);
  need_dtype("argmax", x, DType::F32, "a");
  std::vector<int64_t> d = dims_of(x);
  d.pop_back();
  if (d.empty()) d.push_back(1);
  return push(make_node(Op::argmax, DType::I32, make_shape(DType::I32, d), {a}));
}

// ---- activations, reductions and routing ---------------------------------------------------

int Graph::sigmoid(int a) {
  need_dtype("sigmoid", at(a), DType::F32, "a");
  return push(make_node(Op::sigmoid, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a}));
}

int Graph::softplus(int a) {
  need_dtype("softplus", at(a), DType::F32, "a");
  return push(make_node(Op::softplus, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a}));
}

int Graph::relu(int a) {
  need_dtype("relu", at(a), DType::F32, "a");
  return push(make_node(Op::relu, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a}));
}

int Graph::gelu(int a) {
  need_dtype("gelu", at(a), DType::F32, "a");
  return push(make_node(Op::gelu, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a}));
}

int Graph::tanh(int a) {
  need_dtype("tanh", at(a), DType::F32, "a");
  return push(make_node(Op::tanh, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a}));
}

int Graph::l2_norm(int a, float eps) {
  need_dtype("l2_norm", at(a), DType::F32, "a");
  if (!(eps >= 0.0f)) fail("l2_norm", "eps must be >= 0");
  Node n = make_node(Op::l2_norm, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a});
  n.params.f[0] = eps;
  return push(std::move(n));
}

static int norm_axis(const char* op, int axis, int ndim) {
  const int ax = axis < 0 ? axis + ndim : axis;
  if (ax < 0 || ax >= ndim) fail(op, "axis " + std::to_string(axis) + " out of range for " + std::to_string(ndim) + " dims");
  return ax;
}

int Graph::concat(int a, int b, int axis) {
  const Node& x = at(a);
  const Node& y = at(b);
  need_dtype("concat", x, DType::F32, "a");
  need_dtype("concat", y, DType::F32, "b");
  if (x.shape.ndim != y.shape.ndim) fail("concat", "a " + x.shape.str() + " and b " + y.shape.str() + " differ in rank");
  const int ax = norm_axis("concat", axis, x.shape.ndim);
  std::vector<int64_t> d = dims_of(x);
  for (int i = 0; i < x.shape.ndim; ++i)
    if (i != ax && x.shape.dims[i] != y.shape.dims[i])
      fail("concat", "a " + x.shape.str() + " and b " + y.shape.str() + " differ outside axis " + std::to_string(ax));
  d[ax] += y.shape.dims[ax];
  Node n = make_node(Op::concat, DType::F32, make_shape(DType::F32, d), {a, b});
  n.params.i[0] = ax;
  return push(std::move(n));
}

int Graph::sum(int a, int axis) {
  const Node& x = at(a);
  need_dtype("sum", x, DType::F32, "a");
  const int ax = norm_axis("sum", axis, x.shape.ndim);
  std::vector<int64_t> d = dims_of(x);
  d.erase(d.begin() + ax);
  if (d.empty()) d.push_back(1);
  Node n = make_node(Op::sum, DType::F32, make_shape(DType::F32, d), {a});
  n.params.i[0] = ax;
  return push(std::move(n));
}

int Graph::topk(int a, int k) {
  const Node& x = at(a);
  need_dtype("topk", x, DType::F32, "a");
  const int64_t E = x.shape.dims[x.shape.ndim - 1];
  if (k < 1 || k > E) fail("topk", "k must be in [1, " + std::to_string(E) + "], got " + std::to_string(k));
  std::vector<int64_t> d = dims_of(x);
  d.back() = k;
  Node n = make_node(Op::topk, DType::I32, make_shape(DType::I32, d), {a});
  n.params.i[0] = k;
  return push(std::move(n));
}

int Graph::topk_mask(int a, int k) {
  const Node& x = at(a);
  need_dtype("topk_mask", x, DType::F32, "a");
  const int64_t E = x.shape.dims[x.shape.ndim - 1];
  if (k < 1 || k > E) fail("topk_mask", "k must be in [1, " + std::to_string(E) + "], got " + std::to_string(k));
  Node n = make_node(Op::topk_mask, DType::F32, make_shape(DType::F32, dims_of(x)), {a});
  n.params.i[0] = k;
  return push(std::move(n));
}

int Graph::gather(int a, int ids) {
  const Node& x = at(a);
  const Node& i = at(ids);
  need_dtype("gather", x, DType::F32, "a");
  need_dtype("gather", i, DType::I32, "ids");
  if (x.shape.ndim != i.shape.ndim) fail("gather", "a " + x.shape.str() + " and ids " + i.shape.str() + " differ in rank");
  for (int d = 0; d < x.shape.ndim - 1; ++d)
    if (x.shape.dims[d] != i.shape.dims[d]) fail("gather", "a " + x.shape.str() + " and ids " + i.shape.str() + " differ before the last dim");
  return push(make_node(Op::gather, DType::F32, make_shape(DType::F32, dims_of(i)), {a, ids}));
}

int Graph::matmul_id(int x, int w, int ids) {
  const Node& a = at(x);
  const Node& b = at(w);
  const Node& i = at(ids);
  need_dtype("matmul_id", a, DType::F32, "x");
  need_dtype("matmul_id", i, DType::I32, "ids");
  if (b.shape.ndim != 3) fail("matmul_id", "w must be [n_expert, N, K], got " + b.shape.str());
  switch (b.dtype) {  // the weight types matmul takes
    case DType::F32: case DType::F16: case DType::BF16:
    case DType::Q8_0: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: break;
    default: fail("matmul_id", std::string("unsupported weight dtype ") + dtype_name(b.dtype));
  }
  need_inner_contiguous("matmul_id", b, "w");
  if (i.shape.ndim != 2) fail("matmul_id", "ids must be [T, k], got " + i.shape.str());
  const int64_t T = i.shape.dims[0], k = i.shape.dims[1], N = b.shape.dims[1], K = b.shape.dims[2];
  const bool x2 = a.shape.ndim == 2 && a.shape.dims[0] == T && a.shape.dims[1] == K;
  const bool x3 = a.shape.ndim == 3 && a.shape.dims[0] == T && a.shape.dims[1] == k && a.shape.dims[2] == K;
  if (!x2 && !x3)
    fail("matmul_id", "x must be [T, K] or [T, k, K] = [" + std::to_string(T) + ", " + std::to_string(k) + ", " +
                          std::to_string(K) + "], got " + a.shape.str());
  need_inner_contiguous("matmul_id", a, "x");
  return push(make_node(Op::matmul_id, DType::F32, make_shape(DType::F32, {T, k, N}), {x, w, ids}));
}

// ---- recurrent ops ---------------------------------------------------------------------------

static void check_seqs(const char* op, const Node& s) {
  need_dtype(op, s, DType::I32, "seqs");
  if (s.shape.ndim != 2 || s.shape.dims[1] != 4) fail(op, "seqs must be [n_seg, 4] (t0, n, slot, src_plane), got " + s.shape.str());
  if (!is_contiguous(s.dtype, s.shape)) fail(op, "seqs must be contiguous");
}

int Graph::ssm_conv(int x, int w, int state, int seqs) {
  const Node& a = at(x);
  const Node& b = at(w);
  const Node& st = at(state);
  need_dtype("ssm_conv", a, DType::F32, "x");
  need_dtype("ssm_conv", b, DType::F32, "w");
  need_dtype("ssm_conv", st, DType::F32, "state");
  check_seqs("ssm_conv", at(seqs));
  if (a.shape.ndim != 2) fail("ssm_conv", "x must be [T, C], got " + a.shape.str());
  const int64_t T = a.shape.dims[0], C = a.shape.dims[1];
  if (b.shape.ndim != 2 || b.shape.dims[0] != C || b.shape.dims[1] < 1)
    fail("ssm_conv", "w must be [C, kernel] with C = " + std::to_string(C) + ", got " + b.shape.str());
  const int64_t Kc = b.shape.dims[1];
  if (st.shape.ndim != 4 || st.shape.dims[2] != Kc - 1 || st.shape.dims[3] != C)
    fail("ssm_conv", "state must be [planes, slots, " + std::to_string(Kc - 1) + ", " + std::to_string(C) + "], got " + st.shape.str());
  if (!is_contiguous(st.dtype, st.shape)) fail("ssm_conv", "state must be contiguous");
  need_inner_contiguous("ssm_conv", a, "x");
  return push(make_node(Op::ssm_conv, DType::F32, make_shape(DType::F32, {T, C}), {x, w, state, seqs}));
}

int Graph::gated_delta_net(int q, int k, int v, int g, int beta, int state, int seqs, float scale, int broadcast,
                           int chunk_min) {
  const char* op = "gated_delta_net";
  const Node& Q = at(q);
  const Node& K = at(k);
  const Node& V = at(v);
  const Node& G = at(g);
  const Node& B = at(beta);
  const Node& M = at(state);
  for (const Node* n : {&Q, &K, &V, &G, &B, &M}) need_dtype(op, *n, DType::F32, "q, k, v, g, beta and state");
  check_seqs(op, at(seqs));
  if (V.shape.ndim != 3) fail(op, "v must be [T, Hv, S], got " + V.shape.str());
  const int64_t T = V.shape.dims[0], Hv = V.shape.dims[1], S = V.shape.dims[2];
  if (Q.shape.ndim != 3 || Q.shape.dims[0] != T || Q.shape.dims[2] != S)
    fail(op, "q must be [T, Hk, S] with T = " + std::to_string(T) + ", S = " + std::to_string(S) + ", got " + Q.shape.str());
  const int64_t Hk = Q.shape.dims[1];
  if (dims_of(K) != dims_of(Q)) fail(op, "k " + K.shape.str() + " must match q " + Q.shape.str());
  if (Hk < 1 || Hv % Hk != 0) fail(op, "value heads (" + std::to_string(Hv) + ") must be a multiple of key heads (" + std::to_string(Hk) + ")");
  const bool gda = G.shape.ndim == 2 && G.shape.dims[0] == T && G.shape.dims[1] == Hv;
  const bool kda = G.shape.ndim == 3 && G.shape.dims[0] == T && G.shape.dims[1] == Hv && G.shape.dims[2] == S;
  if (!gda && !kda) fail(op, "g must be [T, Hv] (scalar gate) or [T, Hv, S] (per-key gate), got " + G.shape.str());
  if (B.shape.ndim != 2 || B.shape.dims[0] != T || B.shape.dims[1] != Hv) fail(op, "beta must be [T, Hv], got " + B.shape.str());
  // Tensors have at most 4 dims, so each head's S x S matrix (row i = key dim, column j = value
  // dim, row-major) is flattened: state[p, slot, h, i * S + j].
  if (M.shape.ndim != 4 || M.shape.dims[2] != Hv || M.shape.dims[3] != S * S)
    fail(op, "state must be [planes, slots, " + std::to_string(Hv) + ", " + std::to_string(S * S) + "] (S x S per head), got " +
                 M.shape.str());
  if (!is_contiguous(M.dtype, M.shape)) fail(op, "state must be contiguous");
  if (broadcast != 0 && broadcast != 1) fail(op, "broadcast must be 0 (tiled) or 1 (interleaved)");
  if (chunk_min < 0) fail(op, "chunk_min must be >= 0");
  for (const Node* n : {&Q, &K, &V, &G, &B}) need_inner_contiguous(op, *n, "q, k, v, g and beta");
  Node n = make_node(Op::gated_delta_net, DType::F32, make_shape(DType::F32, {T, Hv, S}), {q, k, v, g, beta, state, seqs});
  n.params.f[0] = scale > 0.0f ? scale : 1.0f / std::sqrt((float)S);
  n.params.i[0] = broadcast;
  n.params.i[1] = chunk_min;
  n.params.i[2] = kda ? 1 : 0;
  return push(std::move(n));
}

int Graph::allreduce(int a, int comm_id, bool root_only) {
  need_dtype("allreduce", at(a), DType::F32, "a");
  comm_get(comm_id);  // an unknown id fails here, not in the middle of a run
  Node n = make_node(Op::allreduce, DType::F32, make_shape(DType::F32, dims_of(at(a))), {a});
  n.params.i[0] = comm_id;
  n.params.i[1] = root_only ? 1 : 0;
  return push(std::move(n));
}

int Graph::reshape(int a, const std::vector<int64_t>& dims) {
  const Node& x = at(a);
  if (!is_contiguous(x.dtype, x.shape)) fail("reshape", "source must be contiguous (use cpy first)");
  Shape s = shape_or_fail("reshape", x.dtype, dims);
  if (s.numel() != x.shape.numel())
    fail("reshape", "element count differs: " + x.shape.str() + " -> " + dims_str(dims));
  Node n = make_node(Op::reshape, x.dtype, s, {a});
  n.view_src = a;
  return push(std::move(n));
}

int Graph::view(int a, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides, int64_t offset) {
  const Node& x = at(a);
  Shape s = shape_or_fail("view", x.dtype, dims);
  if (!strides.empty()) {
    if (strides.size() != dims.size()) fail("view", "strides must match the number of dims");
    for (size_t i = 0; i < dims.size(); ++i) {
      if (strides[i] < 0) fail("view", "negative strides are not supported");
      s.strides[i] = strides[i];
    }
    if (dtype_is_quantized(x.dtype)) s.strides[s.ndim - 1] = 0;
  }
  if (offset < 0) fail("view", "negative offset");
  if ((size_t)offset + span_bytes(x.dtype, s) > span_bytes(x.dtype, x.shape))
    fail("view", "view " + s.str() + " at offset " + std::to_string(offset) + " exceeds the source " + x.shape.str());
  Node n = make_node(Op::view, x.dtype, s, {a});
  n.view_src = a;
  n.view_offset = offset;
  return push(std::move(n));
}

int Graph::permute(int a, const std::vector<int>& axes) {
  const Node& x = at(a);
  if ((int)axes.size() != x.shape.ndim) fail("permute", "need one axis per dim");
  if (dtype_is_quantized(x.dtype)) fail("permute", "quantized tensors cannot be permuted");
  std::vector<bool> seen(axes.size(), false);
  Shape s = x.shape;
  for (size_t i = 0; i < axes.size(); ++i) {
    const int ax = axes[i];
    if (ax < 0 || ax >= x.shape.ndim || seen[ax]) fail("permute", "axes must be a permutation");
    seen[ax] = true;
    s.dims[i] = x.shape.dims[ax];
    s.strides[i] = x.shape.strides[ax];
  }
  Node n = make_node(Op::permute, x.dtype, s, {a});
  n.view_src = a;
  return push(std::move(n));
}

}  // namespace pyfast
