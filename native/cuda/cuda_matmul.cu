// Matrix products: y[..., m, n] = sum_k x[..., m, k] * w[n, k].
//
// Block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the activations are
// first quantized to int8 blocks of 32 (quantize_q8, the CPU kernels' scheme), then each
// 32-element weight sub-block is unpacked to int8 and multiplied with __dp4a:
//   d_w * d_x * dot(q_w, q_x) + m_w * (d_x * sum(q_x))   (formats with a min: Q4_1, Q5_1, K-quants).
// Float weights (F32, F16, BF16) multiply in float. One warp per weight row n and up to TM
// activation rows: lane l takes sub-blocks (or elements) l, l + 32, ... in order and the lanes'
// sums meet in a fixed shuffle tree, so a row's result does not depend on the batch around it.
#include "cuda/cuda_common.cuh"

namespace pyfast {
namespace cu {

namespace {

constexpr uint32_t TM = 4;  // activation rows per warp

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint32_t pack4(int a, int b, int c, int d) {
  return ((uint32_t)a & 0xffu) | (((uint32_t)b & 0xffu) << 8) | (((uint32_t)c & 0xffu) << 16) | (((uint32_t)d & 0xffu) << 24);
}

// The activations of a quantized matmul as int8 blocks: for each row of x [..., K] (f32) and each
// block of 32, d = max|x| / 127, q = round(x / d) (halves away from zero), stored as 10 words:
// d, d * sum(q), then the 32 q packed 4 per word. One thread per block.
__global__ void k_quantize_q8(const LaunchArgs a) {
  const uint32_t K = ne(a, 1, 0);
  const uint32_t nblk = K / 32u;
  const uint32_t M = nelem(a, 1) / K;
  const uint32_t i = gid() * 64u + threadIdx.x;
  if (i >= M * nblk) return;
  const uint32_t m = i / nblk, b = i % nblk;
  const uint32_t i1 = m % (uint32_t)ne(a, 1, 1), i2 = (m / (uint32_t)ne(a, 1, 1)) % (uint32_t)ne(a, 1, 2);
  const uint32_t i3 = m / ((uint32_t)ne(a, 1, 1) * (uint32_t)ne(a, 1, 2));
  const uint32_t xb = roff(a, 1, i1, i2, i3) + 4u * 32u * b;
  float amax = 0.0f;
  for (uint32_t e = 0u; e < 32u; ++e) amax = fmaxf(amax, fabsf(rdf32(a, 1, xb + 4u * e)));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  uint32_t* o = reinterpret_cast<uint32_t*>(a.B[0]) + i * 10u;
  int sum = 0;
  for (uint32_t w = 0u; w < 8u; ++w) {
    uint32_t packed = 0u;
    for (uint32_t e = 0u; e < 4u; ++e) {
      const float s = rdf32(a, 1, xb + 4u * (4u * w + e)) * id;
      const int q = (int)(copysignf(1.0f, s) * floorf(fabsf(s) + 0.5f));
      sum += q;
      packed |= ((uint32_t)q & 0xffu) << (8u * e);
    }
    o[2u + w] = packed;
  }
  o[0] = __float_as_uint(d);
  o[1] = __float_as_uint(d * (float)sum);
}

// Sub-block sb (32 elements) of the weight row at byte wb of tensor 2 (type wt): packed int8
// q[8] and the scale terms (value = dw * q + mw; Q6_K has two scales of 16: dw, dw2).
__device__ void load_w(const LaunchArgs& a, int wt, uint32_t wb, uint32_t sb, uint32_t q[8], float& dw, float& dw2,
                       float& mw) {
  mw = 0.0f;
  dw2 = 0.0f;
  if (wt == T_Q8_0) {
    const uint32_t bb = wb + sb * 34u;
    dw = rdf16(a, 2, bb);
    for (uint32_t w = 0u; w < 8u; ++w)
      q[w] = rd8(a, 2, bb + 2u + 4u * w) | (rd8(a, 2, bb + 3u + 4u * w) << 8) | (rd8(a, 2, bb + 4u + 4u * w) << 16) |
             (rd8(a, 2, bb + 5u + 4u * w) << 24);
  } else if (wt == T_Q4_0 || wt == T_Q4_1 || wt == T_Q5_0 || wt == T_Q5_1) {
    const bool five = wt == T_Q5_0 || wt == T_Q5_1, minf = wt == T_Q4_1 || wt == T_Q5_1;
    const uint32_t bs = wt == T_Q4_0 ? 18u : wt == T_Q4_1 ? 20u : wt == T_Q5_0 ? 22u : 24u;
    const uint32_t bb = wb + sb * bs;
    dw = rdf16(a, 2, bb);
    if (minf) mw = rdf16(a, 2, bb + 2u);
    const uint32_t hp = bb + (minf ? 4u : 2u);
    uint32_t qh = 0u;
    if (five) qh = rd8(a, 2, hp) | (rd8(a, 2, hp + 1u) << 8) | (rd8(a, 2, hp + 2u) << 16) | (rd8(a, 2, hp + 3u) << 24);
    const uint32_t qs = hp + (five ? 4u : 0u);
    const int off = minf ? 0 : (five ? 16 : 8);
    for (uint32_t w = 0u; w < 8u; ++w) {
      int v[4];
      for (uint32_t e = 0u; e < 4u; ++e) {
        const uint32_t j = 4u * w + e;
        uint32_t x = j < 16u ? (rd8(a, 2, qs + j) & 0xfu) : (rd8(a, 2, qs + j - 16u) >> 4);
        if (five) x |= ((qh >> j) & 1u) << 4;
        v[e] = (int)x - off;
      }
      q[w] = pack4(v[0], v[1], v[2], v[3]);
    }
  } else if (wt == T_Q4_K || wt == T_Q5_K) {
    const uint32_t bb = wb + (sb >> 3) * (wt == T_Q4_K ? 144u : 176u);
    const uint32_t j8 = sb & 7u, pair = j8 >> 1;
    float sc, m;
    k4_scale_min(a, 2, bb + 4u, j8, sc, m);
    dw = rdf16(a, 2, bb) * sc;
    mw = -rdf16(a, 2, bb + 2u) * m;
    const uint32_t qs = bb + (wt == T_Q4_K ? 16u : 48u) + 32u * pair;
    for (uint32_t w = 0u; w < 8u; ++w) {
      int v[4];
      for (uint32_t e = 0u; e < 4u; ++e) {
        const uint32_t l = 4u * w + e;
        const uint32_t b = rd8(a, 2, qs + l);
        uint32_t x = (j8 & 1u) != 0u ? (b >> 4) : (b & 0xfu);
        if (wt == T_Q5_K) x += ((rd8(a, 2, bb + 16u + l) >> j8) & 1u) << 4;
        v[e] = (int)x;
      }
      q[w] = pack4(v[0], v[1], v[2], v[3]);
    }
  } else {  // Q6_K
    const uint32_t bb = wb + (sb >> 3) * 210u;
    const uint32_t r0 = (sb & 7u) * 32u, half_ = r0 >> 7, quarter = (r0 & 127u) >> 5;
    const uint32_t qlp = bb + 64u * half_, qhp = bb + 128u + 32u * half_, scp = bb + 192u + 8u * half_;
    const float d = rdf16(a, 2, bb + 208u);
    dw = d * (float)rdi8(a, 2, scp + 2u * quarter);
    dw2 = d * (float)rdi8(a, 2, scp + 1u + 2u * quarter);
    for (uint32_t w = 0u; w < 8u; ++w) {
      int v[4];
      for (uint32_t e = 0u; e < 4u; ++e) {
        const uint32_t l = 4u * w + e;
        const uint32_t lo = (quarter & 1u) != 0u ? rd8(a, 2, qlp + l + 32u) : rd8(a, 2, qlp + l);
        const uint32_t x = ((quarter >= 2u) ? (lo >> 4) : (lo & 0xfu)) | (((rd8(a, 2, qhp + l) >> (2u * quarter)) & 3u) << 4);
        v[e] = (int)x - 32;
      }
      q[w] = pack4(v[0], v[1], v[2], v[3]);
    }
  }
}

// Bindings: 0 y, 1 x (f32, shapes only), 2 w, 3 x as int8 blocks (quantize_q8). Blocks of 4 warps.
__global__ void k_matmul_q8(const LaunchArgs a, int wt) {
  const uint32_t K = ne(a, 1, 0), N = ne(a, 2, 1), M = nelem(a, 1) / K;
  const uint32_t nsb = K / 32u;
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint32_t nq = (N + 3u) / 4u;
  const uint32_t n = (gid() % nq) * 4u + warp, m0 = (gid() / nq) * TM;
  if (n >= N || m0 >= M) return;  // whole warps leave together
  const uint32_t mc = min(TM, M - m0);
  const uint32_t wb = n * nb(a, 2, 1);
  const uint32_t* xq = reinterpret_cast<const uint32_t*>(a.B[3]);
  float acc[TM];
#pragma unroll
  for (uint32_t j = 0u; j < TM; ++j) acc[j] = 0.0f;
  for (uint32_t sb = lane; sb < nsb; sb += 32u) {
    uint32_t q[8];
    float dw, dw2, mw;
    load_w(a, wt, wb, sb, q, dw, dw2, mw);
#pragma unroll
    for (uint32_t j = 0u; j < TM; ++j) {
      if (j >= mc) break;
      const uint32_t* xo = xq + ((m0 + j) * nsb + sb) * 10u;
      int s0 = 0, s1 = 0;
#pragma unroll
      for (uint32_t w = 0u; w < 4u; ++w) s0 = __dp4a((int)q[w], (int)xo[2u + w], s0);
#pragma unroll
      for (uint32_t w = 4u; w < 8u; ++w) s1 = __dp4a((int)q[w], (int)xo[2u + w], s1);
      const float dx = __uint_as_float(xo[0]);
      if (wt == T_Q6_K) acc[j] += dx * (dw * (float)s0 + dw2 * (float)s1);
      else acc[j] += dx * dw * (float)(s0 + s1) + mw * __uint_as_float(xo[1]);
    }
  }
#pragma unroll
  for (uint32_t j = 0u; j < TM; ++j) {
    const float v = warp_sum(acc[j]);
    if (lane == 0u && j < mc) wrf32(a, 0, 4u * ((m0 + j) * N + n), v);
  }
}

// Float weights (any type deq reads): bindings 0 y, 1 x, 2 w.
__global__ void k_matmul(const LaunchArgs a, int wt) {
  const uint32_t K = ne(a, 1, 0), N = ne(a, 2, 1), M = nelem(a, 1) / K;
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint32_t nq = (N + 3u) / 4u;
  const uint32_t n = (gid() % nq) * 4u + warp, m0 = (gid() / nq) * TM;
  if (n >= N || m0 >= M) return;
  const uint32_t mc = min(TM, M - m0);
  uint32_t xb[TM];
#pragma unroll
  for (uint32_t j = 0u; j < TM; ++j) {
    const uint32_t m = m0 + min(j, mc - 1u);
    const uint32_t i1 = m % (uint32_t)ne(a, 1, 1), i2 = (m / (uint32_t)ne(a, 1, 1)) % (uint32_t)ne(a, 1, 2);
    const uint32_t i3 = m / ((uint32_t)ne(a, 1, 1) * (uint32_t)ne(a, 1, 2));
    xb[j] = roff(a, 1, i1, i2, i3);
  }
  const uint32_t wb = n * nb(a, 2, 1);
  float acc[TM];
#pragma unroll
  for (uint32_t j = 0u; j < TM; ++j) acc[j] = 0.0f;
  for (uint32_t k = lane; k < K; k += 32u) {
    const float wv = deq(a, 2, wt, wb, k);
#pragma unroll
    for (uint32_t j = 0u; j < TM; ++j) acc[j] += wv * rdf32(a, 1, xb[j] + 4u * k);
  }
#pragma unroll
  for (uint32_t j = 0u; j < TM; ++j) {
    const float v = warp_sum(acc[j]);
    if (lane == 0u && j < mc) wrf32(a, 0, 4u * ((m0 + j) * N + n), v);
  }
}

// out[t, j, n] = x[t, (j,) :] . w[ids[t, j], n, :] (x [T, K] or [T, k, K]: ip[0] its ndim). One
// thread per output element, a sequential sum over K; an expert id outside [0, E) gives 0.
__global__ void k_matmul_id(const LaunchArgs a, int wt) {
  const uint32_t N = ne(a, 0, 0), kk = ne(a, 0, 1), T = ne(a, 0, 2);
  const uint32_t K = ne(a, 2, 0), E = ne(a, 2, 2);
  const uint32_t nblk = (N + 63u) / 64u;
  const uint32_t g = gid();
  const uint32_t n = (g % nblk) * 64u + threadIdx.x, tj = g / nblk;
  if (n >= N || tj >= T * kk) return;
  const uint32_t t = tj / kk, j = tj % kk;
  const int e = (int)rd32(a, 3, t * nb(a, 3, 1) + j * nb(a, 3, 0));
  float acc = 0.0f;
  if (e >= 0 && (uint32_t)e < E) {
    const bool x3 = a.P.ip[0] == 3;
    const uint32_t xb = x3 ? t * nb(a, 1, 2) + j * nb(a, 1, 1) : t * nb(a, 1, 1);
    const uint32_t wb = (uint32_t)e * nb(a, 2, 2) + n * nb(a, 2, 1);
    for (uint32_t q = 0u; q < K; ++q) acc += deq(a, 2, wt, wb, q) * rdf32(a, 1, xb + 4u * q);
  }
  wrf32(a, 0, 4u * (tj * N + n), acc);
}

}  // namespace

void launch_quantize_q8(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_quantize_q8<<<g, 64, 0, s>>>(a); }
void launch_matmul_q8(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_matmul_q8<<<g, 128, 0, s>>>(a, spec[0]); }
void launch_matmul(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_matmul<<<g, 128, 0, s>>>(a, spec[0]); }
void launch_matmul_id(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_matmul_id<<<g, 64, 0, s>>>(a, spec[0]); }

}  // namespace cu
}  // namespace pyfast
