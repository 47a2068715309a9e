// Placeholder: tensor quantization bindings (pyfast quantize) are being written.
#include "bindings/bindings.h"
namespace pyfast_py {
void bind_quant(pybind11::module_&) {}
}  // namespace pyfast_py
