// The pybind11 module is assembled from one bind_<domain>() per file; this is the only
// place pybind11 code lives.
#pragma once
#include <pybind11/pybind11.h>

namespace pyfast_py {
void bind_core(pybind11::module_& m);   // dtypes, cpu features / isa, buffers
void bind_graph(pybind11::module_& m);  // Graph, Tensor handles, Plan
void bind_gguf(pybind11::module_& m);   // GGUFFile reader
void bind_quant(pybind11::module_& m);  // tensor quantization (pyfast quantize)
void bind_device(pybind11::module_& m); // devices (backends)
void bind_comm(pybind11::module_& m);   // communicators (tensor parallelism)
}  // namespace pyfast_py
