#include "pyfast/ops.h"

#include <cstddef>

namespace pyfast {

namespace {
struct OpInfo { const char* name; int n_src; bool is_view; };
constexpr OpInfo kOps[] = {
    {"none", 0, false},
#define X(name, n_src, is_view) {#name, n_src, is_view},
#include "pyfast/ops.def"
#undef X
};
}  // namespace

// One row per op in ops.def plus `none`: a missing or extra row fails the build.
static_assert(sizeof(kOps) / sizeof(kOps[0]) == (size_t)Op::count, "op table out of sync with Op enum");
static_assert((int)Op::count == 33, "update this count when adding an op to ops.def");

const char* op_name(Op op) { return kOps[(int)op].name; }
bool op_is_view(Op op) { return kOps[(int)op].is_view; }

}  // namespace pyfast
