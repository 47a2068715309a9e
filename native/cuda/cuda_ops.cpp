// Which nodes the CUDA backend runs, and how each is launched (kernel, selectors, parameters,
// blocks). Nodes not listed here run on the CPU inside the device plan (core/device_plan.h).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/cuda_kernels.h"
#include "pyfast/comm.h"

namespace pyfast {
namespace cu {

namespace {

bool is_float(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

bool decodable(DType t) {  // element types the kernels' deq() reads
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16: case DType::Q8_0: case DType::Q4_0: case DType::Q4_1:
    case DType::Q5_0: case DType::Q5_1: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      return true;
    default:
      return false;
  }
}

uint32_t groups_of(int64_t n, int64_t per) { return (uint32_t)((n + per - 1) / per); }

bool packed_rows(const Node& n) {
  int64_t want = 4;
  for (int d = n.shape.ndim - 1; d >= 0; --d) {
    if (n.shape.dims[d] != 1 && n.shape.strides[d] != want) return false;
    want *= n.shape.dims[d];
  }
  return true;
}

// allreduce through a device communicator (NCCL, cuda/comm_nccl.cpp); spec[0]: its id.
void launch_allreduce(const LaunchArgs& a, uint32_t, const int32_t* spec, cudaStream_t s) {
  comm_get(spec[0])->allreduce_sum_f32_device(reinterpret_cast<const float*>(a.B[1]), reinterpret_cast<float*>(a.B[0]),
                                             a.P.ip[0], s);
}

// matmul with a block-quantized weight: int8 activations and __dp4a (PYFAST_CUDA_Q8=0: decode
// the weights to float instead).
bool q8_path(const Node& nd, const Node* const* src) {
  if (nd.op != Op::matmul || !dtype_is_quantized(src[1]->dtype)) return false;
  static const bool off = [] {
    const char* e = std::getenv("PYFAST_CUDA_Q8");
    return e && std::string(e) == "0";
  }();
  return !off && src[0]->shape.dims[src[0]->shape.ndim - 1] % 32 == 0;
}

int64_t rows_of(const Node& n) { return n.shape.numel() / n.shape.dims[n.shape.ndim - 1]; }

}  // namespace

LaunchFn find_kernel(const std::string& name) {
  static const struct { const char* name; LaunchFn fn; } table[] = {
      {"unary", launch_unary}, {"binary", launch_binary}, {"norm", launch_norm}, {"softmax", launch_softmax},
      {"argmax", launch_argmax}, {"rope", launch_rope}, {"get_rows", launch_get_rows}, {"cpy", launch_cpy},
      {"set_rows", launch_set_rows}, {"concat", launch_concat}, {"sum", launch_sum}, {"gather", launch_gather},
      {"quantize_q8", launch_quantize_q8}, {"matmul_q8_dp4a", launch_matmul_q8}, {"matmul", launch_matmul},
      {"matmul_id", launch_matmul_id}, {"attention", launch_attention}, {"ssm_conv", launch_ssm_conv},
      {"gated_delta_net", launch_gated_delta_net}, {"topk_bitonic", launch_topk_bitonic},
      {"topk_radix", launch_topk_radix}, {"allreduce", launch_allreduce},
  };
  for (auto& e : table)
    if (name == e.name) return e.fn;
  return nullptr;
}

size_t op_scratch_bytes(const Node& nd, const Node* const* src) {
  if (q8_path(nd, src)) return (size_t)(src[0]->shape.numel() / 32) * 40;  // per block: d, d * sum(q), 32 x int8
  if (nd.op == Op::topk || nd.op == Op::topk_mask) {
    const int64_t E = src[0]->shape.dims[src[0]->shape.ndim - 1];
    if (E > kTopkBitonicMax) return topk_radix_scratch((int)rows_of(*src[0]), (int)E);
  }
  return 0;
}

bool op_supported(const Node& nd, const Node* const* src) {
  // Kernels index bytes with 32-bit offsets: every operand must span less than 2 GiB.
  auto fits = [&](const Node& n) {
    if (span_bytes(n.dtype, n.shape) + 256 > (uint64_t)INT32_MAX) return false;
    for (int d = 0; d < n.shape.ndim; ++d)
      if (n.shape.strides[d] < 0 || n.shape.strides[d] > INT32_MAX || n.shape.dims[d] > INT32_MAX) return false;
    return true;
  };
  if (!fits(nd)) return false;
  for (int s = 0; s < nd.n_src; ++s)
    if (!fits(*src[s]) || src[s]->packed) return false;
  switch (nd.op) {
    case Op::add: case Op::mul: case Op::scale: case Op::silu: case Op::sigmoid: case Op::softplus: case Op::relu:
    case Op::rms_norm: case Op::l2_norm: case Op::softmax: case Op::argmax:
      return true;
    case Op::rope:  // with frequency factors and YaRN too
      return true;
    case Op::swiglu:
      for (int d = 0; d < 4; ++d)
        if (src[0]->shape.dims[d] != src[1]->shape.dims[d]) return false;
      return src[0]->shape.ndim == src[1]->shape.ndim;
    case Op::get_rows:
      return decodable(src[0]->dtype) && src[0]->shape.ndim <= 4;
    case Op::matmul: case Op::matmul_id:
      return decodable(src[1]->dtype);
    case Op::cpy:
      return is_float(nd.dtype) && decodable(src[0]->dtype);
    case Op::set_rows:
      return nd.dtype == DType::F32 || nd.dtype == DType::F16 || nd.dtype == DType::BF16 || nd.dtype == DType::Q8_0;
    case Op::concat: case Op::sum: case Op::gather: case Op::topk: case Op::topk_mask:
      return true;
    case Op::allreduce:  // on the GPU only with a device communicator (NCCL); else on the CPU
      return packed_rows(*src[0]) && nd.shape.numel() <= INT32_MAX && comm_get(nd.params.i[0])->on_device();
    case Op::ssm_conv:
      return src[1]->shape.dims[1] <= 16;  // kernel taps (the kernel's window array)
    case Op::gated_delta_net:
      return src[2]->shape.dims[2] <= 128;  // head dim S (one thread per value column)
    case Op::attention: {
      auto ok = [](DType t) { return t == DType::F32 || t == DType::F16 || t == DType::Q8_0; };
      return ok(src[1]->dtype) && ok(src[2]->dtype) && src[0]->shape.dims[2] <= 512 && src[2]->shape.dims[2] <= 512;
    }
    default:
      return false;
  }
}

std::vector<Dispatch> op_dispatch(const Node& nd, const Node* const* src) {
  if (q8_path(nd, src)) {
    const int64_t K = src[0]->shape.dims[src[0]->shape.ndim - 1];
    const int64_t M = src[0]->shape.numel() / K, N = src[1]->shape.dims[0];
    Dispatch q;
    q.kernel = "quantize_q8";
    q.bind = {kScratch, 0};
    q.groups = groups_of(M * (K / 32), 64);
    Dispatch m;
    m.kernel = "matmul_q8_dp4a";
    m.spec = {(int32_t)src[1]->dtype};
    m.bind = {kOut, 0, 1, kScratch};
    m.groups = (uint32_t)(groups_of(N, 4) * groups_of(M, 4));
    std::memset(&q.params, 0, sizeof(q.params));
    std::memset(&m.params, 0, sizeof(m.params));
    return {q, m};
  }
  Dispatch d;
  std::memset(&d.params, 0, sizeof(d.params));
  const int64_t numel = nd.shape.numel();
  switch (nd.op) {
    case Op::scale: case Op::silu: case Op::sigmoid: case Op::softplus: case Op::relu:
      d.kernel = "unary";
      d.spec = {nd.op == Op::scale ? 0 : nd.op == Op::silu ? 1 : nd.op == Op::sigmoid ? 2 : nd.op == Op::softplus ? 3 : 4};
      d.params.fp[0] = nd.params.f[0];
      d.groups = groups_of(numel, 256);
      break;
    case Op::add: case Op::mul: case Op::swiglu:
      d.kernel = "binary";
      d.spec = {nd.op == Op::add ? 0 : nd.op == Op::mul ? 1 : 2};
      d.groups = groups_of(numel, 256);
      break;
    case Op::rms_norm: case Op::l2_norm:
      d.kernel = "norm";
      d.spec = {nd.op == Op::rms_norm ? 0 : 1};
      d.params.fp[0] = nd.params.f[0];
      d.groups = (uint32_t)rows_of(nd);
      break;
    case Op::softmax:
      d.kernel = "softmax";
      d.params.ip[0] = nd.n_src > 1 ? 1 : 0;
      d.params.fp[0] = nd.params.f[0];
      d.groups = (uint32_t)rows_of(nd);
      break;
    case Op::allreduce:
      d.kernel = "allreduce";
      d.spec = {nd.params.i[0]};
      d.params.ip[0] = (int32_t)numel;
      break;
    case Op::argmax:
      d.kernel = "argmax";
      d.groups = (uint32_t)rows_of(*src[0]);
      break;
    case Op::rope: {
      d.kernel = "rope";
      const int64_t T = nd.shape.dims[0], H = nd.shape.dims[1], D = nd.shape.dims[2];
      const int n_dims = nd.params.i[0];
      d.params.ip[0] = n_dims;
      d.params.ip[1] = nd.params.i[1];
      d.params.ip[2] = nd.n_src > 2 ? 1 : 0;  // freq_factors
      for (int f = 0; f < 6; ++f) d.params.fp[f] = nd.params.f[f];
      d.groups = groups_of(T * H * (n_dims / 2 + (D - n_dims)), 256);
      break;
    }
    case Op::get_rows:
      d.kernel = "get_rows";
      d.spec = {(int32_t)src[0]->dtype};
      d.params.ip[0] = src[0]->shape.ndim;
      d.groups = groups_of(numel, 256);
      break;
    case Op::matmul: {
      d.kernel = "matmul";
      d.spec = {(int32_t)src[1]->dtype};
      const int64_t K = src[0]->shape.dims[src[0]->shape.ndim - 1];
      const int64_t M = src[0]->shape.numel() / K, N = src[1]->shape.dims[0];
      d.groups = groups_of(N, 4) * groups_of(M, 4);
      break;
    }
    case Op::cpy:
      d.kernel = "cpy";
      d.spec = {(int32_t)src[0]->dtype, (int32_t)nd.dtype};
      d.groups = groups_of(numel, 256);
      break;
    case Op::set_rows: {
      d.kernel = "set_rows";
      d.spec = {(int32_t)nd.dtype};
      d.params.ip[0] = nd.shape.ndim;
      d.params.ip[1] = src[1]->shape.ndim;
      const int64_t R = src[2]->shape.dims[0];
      const int64_t row = nd.shape.numel() / nd.shape.dims[0];
      d.groups = groups_of(R * (row / (nd.dtype == DType::Q8_0 ? 32 : 1)), 64);
      break;
    }
    case Op::attention:
      d.kernel = "attention";
      d.spec = {(int32_t)src[1]->dtype, (int32_t)src[2]->dtype};
      d.params.ip[0] = nd.n_src > 4 ? 1 : 0;
      d.params.fp[0] = nd.params.f[0];
      d.groups = (uint32_t)(nd.shape.dims[0] * nd.shape.dims[1]);
      break;
    case Op::concat:
      d.kernel = "concat";
      d.params.ip[0] = nd.params.i[0];
      d.params.ip[1] = nd.shape.ndim - 1 - nd.params.i[0];
      d.groups = groups_of(numel, 256);
      break;
    case Op::sum:
      d.kernel = "sum";
      d.params.ip[0] = nd.params.i[0];
      d.params.ip[1] = src[0]->shape.ndim - 1 - nd.params.i[0];
      d.groups = groups_of(numel, 256);
      break;
    case Op::gather:
      d.kernel = "gather";
      d.groups = groups_of(numel, 256);
      break;
    case Op::topk: case Op::topk_mask: {  // one selection; topk_mask writes it as a 0 / -inf mask
      d.params.ip[0] = nd.params.i[0];
      d.params.ip[1] = nd.op == Op::topk_mask ? 1 : 0;
      const int64_t E = src[0]->shape.dims[src[0]->shape.ndim - 1], R = rows_of(*src[0]);
      if (E <= kTopkBitonicMax) {
        int32_t n2 = 1;
        while (n2 < E) n2 *= 2;
        d.kernel = "topk_bitonic";
        d.spec = {n2};
        d.groups = (uint32_t)R;
      } else {
        d.kernel = "topk_radix";
        d.spec = {(int32_t)R, (int32_t)E};
        d.bind = {kOut, 0, kScratch};
        d.groups = 1;
      }
      break;
    }
    case Op::matmul_id:
      d.kernel = "matmul_id";
      d.spec = {(int32_t)src[1]->dtype};
      d.params.ip[0] = src[0]->shape.ndim;
      d.groups = (uint32_t)(groups_of(nd.shape.dims[2], 64) * nd.shape.dims[0] * nd.shape.dims[1]);
      break;
    case Op::ssm_conv: {
      d.kernel = "ssm_conv";
      const int64_t T = src[0]->shape.dims[0], C = src[0]->shape.dims[1], n_seg = src[3]->shape.dims[0];
      d.groups = (uint32_t)(n_seg * groups_of(C, 64) + groups_of(T * C, 64));
      break;
    }
    case Op::gated_delta_net: {
      d.kernel = "gated_delta_net";
      const int64_t T = src[2]->shape.dims[0], Hv = src[2]->shape.dims[1], S = src[2]->shape.dims[2];
      const int64_t n_seg = src[6]->shape.dims[0];
      d.params.ip[0] = nd.params.i[0];  // broadcast
      d.params.ip[1] = src[3]->shape.ndim;
      const float scale = nd.params.f[0];
      d.params.fp[0] = scale != 0.0f ? scale : 1.0f / std::sqrt((float)S);
      d.groups = (uint32_t)(n_seg * Hv + groups_of(T * Hv * S, 128));
      break;
    }
    default:
      throw std::logic_error(std::string("[cuda] no kernel for ") + op_name(nd.op));
  }
  return {d};
}

}  // namespace cu
}  // namespace pyfast
