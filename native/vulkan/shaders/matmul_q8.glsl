// y[..., m, n] = sum_k x[..., m, k] * w[n, k] for block-quantized w (type WT), with x given as
// int8 blocks of 32 (quantize_q8.comp; binding 3): each 32-element sub-block of a weight row is
// unpacked to int8 (minus its offset where the format has one) and multiplied with the
// activation block by integer dot products (DOT_INTRINSIC: the device's 4x8-bit packed dot
// product, SPV_KHR_integer_dot_product; else unpacked), then scaled:
//   d_w * d_x * dot(q_w, q_x) + m_w * (d_x * sum(q_x))   (formats with a min: Q4_1, Q5_1, K-quants).
// One thread per weight row n for up to TM rows m, sub-blocks in order (batch invariant).
#extension GL_EXT_control_flow_attributes : require
#if DOT_INTRINSIC
#extension GL_EXT_spirv_intrinsics : require
#endif
#include "common.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const int WT = 8;
const uint TM = 4u;

#if DOT_INTRINSIC
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot(uint a, uint b, spirv_literal int fmt);
int dot4(uint a, uint b) { return sdot(a, b, 0); }
#else
int dot4(uint a, uint b) {
  int s = 0;
  for (int i = 0; i < 4; ++i) s += bitfieldExtract(int(a), 8 * i, 8) * bitfieldExtract(int(b), 8 * i, 8);
  return s;
}
#endif

uint pack4(int a, int b, int c, int d) {
  return (uint(a) & 0xffu) | ((uint(b) & 0xffu) << 8) | ((uint(c) & 0xffu) << 16) | ((uint(d) & 0xffu) << 24);
}

void k4_scale_min_w(uint sp, uint j, out float sc, out float m) {
  if (j < 4u) {
    sc = float(rd8(2, sp + j) & 63u);
    m = float(rd8(2, sp + j + 4u) & 63u);
  } else {
    sc = float((rd8(2, sp + j + 4u) & 0xfu) | ((rd8(2, sp + j - 4u) >> 6) << 4));
    m = float((rd8(2, sp + j + 4u) >> 4) | ((rd8(2, sp + j) >> 6) << 4));
  }
}

