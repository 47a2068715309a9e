// The CUDA kernels' host entry points (one launcher per kernel, defined in the .cu files by topic)
// and the arguments every launch gets. Included by host C++ and by the .cu files.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstddef>
#include <string>
#include <vector>

#include "core/device_plan.h"

namespace pyfast {
namespace cu {

// A launch: the dispatch's parameters and a pointer to each bound tensor's first byte (B[t] for
// tensor t of KernelParams; offsets in P.ofs are unused: pointers are exact).
struct LaunchArgs {
  KernelParams P;
  uint8_t* B[kMaxBindings];
};

// spec: the Dispatch's selectors (kernel variant, dtypes, sizes); groups: its block count.
using LaunchFn = void (*)(const LaunchArgs& a, uint32_t groups, const int32_t* spec, cudaStream_t s);

// The launcher of a kernel name used in a Dispatch (nullptr if none).
LaunchFn find_kernel(const std::string& name);

// cuda_elementwise.cu
void launch_unary(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_binary(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_norm(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_softmax(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_argmax(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_rope(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_get_rows(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_cpy(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_set_rows(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_concat(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_sum(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_gather(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
// cuda_matmul.cu
void launch_quantize_q8(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_matmul_q8(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_matmul(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_matmul_id(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
// cuda_attention.cu
void launch_attention(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
// cuda_ssm.cu
void launch_ssm_conv(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_gated_delta_net(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
// cuda_topk.cu: rows of up to kTopkBitonicMax columns sort in one block (bitonic); longer rows
// go through cub::DeviceSegmentedRadixSort in the node's scratch (topk_radix_scratch bytes).
constexpr int kTopkBitonicMax = 1024;
void launch_topk_bitonic(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
void launch_topk_radix(const LaunchArgs&, uint32_t, const int32_t*, cudaStream_t);
size_t topk_radix_scratch(int rows, int cols);

// cuda_ops.cpp: which nodes run on the device and how (as vulkan/vk_ops.cpp).
bool op_supported(const Node& nd, const Node* const* src);
size_t op_scratch_bytes(const Node& nd, const Node* const* src);
std::vector<Dispatch> op_dispatch(const Node& nd, const Node* const* src);

}  // namespace cu
}  // namespace pyfast
