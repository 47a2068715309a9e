#version 450
// y[..., m, n] = sum_k x[..., m, k] * w[n, k]  (x f32, w of type WT: spec constant).
// Each thread computes one weight row n for up to TM rows m, walking k in order: a row's result
// is a fixed sequential sum that does not depend on which other rows share its thread (batch
// invariant). Workgroups tile 64 weight rows x TM x rows.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "dequant.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const int WT = 0;
const uint TM = 4u;

void main() {
  const uint K = uint(ne(1, 0));
  const uint N = uint(ne(2, 1));
  const uint M = nelem(1) / K;  // every x row (outer dims flattened)
  const uint nblk = (N + 63u) / 64u;
  const uint g = gid_linear();
  const uint n = (g % nblk) * 64u + gl_LocalInvocationID.x, m0 = (g / nblk) * TM;
  if (n >= N || m0 >= M) return;
  const uint mc = min(TM, M - m0);
  uint xb[TM];
  [[unroll]] for (uint j = 0u; j < TM; ++j) {
    const uint m = m0 + min(j, mc - 1u);
    const uint i1 = m % uint(ne(1, 1)), i2 = (m / uint(ne(1, 1))) % uint(ne(1, 2)), i3 = m / uint(ne(1, 1) * ne(1, 2));
    xb[j] = roff(1, i1, i2, i3);
  }
  const uint wb = tofs(2) + n * nb(2, 1);
  float acc[TM];
  [[unroll]] for (uint j = 0u; j < TM; ++j) acc[j] = 0.0;
  for (uint k = 0u; k < K; ++k) {
    const float wv = deq(2, WT, wb, k);
    [[unroll]] for (uint j = 0u; j < TM; ++j) acc[j] += wv * rdf32(1, xb[j] + 4u * k);
  }
  [[unroll]] for (uint j = 0u; j < TM; ++j)
    if (j < mc) wrf32(0, tofs(0) + 4u * ((m0 + j) * N + n), acc[j]);
}
