#include "bindings/bindings.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "pyfast native core: tensors, graph builder, plans, CPU kernels, GGUF reader";
  pyfast_py::bind_core(m);
  pyfast_py::bind_graph(m);
  pyfast_py::bind_gguf(m);
  pyfast_py::bind_quant(m);
  pyfast_py::bind_device(m);
  pyfast_py::bind_comm(m);
}
