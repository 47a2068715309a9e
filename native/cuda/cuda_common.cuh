// Shared device code of every pyfast CUDA kernel (compiled into each .cu file).
//
// A kernel gets its launch's KernelParams (core/device_plan.h: dims `ne` and byte strides `nb`
// innermost first, tensor 0 the output, 1 + i source i) and one byte pointer per bound tensor,
// already at the tensor's first byte. The kernels follow the Vulkan shaders' scheme (same
// parameters, same sequential sums, so the same batch invariance); reads of block formats go
// byte by byte, so no operand needs more than its element alignment.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda/cuda_kernels.h"

namespace pyfast {
namespace cu {

// dtype ids (GGUF numbering, as pyfast::DType)
constexpr int T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8;
constexpr int T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_I32 = 26, T_BF16 = 30;

__device__ __forceinline__ int ne(const LaunchArgs& a, int t, int d) { return a.P.ne[t][d]; }
__device__ __forceinline__ uint32_t nb(const LaunchArgs& a, int t, int d) { return (uint32_t)a.P.nb[t][d]; }
__device__ __forceinline__ uint32_t nelem(const LaunchArgs& a, int t) {
  return (uint32_t)a.P.ne[t][0] * (uint32_t)a.P.ne[t][1] * (uint32_t)a.P.ne[t][2] * (uint32_t)a.P.ne[t][3];
}
// Byte offset of element (i0 innermost, i1, i2, i3) of a non-block tensor t.
__device__ __forceinline__ uint32_t eoff(const LaunchArgs& a, int t, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
  return i0 * nb(a, t, 0) + i1 * nb(a, t, 1) + i2 * nb(a, t, 2) + i3 * nb(a, t, 3);
}
// Row base (i1, i2, i3) of tensor t.
__device__ __forceinline__ uint32_t roff(const LaunchArgs& a, int t, uint32_t i1, uint32_t i2, uint32_t i3) {
  return i1 * nb(a, t, 1) + i2 * nb(a, t, 2) + i3 * nb(a, t, 3);
}
struct U4 { uint32_t x, y, z, w; };
__device__ __forceinline__ U4 unflat(const LaunchArgs& a, int t, uint32_t i) {
  U4 r;
  r.x = i % (uint32_t)ne(a, t, 0); i /= (uint32_t)ne(a, t, 0);
  r.y = i % (uint32_t)ne(a, t, 1); i /= (uint32_t)ne(a, t, 1);
  r.z = i % (uint32_t)ne(a, t, 2); i /= (uint32_t)ne(a, t, 2);
  r.w = i;
  return r;
}
__device__ __forceinline__ uint32_t gid() { return blockIdx.x; }

__device__ __forceinline__ uint32_t rd8(const LaunchArgs& a, int t, uint32_t b) { return a.B[t][b]; }
__device__ __forceinline__ int rdi8(const LaunchArgs& a, int t, uint32_t b) { return (int)(int8_t)a.B[t][b]; }
__device__ __forceinline__ uint32_t rd16(const LaunchArgs& a, int t, uint32_t b) {
  return (uint32_t)a.B[t][b] | ((uint32_t)a.B[t][b + 1] << 8);
}
__device__ __forceinline__ uint32_t rd32(const LaunchArgs& a, int t, uint32_t b) {
  return *reinterpret_cast<const uint32_t*>(a.B[t] + b);  // 4-byte elements: aligned
}
__device__ __forceinline__ float rdf32(const LaunchArgs& a, int t, uint32_t b) {
  return *reinterpret_cast<const float*>(a.B[t] + b);
}
__device__ __forceinline__ float half_to_float(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }
__device__ __forceinline__ float rdf16(const LaunchArgs& a, int t, uint32_t b) { return half_to_float(rd16(a, t, b)); }
__device__ __forceinline__ float rdbf16(const LaunchArgs& a, int t, uint32_t b) { return __uint_as_float(rd16(a, t, b) << 16); }
__device__ __forceinline__ void wrf32(const LaunchArgs& a, int t, uint32_t b, float v) {
  *reinterpret_cast<float*>(a.B[t] + b) = v;
}
__device__ __forceinline__ void wr16(const LaunchArgs& a, int t, uint32_t b, uint32_t v) {
  a.B[t][b] = (uint8_t)(v & 0xff);
  a.B[t][b + 1] = (uint8_t)(v >> 8);
}
// f32 -> f16 (round to nearest even) and bf16 (round to nearest even; NaN stays quiet).
__device__ __forceinline__ uint32_t to_f16(float v) { return (uint32_t)__half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ uint32_t to_bf16(float v) {
  const uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
  return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;
}

// One float element of a non-block tensor of type ty.
__device__ __forceinline__ float rdt(const LaunchArgs& a, int t, int ty, uint32_t b) {
  if (ty == T_F32) return rdf32(a, t, b);
  if (ty == T_F16) return rdf16(a, t, b);
  if (ty == T_BF16) return rdbf16(a, t, b);
  return (float)(int)rd32(a, t, b);  // I32
}

__device__ __forceinline__ void k4_scale_min(const LaunchArgs& a, int t, uint32_t sp, uint32_t j, float& sc, float& m) {
  if (j < 4u) {
    sc = (float)(rd8(a, t, sp + j) & 63u);
    m = (float)(rd8(a, t, sp + j + 4u) & 63u);
  } else {
    sc = (float)((rd8(a, t, sp + j + 4u) & 0xfu) | ((rd8(a, t, sp + j - 4u) >> 6) << 4));
    m = (float)((rd8(a, t, sp + j + 4u) >> 4) | ((rd8(a, t, sp + j) >> 6) << 4));
  }
}

// Element e of the row at byte rb (a whole number of blocks) of tensor t, type ty, as float.
__device__ __forceinline__ float deq(const LaunchArgs& a, int t, int ty, uint32_t rb, uint32_t e) {
  if (ty == T_F32) return rdf32(a, t, rb + 4u * e);
  if (ty == T_F16) return rdf16(a, t, rb + 2u * e);
  if (ty == T_BF16) return rdbf16(a, t, rb + 2u * e);
  const uint32_t j = e & 31u;
  if (ty == T_Q8_0) {
    const uint32_t bb = rb + (e >> 5) * 34u;
    return rdf16(a, t, bb) * (float)rdi8(a, t, bb + 2u + j);
  }
  if (ty == T_Q4_0 || ty == T_Q4_1) {
    const uint32_t bb = rb + (e >> 5) * (ty == T_Q4_0 ? 18u : 20u);
    const uint32_t qs = bb + (ty == T_Q4_0 ? 2u : 4u);
    const uint32_t q = j < 16u ? (rd8(a, t, qs + j) & 0xfu) : (rd8(a, t, qs + j - 16u) >> 4);
    if (ty == T_Q4_0) return rdf16(a, t, bb) * ((float)q - 8.0f);
    return rdf16(a, t, bb) * (float)q + rdf16(a, t, bb + 2u);
  }
  if (ty == T_Q5_0 || ty == T_Q5_1) {
    const uint32_t bb = rb + (e >> 5) * (ty == T_Q5_0 ? 22u : 24u);
    const uint32_t hp = bb + (ty == T_Q5_0 ? 2u : 4u);
    const uint32_t qh = rd8(a, t, hp) | (rd8(a, t, hp + 1u) << 8) | (rd8(a, t, hp + 2u) << 16) | (rd8(a, t, hp + 3u) << 24);
    const uint32_t qs = hp + 4u;
    const uint32_t lo = j < 16u ? (rd8(a, t, qs + j) & 0xfu) : (rd8(a, t, qs + j - 16u) >> 4);
    const uint32_t q = lo | (((qh >> j) & 1u) << 4);
    if (ty == T_Q5_0) return rdf16(a, t, bb) * ((float)q - 16.0f);
    return rdf16(a, t, bb) * (float)q + rdf16(a, t, bb + 2u);
  }
  const uint32_t r = e & 255u;
  if (ty == T_Q4_K || ty == T_Q5_K) {
    const uint32_t bb = rb + (e >> 8) * (ty == T_Q4_K ? 144u : 176u);
    const uint32_t sb = r >> 5, l = r & 31u, pair = sb >> 1;
    float sc, m;
    k4_scale_min(a, t, bb + 4u, sb, sc, m);
    const uint32_t qs = bb + (ty == T_Q4_K ? 16u : 48u);
    const uint32_t ql = rd8(a, t, qs + 32u * pair + l);
    uint32_t q = (sb & 1u) != 0u ? (ql >> 4) : (ql & 0xfu);
    if (ty == T_Q5_K) q += ((rd8(a, t, bb + 16u + l) >> sb) & 1u) << 4;
    return rdf16(a, t, bb) * sc * (float)q - rdf16(a, t, bb + 2u) * m;
  }
  if (ty == T_Q6_K) {
    const uint32_t bb = rb + (e >> 8) * 210u;
    const uint32_t half_ = r >> 7, rr = r & 127u, quarter = rr >> 5, l = rr & 31u;
    const uint32_t qlp = bb + 64u * half_, qhp = bb + 128u + 32u * half_, scp = bb + 192u + 8u * half_;
    const uint32_t qh = rd8(a, t, qhp + l);
    const uint32_t lo = (quarter & 1u) != 0u ? rd8(a, t, qlp + l + 32u) : rd8(a, t, qlp + l);
    const uint32_t q = ((quarter >= 2u) ? (lo >> 4) : (lo & 0xfu)) | (((qh >> (2u * quarter)) & 3u) << 4);
    const int sc = rdi8(a, t, scp + l / 16u + 2u * quarter);
    return rdf16(a, t, bb + 208u) * (float)sc * ((float)q - 32.0f);
  }
  return 0.0f;
}

}  // namespace cu
}  // namespace pyfast
