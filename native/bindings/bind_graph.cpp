// Graph builder, tensor handles and plans. Ops are methods of Graph that record a node and
// return its Tensor handle; Plan compiles a graph once and replays it.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>

#include "bindings/bindings.h"
#include "pyfast/plan.h"

namespace py = pybind11;
using namespace pyfast;

namespace pyfast_py {

namespace {

struct PyGraph {
  std::shared_ptr<Graph> g = std::make_shared<Graph>();
  std::vector<py::object> keep;  // buffers referenced by external tensors
  bool compiled = false;
};

struct Tensor {
  std::shared_ptr<PyGraph> owner;
  int id;
  const Node& node() const { return owner->g->at(id); }
};

int tid(const PyGraph& g, const Tensor& t) {
  if (t.owner.get() != &g) throw std::invalid_argument("tensor belongs to another graph");
  return t.id;
}

int opt_tid(const PyGraph& g, const py::object& o) {
  if (o.is_none()) return -1;
  return tid(g, o.cast<const Tensor&>());
}

py::tuple tuple_of(const std::array<int64_t, kMaxDims>& a, int n) {
  py::tuple t(n);
  for (int i = 0; i < n; ++i) t[i] = a[i];
  return t;
}

py::dtype np_dtype(DType t) {
  switch (t) {
    case DType::F32: return py::dtype::of<float>();
    case DType::I32: return py::dtype::of<int32_t>();
    case DType::F16: return py::dtype("float16");
    case DType::BF16: return py::dtype::of<uint16_t>();
    default: return py::dtype::of<uint8_t>();
  }
}

// numpy view (shape, strides) of a node's memory; quantized tensors are exposed as raw rows.
py::array node_array(const Node& n, py::handle base, bool copy) {
  std::vector<py::ssize_t> shape, strides;
  if (dtype_is_quantized(n.dtype)) {
    for (int i = 0; i < n.shape.ndim - 1; ++i) { shape.push_back(n.shape.dims[i]); strides.push_back(n.shape.strides[i]); }
    shape.push_back((py::ssize_t)dtype_row_size(n.dtype, n.shape.dims[n.shape.ndim - 1]));
    strides.push_back(1);
  } else {
    for (int i = 0; i < n.shape.ndim; ++i) { shape.push_back(n.shape.dims[i]); strides.push_back(n.shape.strides[i]); }
  }
  py::array view(np_dtype(n.dtype), shape, strides, n.data, base);
  if (copy) return py::array(view.attr("copy")());
  return view;
}

template <typename F>
Tensor rec(const std::shared_ptr<PyGraph>& g, F f) {
  if (g->compiled) throw std::invalid_argument("graph is already compiled into a plan; build a new graph");
  return Tensor{g, f(*g->g)};
}

}  // namespace

void bind_graph(py::module_& m) {
  py::class_<Tensor>(m, "Tensor", "Handle to a node of a Graph.")
      .def_property_readonly("id", [](const Tensor& t) { return t.id; })
      .def_property_readonly("shape", [](const Tensor& t) { return tuple_of(t.node().shape.dims, t.node().shape.ndim); })
      .def_property_readonly("strides", [](const Tensor& t) { return tuple_of(t.node().shape.strides, t.node().shape.ndim); })
      .def_property_readonly("dtype", [](const Tensor& t) { return t.node().dtype; })
      .def_property_readonly("op", [](const Tensor& t) { return std::string(op_name(t.node().op)); })
      .def_property("name", [](const Tensor& t) { return t.node().name; },
                    [](Tensor& t, const std::string& s) { t.owner->g->set_name(t.id, s); })
      .def("__repr__", [](const Tensor& t) {
        return "<Tensor " + std::to_string(t.id) + " " + op_name(t.node().op) + " " + dtype_name(t.node().dtype) + " " + t.node().shape.str() + ">";
      });

  using G = std::shared_ptr<PyGraph>;
  py::class_<PyGraph, G>(m, "Graph", "Records ops and validates shapes; compiles into a Plan.")
      .def(py::init<>())
      .def("__len__", [](const PyGraph& g) { return g.g->size(); })
      .def("input", [](G g, const std::string& name, DType t, std::vector<int64_t> shape) {
        return rec(g, [&](Graph& gr) { return gr.input(name, t, shape); });
      }, py::arg("name"), py::arg("dtype"), py::arg("shape"), "A tensor whose data the caller sets before each run.")
      .def("external", [](G g, const std::string& name, DType t, std::vector<int64_t> shape, py::buffer buf,
                          int64_t offset, std::optional<std::vector<int64_t>> strides, bool packed) {
        py::buffer_info bi = buf.request();
        const size_t total = (size_t)(bi.size * bi.itemsize);
        Shape s = make_shape(t, shape);
        if (strides) {
          if (strides->size() != shape.size()) throw std::invalid_argument("[external] strides must match shape");
          for (size_t i = 0; i < shape.size(); ++i) s.strides[i] = (*strides)[i];
        }
        if (offset < 0 || (size_t)offset + span_bytes(t, s) > total)
          throw std::invalid_argument("[external] '" + name + "': " + s.str() + " at offset " + std::to_string(offset) +
                                      " exceeds the buffer (" + std::to_string(total) + " bytes)");
        Tensor out = rec(g, [&](Graph& gr) {
          return gr.external(name, t, shape, static_cast<uint8_t*>(bi.ptr) + offset,
                             strides ? *strides : std::vector<int64_t>{}, packed);
        });
        g->keep.push_back(buf);
        return out;
      }, py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("buffer"), py::arg("offset") = 0,
         py::arg("strides") = py::none(), py::arg("packed") = false,
         "A tensor over memory owned elsewhere (weights, KV cache); the buffer is kept alive. packed: the "
         "bytes are a weight in the packed x16 layout (pack_x16), read only by matmul and get_rows.")
      .def("get_rows", [](G g, const Tensor& t, const Tensor& ids) { return rec(g, [&](Graph& gr) { return gr.get_rows(tid(*g, t), tid(*g, ids)); }); })
      .def("matmul", [](G g, const Tensor& x, const Tensor& w) { return rec(g, [&](Graph& gr) { return gr.matmul(tid(*g, x), tid(*g, w)); }); },
           "x[..., K] @ w[N, K].T -> [..., N]")
      .def("add", [](G g, const Tensor& a, const Tensor& b) { return rec(g, [&](Graph& gr) { return gr.add(tid(*g, a), tid(*g, b)); }); })
      .def("mul", [](G g, const Tensor& a, const Tensor& b) { return rec(g, [&](Graph& gr) { return gr.mul(tid(*g, a), tid(*g, b)); }); })
      .def("allreduce", [](G g, const Tensor& a, int comm, bool root_only) {
        return rec(g, [&](Graph& gr) { return gr.allreduce(tid(*g, a), comm, root_only); });
      }, py::arg("a"), py::arg("comm"), py::arg("root_only") = false,
           "The sum of a over the ranks of the communicator registered as `comm` (Communicator.id), f32; "
           "root_only: only rank 0 needs it (the others' output is unspecified: zeros over MPI).")
      .def("scale", [](G g, const Tensor& a, float s) { return rec(g, [&](Graph& gr) { return gr.scale(tid(*g, a), s); }); })
      .def("rms_norm", [](G g, const Tensor& a, float eps) { return rec(g, [&](Graph& gr) { return gr.rms_norm(tid(*g, a), eps); }); },
           py::arg("a"), py::arg("eps"))
      .def("rope", [](G g, const Tensor& x, const Tensor& pos, int n_dims, int mode, float base, float fscale,
                      py::object freq_factors, float ext_factor, float attn_factor, float corr_low, float corr_high) {
        return rec(g, [&](Graph& gr) {
          return gr.rope(tid(*g, x), tid(*g, pos), n_dims, mode, base, fscale, opt_tid(*g, freq_factors), ext_factor,
                         attn_factor, corr_low, corr_high);
        });
      }, py::arg("x"), py::arg("pos"), py::arg("n_dims"), py::arg("mode") = 0, py::arg("freq_base") = 10000.0f,
         py::arg("freq_scale") = 1.0f, py::arg("freq_factors") = py::none(), py::arg("ext_factor") = 0.0f,
         py::arg("attn_factor") = 1.0f, py::arg("corr_low") = 0.0f, py::arg("corr_high") = 0.0f,
         "Rotary embedding: angle_i = pos * freq_scale * freq_base^(-2i/n_dims) / freq_factors[i]; with "
         "ext_factor != 0, YaRN's ramp between corr_low and corr_high mixes in the unscaled angle and "
         "cos / sin are scaled by attn_factor * (1 + 0.1 ln(1 / freq_scale)) (attn_factor alone otherwise).")
      .def("softmax", [](G g, const Tensor& a, py::object mask, float scale) {
        return rec(g, [&](Graph& gr) { return gr.softmax(tid(*g, a), opt_tid(*g, mask), scale); });
      }, py::arg("a"), py::arg("mask") = py::none(), py::arg("scale") = 1.0f)
      .def("attention", [](G g, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, py::object order, float scale) {
        return rec(g, [&](Graph& gr) { return gr.attention(tid(*g, q), tid(*g, k), tid(*g, v), tid(*g, mask), opt_tid(*g, order), scale); });
      }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("order") = py::none(), py::arg("scale") = 1.0f)
      .def("silu", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.silu(tid(*g, a)); }); })
      .def("swiglu", [](G g, const Tensor& a, const Tensor& b) { return rec(g, [&](Graph& gr) { return gr.swiglu(tid(*g, a), tid(*g, b)); }); })
      .def("set_rows", [](G g, const Tensor& d, const Tensor& s, const Tensor& i) {
        return rec(g, [&](Graph& gr) { return gr.set_rows(tid(*g, d), tid(*g, s), tid(*g, i)); });
      }, py::arg("dst"), py::arg("src"), py::arg("idx"), "Write src rows into dst at idx; returns dst after the write.")
      .def("cpy", [](G g, const Tensor& a, DType t) { return rec(g, [&](Graph& gr) { return gr.cpy(tid(*g, a), t); }); },
           py::arg("a"), py::arg("dtype") = DType::F32)
      .def("argmax", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.argmax(tid(*g, a)); }); })
      .def("sigmoid", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.sigmoid(tid(*g, a)); }); })
      .def("softplus", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.softplus(tid(*g, a)); }); })
      .def("relu", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.relu(tid(*g, a)); }); },
           py::arg("a"), "max(a, 0) elementwise")
      .def("gelu", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.gelu(tid(*g, a)); }); },
           py::arg("a"), "GELU, tanh form (gelu_pytorch_tanh): 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))")
      .def("tanh", [](G g, const Tensor& a) { return rec(g, [&](Graph& gr) { return gr.tanh(tid(*g, a)); }); },
           py::arg("a"), "tanh(a) elementwise (logit soft-capping)")
      .def("l2_norm", [](G g, const Tensor& a, float eps) { return rec(g, [&](Graph& gr) { return gr.l2_norm(tid(*g, a), eps); }); },
           py::arg("a"), py::arg("eps") = 1e-6f, "a / sqrt(sum(a^2, -1) + eps)")
      .def("concat", [](G g, const Tensor& a, const Tensor& b, int axis) {
        return rec(g, [&](Graph& gr) { return gr.concat(tid(*g, a), tid(*g, b), axis); });
      }, py::arg("a"), py::arg("b"), py::arg("axis") = -1)
      .def("sum", [](G g, const Tensor& a, int axis) { return rec(g, [&](Graph& gr) { return gr.sum(tid(*g, a), axis); }); },
           py::arg("a"), py::arg("axis") = -1, "Sum over `axis`, which is removed.")
      .def("topk", [](G g, const Tensor& a, int k) { return rec(g, [&](Graph& gr) { return gr.topk(tid(*g, a), k); }); },
           py::arg("a"), py::arg("k"), "Indices (i32) of the k largest values along the last dim, largest first.")
      .def("topk_mask", [](G g, const Tensor& a, int k) { return rec(g, [&](Graph& gr) { return gr.topk_mask(tid(*g, a), k); }); },
           py::arg("a"), py::arg("k"),
           "An additive mask of a's shape: 0 where topk(a, k) picks (same ties), -inf elsewhere.")
      .def("gather", [](G g, const Tensor& a, const Tensor& ids) { return rec(g, [&](Graph& gr) { return gr.gather(tid(*g, a), tid(*g, ids)); }); },
           py::arg("a"), py::arg("ids"), "a[..., ids] along the last dim (numpy take_along_axis).")
      .def("matmul_id", [](G g, const Tensor& x, const Tensor& w, const Tensor& ids) {
        return rec(g, [&](Graph& gr) { return gr.matmul_id(tid(*g, x), tid(*g, w), tid(*g, ids)); });
      }, py::arg("x"), py::arg("w"), py::arg("ids"), "x[T, (k,) K] @ w[ids[t, j]].T -> [T, k, N]")
      .def("ssm_conv", [](G g, const Tensor& x, const Tensor& w, const Tensor& state, const Tensor& seqs) {
        return rec(g, [&](Graph& gr) { return gr.ssm_conv(tid(*g, x), tid(*g, w), tid(*g, state), tid(*g, seqs)); });
      }, py::arg("x"), py::arg("w"), py::arg("state"), py::arg("seqs"),
         "Causal depthwise conv over [state window; x] per segment; writes the state planes.")
      .def("gated_delta_net", [](G g, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gate, const Tensor& beta,
                                 const Tensor& state, const Tensor& seqs, float scale, int broadcast, int chunk_min) {
        return rec(g, [&](Graph& gr) {
          return gr.gated_delta_net(tid(*g, q), tid(*g, k), tid(*g, v), tid(*g, gate), tid(*g, beta), tid(*g, state),
                                    tid(*g, seqs), scale, broadcast, chunk_min);
        });
      }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("seqs"),
         py::arg("scale") = 0.0f, py::arg("broadcast") = 0, py::arg("chunk_min") = 0,
         "Gated delta rule per segment from state plane src_plane; writes snapshot planes. scale 0 = 1/sqrt(S).")
      .def("reshape", [](G g, const Tensor& a, std::vector<int64_t> d) { return rec(g, [&](Graph& gr) { return gr.reshape(tid(*g, a), d); }); })
      .def("view", [](G g, const Tensor& a, std::vector<int64_t> d, std::optional<std::vector<int64_t>> st, int64_t off) {
        return rec(g, [&](Graph& gr) { return gr.view(tid(*g, a), d, st ? *st : std::vector<int64_t>{}, off); });
      }, py::arg("a"), py::arg("shape"), py::arg("strides") = py::none(), py::arg("offset") = 0)
      .def("permute", [](G g, const Tensor& a, std::vector<int> axes) { return rec(g, [&](Graph& gr) { return gr.permute(tid(*g, a), axes); }); })
      .def("output", [](G g, const Tensor& t, const std::string& name) { g->g->mark_output(tid(*g, t), name); },
           py::arg("tensor"), py::arg("name"), "Mark a tensor as a named output of the graph.");

  py::class_<ArenaPool, std::shared_ptr<ArenaPool>>(
      m, "ArenaPool",
      "Intermediate memory shared by the CPU plans of one context: they run one at a time, and a plan's "
      "outputs are valid until another plan of the pool runs.")
      .def(py::init<>())
      .def_property_readonly("current_bytes", &ArenaPool::current_bytes, "Size of the buffer new plans get.")
      .def_property_readonly("live_bytes", &ArenaPool::live_bytes, "Bytes of every buffer a live plan holds.");

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan", "A compiled graph, replayed with new inputs.")
      .def(py::init([](G g, std::shared_ptr<ThreadPool> pool, std::shared_ptr<Backend> device,
                       std::shared_ptr<ArenaPool> arenas) {
        if (g->compiled) throw std::invalid_argument("[plan] graph is already compiled");
        g->compiled = true;
        py::gil_scoped_release rel;
        return std::make_shared<Plan>(g->g, pool, device, device ? nullptr : arenas);
      }), py::arg("graph"), py::arg("pool"), py::arg("device") = nullptr, py::arg("arenas") = nullptr,
         py::keep_alive<1, 2>(),
         "Compile a graph. device: an opened Device (open_device); None runs on the CPU. arenas: an "
         "ArenaPool shared with the context's other plans (CPU only).")
      .def_property_readonly("device_steps", [](const Plan& p) -> py::object {
        const DevicePlan* d = p.device_plan();
        if (!d) return py::none();
        py::dict o;
        o["device_nodes"] = d->n_device_nodes;
        o["host_nodes"] = d->n_host_nodes;
        o["copies"] = d->n_copies;
        o["steps"] = d->describe();
        return o;
      }, "For a device plan: how many kernels run on the device and on the CPU, the copies per run, and "
         "the step listing; None on the CPU.")
      .def("set_input", [](Plan& p, const std::string& name, py::array arr) {
        Node& n = p.input(name);
        py::array c = py::array::ensure(arr, py::array::c_style);
        if (!c) throw std::invalid_argument("[plan] input '" + name + "' is not an array");
        const size_t need = span_bytes(n.dtype, n.shape);
        const bool dtype_ok = (n.dtype == DType::F32 && c.dtype().is(py::dtype::of<float>())) ||
                              (n.dtype == DType::I32 && c.dtype().is(py::dtype::of<int32_t>())) ||
                              (n.dtype != DType::F32 && n.dtype != DType::I32);
        if (!dtype_ok) throw std::invalid_argument(std::string("[plan] input '") + name + "' expects " + dtype_name(n.dtype));
        if ((size_t)c.nbytes() != need)
          throw std::invalid_argument("[plan] input '" + name + "' expects " + std::to_string(need) + " bytes " + n.shape.str() +
                                      ", got " + std::to_string(c.nbytes()));
        std::memcpy(n.data, c.data(), need);
      }, py::arg("name"), py::arg("array"), "Copy an array into a named input.")
      .def("input_array", [](py::object self, const std::string& name) {
        Plan& p = self.cast<Plan&>();
        return node_array(p.input(name), self, false);
      }, py::arg("name"), "Writable numpy view of an input's memory (valid while the plan lives).")
      .def("run", [](Plan& p) {
        py::gil_scoped_release rel;
        p.run();
      }, "Execute the plan (releases the GIL).")
      .def("output", [](py::object self, const std::string& name, bool copy) {
        Plan& p = self.cast<Plan&>();
        return node_array(p.output(name), self, copy);
      }, py::arg("name"), py::arg("copy") = true, "An output as a numpy array (a copy unless copy=False).")
      .def_property_readonly("stats", [](const Plan& p) {
        py::dict d;
        d["arena_bytes"] = p.stats().arena_bytes;
        d["input_bytes"] = p.stats().input_bytes;
        d["work_bytes"] = p.stats().work_bytes;
        d["n_nodes"] = p.stats().n_nodes;
        d["n_kernels"] = p.stats().n_kernels;
        return d;
      });
}

}  // namespace pyfast_py
