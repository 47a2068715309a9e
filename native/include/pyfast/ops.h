#pragma once
#include <cstdint>

namespace pyfast {

enum class Op : int32_t {
  none = 0,  // leaves: inputs, constants, external buffers
#define X(name, n_src, is_view) name,
#include "pyfast/ops.def"
#undef X
  count
};

const char* op_name(Op op);
bool op_is_view(Op op);

// Rope modes (GGUF/llama.cpp numbering).
enum RopeMode : int32_t { ROPE_NORMAL = 0, ROPE_NEOX = 2 };

}  // namespace pyfast
