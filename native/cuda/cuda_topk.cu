// topk: indices of the k (ip[0]) largest values of each row, largest first, ties to the lower
// index, NaN below every number (NaNs among themselves by index). topk_mask (ip[1] = 1): the same
// selection as an additive f32 mask of the row's shape, 0 at the picks and -inf elsewhere.
//
// Each value becomes a 32-bit key whose unsigned order is the ranking (NaN -> 0, below -inf), so
// both paths sort (key descending, index ascending):
// - rows of up to 1024 columns: one block per row, a bitonic sort in shared memory;
// - longer rows: cub::DeviceSegmentedRadixSort::SortPairsDescending over all rows at once (a
//   stable sort, so equal keys keep index order), in the node's scratch.
#include <cub/device/device_segmented_radix_sort.cuh>

#include "cuda/cuda_common.cuh"

namespace pyfast {
namespace cu {

namespace {

__device__ __forceinline__ uint32_t rank_key(float v) {
  if (isnan(v)) return 0u;
  if (v == 0.0f) v = 0.0f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -inf -> 0x007fffff > 0
}

// Element i of row `row` of tensor 1 (any strides).
__device__ __forceinline__ float row_elem(const LaunchArgs& a, uint32_t row, uint32_t E, uint32_t i) {
  const U4 c = unflat(a, 1, row * E);
  return rdf32(a, 1, roff(a, 1, c.y, c.z, c.w) + i * nb(a, 1, 0));
}

// (ka, ia) ranks before (kb, ib)
__device__ __forceinline__ bool before(uint32_t ka, uint32_t ia, uint32_t kb, uint32_t ib) {
  return ka > kb || (ka == kb && ia < ib);
}

__global__ void k_topk_bitonic(const LaunchArgs a, uint32_t n2) {
  __shared__ uint32_t key[1024];
  __shared__ uint32_t idx[1024];
  const uint32_t E = ne(a, 1, 0), row = gid(), k = (uint32_t)a.P.ip[0];
  for (uint32_t i = threadIdx.x; i < n2; i += blockDim.x) {
    key[i] = i < E ? rank_key(row_elem(a, row, E, i)) : 0u;
    idx[i] = i < E ? i : 0xffffffffu;  // padding sorts last
  }
  __syncthreads();
  for (uint32_t size = 2u; size <= n2; size <<= 1)
    for (uint32_t stride = size >> 1; stride > 0u; stride >>= 1) {
      for (uint32_t i = threadIdx.x; i < n2; i += blockDim.x) {
        const uint32_t p = i ^ stride;
        if (p > i) {
          const bool first_up = (i & size) == 0u;  // this run sorts "before" first
          const bool swap = first_up ? before(key[p], idx[p], key[i], idx[i]) : before(key[i], idx[i], key[p], idx[p]);
          if (swap) {
            const uint32_t tk = key[i], ti = idx[i];
            key[i] = key[p];
            idx[i] = idx[p];
            key[p] = tk;
            idx[p] = ti;
          }
        }
      }
      __syncthreads();
    }
  if (a.P.ip[1]) {  // topk_mask
    float* out = reinterpret_cast<float*>(a.B[0]) + row * E;
    for (uint32_t i = threadIdx.x; i < E; i += blockDim.x) out[i] = -INFINITY;
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < k; i += blockDim.x) out[idx[i]] = 0.0f;
    return;
  }
  int32_t* out = reinterpret_cast<int32_t*>(a.B[0]) + row * k;
  for (uint32_t i = threadIdx.x; i < k; i += blockDim.x) out[i] = (int32_t)idx[i];
}

// Scratch layout of the radix path for R rows of E columns (each region 256-byte aligned).
struct RadixLayout {
  size_t keys_in, keys_out, vals_in, vals_out, offsets, temp, total;
};
__host__ __device__ inline size_t al256(size_t n) { return (n + 255) / 256 * 256; }
inline RadixLayout radix_layout(size_t R, size_t E, size_t temp) {
  RadixLayout l;
  const size_t n = R * E;
  l.keys_in = 0;
  l.keys_out = l.keys_in + al256(4 * n);
  l.vals_in = l.keys_out + al256(4 * n);
  l.vals_out = l.vals_in + al256(4 * n);
  l.offsets = l.vals_out + al256(4 * n);
  l.temp = l.offsets + al256(4 * (R + 1));
  l.total = l.temp + al256(temp);
  return l;
}

__global__ void k_topk_prep(const LaunchArgs a, uint32_t* keys, uint32_t* vals, int32_t* offsets, uint32_t R) {
  const uint32_t E = ne(a, 1, 0);
  const uint32_t i = blockIdx.x * 256u + threadIdx.x;
  if (i <= R) offsets[i] = (int32_t)(i * E);
  if (i >= R * E) return;
  const uint32_t row = i / E, c = i % E;
  keys[i] = rank_key(row_elem(a, row, E, c));
  vals[i] = c;
}

__global__ void k_topk_pick(const LaunchArgs a, const uint32_t* vals, uint32_t R) {
  const uint32_t E = ne(a, 1, 0), k = (uint32_t)a.P.ip[0];
  const uint32_t i = blockIdx.x * 256u + threadIdx.x;
  if (i >= R * k) return;
  const uint32_t row = i / k, v = vals[row * E + i % k];
  if (a.P.ip[1]) reinterpret_cast<float*>(a.B[0])[row * E + v] = 0.0f;  // topk_mask
  else reinterpret_cast<int32_t*>(a.B[0])[i] = (int32_t)v;
}

__global__ void k_fill_ninf(float* out, uint32_t n) {
  const uint32_t i = blockIdx.x * 256u + threadIdx.x;
  if (i < n) out[i] = -INFINITY;
}

size_t radix_temp_bytes(int R, int E) {
  size_t temp = 0;
  cub::DeviceSegmentedRadixSort::SortPairsDescending<uint32_t, uint32_t>(
      nullptr, temp, (const uint32_t*)nullptr, (uint32_t*)nullptr, (const uint32_t*)nullptr, (uint32_t*)nullptr,
      R * E, R, (const int32_t*)nullptr, (const int32_t*)nullptr + 1, 0, 32);
  return temp;
}

}  // namespace

size_t topk_radix_scratch(int rows, int cols) {
  return radix_layout(rows, cols, radix_temp_bytes(rows, cols)).total;
}

void launch_topk_bitonic(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) {
  k_topk_bitonic<<<g, 256, 0, s>>>(a, (uint32_t)spec[0]);  // spec[0]: E rounded up to a power of 2
}

// Bindings: 0 out, 1 x, 2 scratch; spec: rows, cols.
void launch_topk_radix(const LaunchArgs& a, uint32_t, const int32_t* spec, cudaStream_t s) {
  const int R = spec[0], E = spec[1];
  size_t temp = radix_temp_bytes(R, E);
  const RadixLayout l = radix_layout(R, E, temp);
  uint8_t* base = a.B[2];
  auto* keys_in = reinterpret_cast<uint32_t*>(base + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + l.keys_out);
  auto* vals_in = reinterpret_cast<uint32_t*>(base + l.vals_in);
  auto* vals_out = reinterpret_cast<uint32_t*>(base + l.vals_out);
  auto* offsets = reinterpret_cast<int32_t*>(base + l.offsets);
  const uint32_t n = (uint32_t)R * (uint32_t)E;
  k_topk_prep<<<(std::max<uint32_t>(n, R + 1) + 255) / 256, 256, 0, s>>>(a, keys_in, vals_in, offsets, R);
  cub::DeviceSegmentedRadixSort::SortPairsDescending(base + l.temp, temp, keys_in, keys_out, vals_in, vals_out, (int)n, R,
                                                     offsets, offsets + 1, 0, 32, s);
  if (a.P.ip[1]) k_fill_ninf<<<(n + 255) / 256, 256, 0, s>>>(reinterpret_cast<float*>(a.B[0]), n);
  const uint32_t nk = (uint32_t)R * (uint32_t)a.P.ip[0];
  k_topk_pick<<<(nk + 255) / 256, 256, 0, s>>>(a, vals_out, R);
}

}  // namespace cu
}  // namespace pyfast
