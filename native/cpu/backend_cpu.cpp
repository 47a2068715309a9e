// CPU backend glue: per-op scratch sizes and the view ops (which run no kernel).
// Row conversions (row_to_f32 / row_from_f32) live with the codecs in quant/quant.cpp.
#include "cpu/quant/quant.h"
#include "pyfast/cpu.h"

namespace pyfast {

size_t cpu_attention_work_size(const Node& dst, const Node* const* src, int nth);
size_t cpu_ssm_work_size(const Node& dst, const Node* const* src, int nth);  // kernels/ssm.cpp
size_t cpu_moe_work_size(const Node& dst, const Node* const* src, int nth);  // kernels/moe.cpp
size_t cpu_argmax_work_size(const Node& dst, const Node* const* src, int nth);  // kernels/elementwise.cpp
size_t cpu_allreduce_work_size(const Node& dst, const Node* const* src, int nth);  // kernels/comm.cpp

size_t cpu_work_size(const Node& dst, const Node* const* src, int nth) {
  switch (dst.op) {
    case Op::matmul: return cpu_matmul_work_size(dst, src, nth);
    case Op::argmax: return cpu_argmax_work_size(dst, src, nth);
    case Op::allreduce: return cpu_allreduce_work_size(dst, src, nth);
    case Op::attention: return cpu_attention_work_size(dst, src, nth);
    case Op::ssm_conv:
    case Op::gated_delta_net: return cpu_ssm_work_size(dst, src, nth);
    case Op::topk:
    case Op::topk_mask:
    case Op::matmul_id: return cpu_moe_work_size(dst, src, nth);
    default: return 0;
  }
}

// View ops only reinterpret memory.
void cpu_reshape(const ComputeParams&, Node&, const Node* const*) {}
void cpu_view(const ComputeParams&, Node&, const Node* const*) {}
void cpu_permute(const ComputeParams&, Node&, const Node* const*) {}

}  // namespace pyfast