// Sub-block sb (32 elements) of the weight row at byte wb: packed int8 q[8], and the scale
// terms: value = dw * q + mw (mw = 0 for symmetric formats). Q6_K has two scales of 16 (dw, dw2).
void load_w(uint wb, uint sb, out uint q[8], out float dw, out float dw2, out float mw) {
  mw = 0.0;
  dw2 = 0.0;
  if (WT == T_Q8_0) {
    const uint bb = wb + sb * 34u;
    dw = rdf16(2, bb);
    for (uint w = 0u; w < 8u; ++w)
      q[w] = rd8(2, bb + 2u + 4u * w) | (rd8(2, bb + 3u + 4u * w) << 8) | (rd8(2, bb + 4u + 4u * w) << 16) |
             (rd8(2, bb + 5u + 4u * w) << 24);
  } else if (WT == T_Q4_0 || WT == T_Q4_1 || WT == T_Q5_0 || WT == T_Q5_1) {
    const bool five = WT == T_Q5_0 || WT == T_Q5_1, minf = WT == T_Q4_1 || WT == T_Q5_1;
    const uint bs = WT == T_Q4_0 ? 18u : WT == T_Q4_1 ? 20u : WT == T_Q5_0 ? 22u : 24u;
    const uint bb = wb + sb * bs;
    dw = rdf16(2, bb);
    if (minf) mw = rdf16(2, bb + 2u);
    const uint hp = bb + (minf ? 4u : 2u);
    uint qh = 0u;
    if (five) qh = rd8(2, hp) | (rd8(2, hp + 1u) << 8) | (rd8(2, hp + 2u) << 16) | (rd8(2, hp + 3u) << 24);
    const uint qs = hp + (five ? 4u : 0u);
    const int off = minf ? 0 : (five ? 16 : 8);
    for (uint w = 0u; w < 8u; ++w) {
      int v[4];
      for (uint e = 0u; e < 4u; ++e) {
        const uint j = 4u * w + e;
        uint x = j < 16u ? (rd8(2, qs + j) & 0xfu) : (rd8(2, qs + j - 16u) >> 4);
        if (five) x |= ((qh >> j) & 1u) << 4;
        v[e] = int(x) - off;
      }
      q[w] = pack4(v[0], v[1], v[2], v[3]);
    }
  } else if (WT == T_Q4_K || WT == T_Q5_K) {
    const uint bb = wb + (sb >> 3) * (WT == T_Q4_K ? 144u : 176u);
    const uint j8 = sb & 7u, pair = j8 >> 1;
    float sc, m;
    k4_scale_min_w(bb + 4u, j8, sc, m);
    dw = rdf16(2, bb) * sc;
    mw = -rdf16(2, bb + 2u) * m;
    const uint qs = bb + (WT == T_Q4_K ? 16u : 48u) + 32u * pair;
    for (uint w = 0u; w < 8u; ++w) {
      int v[4];
      for (uint e = 0u; e < 4u; ++e) {
        const uint l = 4u * w + e;
        const uint b = rd8(2, qs + l);
        uint x = (j8 & 1u) != 0u ? (b >> 4) : (b & 0xfu);
        if (WT == T_Q5_K) x += ((rd8(2, bb + 16u + l) >> j8) & 1u) << 4;
        v[e] = int(x);
      }
      q[w] = pack4(v[0], v[1], v[2], v[3]);
    }
  } else {  // Q6_K
    const uint bb = wb + (sb >> 3) * 210u;
    const uint r0 = (sb & 7u) * 32u, half_ = r0 >> 7, quarter = (r0 & 127u) >> 5;
    const uint qlp = bb + 64u * half_, qhp = bb + 128u + 32u * half_, scp = bb + 192u + 8u * half_;
    const float d = rdf16(2, bb + 208u);
    dw = d * float(rdi8(2, scp + 2u * quarter));
    dw2 = d * float(rdi8(2, scp + 1u + 2u * quarter));
    for (uint w = 0u; w < 8u; ++w) {
      int v[4];
      for (uint e = 0u; e < 4u; ++e) {
        const uint l = 4u * w + e;
        const uint lo = (quarter & 1u) != 0u ? rd8(2, qlp + l + 32u) : rd8(2, qlp + l);
        const uint x = ((quarter >= 2u) ? (lo >> 4) : (lo & 0xfu)) | (((rd8(2, qhp + l) >> (2u * quarter)) & 3u) << 4);
        v[e] = int(x) - 32;
      }
      q[w] = pack4(v[0], v[1], v[2], v[3]);
    }
  }
}

void main() {
  const uint K = uint(ne(1, 0));
  const uint N = uint(ne(2, 1));
  const uint M = nelem(1) / K;
  const uint nsb = K / 32u;
  const uint nblk = (N + 63u) / 64u;
  const uint g = gid_linear();
  const uint n = (g % nblk) * 64u + gl_LocalInvocationID.x, m0 = (g / nblk) * TM;
  if (n >= N || m0 >= M) return;
  const uint mc = min(TM, M - m0);
  const uint wb = tofs(2) + n * nb(2, 1);
  const uint xq = tofs(3) >> 2;  // words
  float acc[TM];
  [[unroll]] for (uint j = 0u; j < TM; ++j) acc[j] = 0.0;
  for (uint sb = 0u; sb < nsb; ++sb) {
    uint q[8];
    float dw, dw2, mw;
    load_w(wb, sb, q, dw, dw2, mw);
    [[unroll]] for (uint j = 0u; j < TM; ++j) {
      const uint xo = xq + ((m0 + min(j, mc - 1u)) * nsb + sb) * 10u;
      int s0 = 0, s1 = 0;
      [[unroll]] for (uint w = 0u; w < 4u; ++w) s0 += dot4(q[w], B[3].w[xo + 2u + w]);
      [[unroll]] for (uint w = 4u; w < 8u; ++w) s1 += dot4(q[w], B[3].w[xo + 2u + w]);
      const float dx = uintBitsToFloat(B[3].w[xo]);
      if (WT == T_Q6_K) acc[j] += dx * (dw * float(s0) + dw2 * float(s1));
      else acc[j] += dx * dw * float(s0 + s1) + mw * uintBitsToFloat(B[3].w[xo + 1u]);
    }
  }
  [[unroll]] for (uint j = 0u; j < TM; ++j)
    if (j < mc) wrf32(0, tofs(0) + 4u * ((m0 + j) * N + n), acc[j]);
}
