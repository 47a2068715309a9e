#version 450
// Gated delta rule, token-serial, per segment (algorithms.md 2.1, cpu/kernels/ssm.cpp): q, k
// [T, Hk, S], v [T, Hv, S], g [T, Hv] or [T, Hv, S] (per-key), beta [T, Hv], state
// [P, n_slot, Hv, S*S] (M[i = key][j = value] row-major), seqs [n_seg, 4]. One workgroup per
// (segment, value head); thread j owns column j of M, so a token's update needs no reduction
// across threads. Snapshot plane i gets the state i tokens before the segment's end
// (i < min(n, P)); every thread reads its column of the source plane before writing any plane.
// ip[0].x: broadcast (0 tiled, 1 interleaved), fp[0].x: scale. Trailing workgroups zero the
// output of tokens no segment covers.
#include "common.glsl"
layout(local_size_x = 128) in;
const uint MAXS = 128u;
shared float qs[MAXS];
shared float ks[MAXS];
shared float gs[MAXS];

void main() {
  const uint S = uint(ne(3, 0)), Hv = uint(ne(3, 1)), T = uint(ne(3, 2));
  const uint Hk = uint(ne(1, 1));
  const bool kda = P.ip[0].y == 3;  // g is [T, Hv, S]
  const uint n_slot = uint(ne(6, 2)), Pn = uint(ne(6, 3));
  const uint n_seg = uint(ne(7, 1));
  const uint g = gid_linear();
  const uint j = gl_LocalInvocationID.x;
  if (g >= n_seg * Hv) {  // zero uncovered tokens
    const uint i = (g - n_seg * Hv) * 128u + j;
    if (i >= T * Hv * S) return;
    const uint t = i / (Hv * S);
    for (uint r = 0u; r < n_seg; ++r) {
      const uint sb = tofs(7) + r * nb(7, 1);
      const uint t0 = rd32(7, sb), n = rd32(7, sb + 4u);
      if (t >= t0 && t < t0 + n) return;
    }
    wrf32(0, tofs(0) + 4u * i, 0.0);
    return;
  }
  const uint seg = g / Hv, h = g % Hv;
  const uint sb = tofs(7) + seg * nb(7, 1);
  const uint t0 = rd32(7, sb), n = rd32(7, sb + 4u), slot = rd32(7, sb + 8u), src = rd32(7, sb + 12u);
  if (n == 0u) return;  // uniform over the workgroup
  const uint hk = P.ip[0].x == 0 ? h % Hk : h / (Hv / Hk);
  const float scale = P.fp[0].x;
  const bool live = j < S;
  float m[MAXS];
  const uint plane_stride = n_slot * Hv * S * S;  // floats
  const uint col = ((slot * Hv) + h) * S * S + j;  // M[0][j] within a plane
  if (live)
    for (uint i = 0u; i < S; ++i) m[i] = rdf32(6, tofs(6) + 4u * (src * plane_stride + col + i * S));
  barrier();
  for (uint t = 0u; t < n; ++t) {
    const uint tt = t0 + t;
    if (j < S) {
      qs[j] = rdf32(1, tofs(1) + tt * nb(1, 2) + hk * nb(1, 1) + j * nb(1, 0));
      ks[j] = rdf32(2, tofs(2) + tt * nb(2, 2) + hk * nb(2, 1) + j * nb(2, 0));
      gs[j] = kda ? exp(rdf32(4, tofs(4) + tt * nb(4, 2) + h * nb(4, 1) + j * nb(4, 0))) : 0.0;
    }
    barrier();
    if (live) {
      const float beta = rdf32(5, tofs(5) + tt * nb(5, 1) + h * nb(5, 0));
      const float vj = rdf32(3, tofs(3) + tt * nb(3, 2) + h * nb(3, 1) + j * nb(3, 0));
      float u = 0.0;
      if (kda) {
        for (uint i = 0u; i < S; ++i) { m[i] *= gs[i]; u += m[i] * ks[i]; }
      } else {
        const float d = exp(rdf32(4, tofs(4) + tt * nb(4, 1) + h * nb(4, 0)));
        for (uint i = 0u; i < S; ++i) { m[i] *= d; u += m[i] * ks[i]; }
      }
      const float delta = beta * (vj - u);
      float o = 0.0;
      for (uint i = 0u; i < S; ++i) { m[i] += ks[i] * delta; o += m[i] * qs[i]; }
      wrf32(0, tofs(0) + 4u * ((tt * Hv + h) * S + j), scale * o);
      const uint back = n - 1u - t;  // tokens before the end after this one
      if (back < Pn)
        for (uint i = 0u; i < S; ++i) wrf32(6, tofs(6) + 4u * (back * plane_stride + col + i * S), m[i]);
    }
    barrier();
  }
}
