#version 450
// out[t, j, n] = x[t, (j,) :] . w[ids[t, j], n, :]  (x f32 [T, K] or [T, k, K]; w [E, N, K] of
// type WT). One thread per output element, a sequential sum over K. An expert id outside
// [0, E) gives 0 (the CPU kernel raises; routing never produces one).
#include "common.glsl"
#include "dequant.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const int WT = 0;

void main() {
  const uint N = uint(ne(0, 0)), kk = uint(ne(0, 1)), T = uint(ne(0, 2));
  const uint K = uint(ne(2, 0)), E = uint(ne(2, 2));
  const uint nblk = (N + 63u) / 64u;
  const uint g = gid_linear();
  const uint n = (g % nblk) * 64u + gl_LocalInvocationID.x, tj = g / nblk;
  if (n >= N || tj >= T * kk) return;
  const uint t = tj / kk, j = tj % kk;
  const int e = int(rd32(3, tofs(3) + t * nb(3, 1) + j * nb(3, 0)));
  float acc = 0.0;
  if (e >= 0 && uint(e) < E) {
    const bool x3 = P.ip[0].x == 3;
    const uint xb = x3 ? tofs(1) + t * nb(1, 2) + j * nb(1, 1) : tofs(1) + t * nb(1, 1);
    const uint wb = tofs(2) + uint(e) * nb(2, 2) + n * nb(2, 1);
    for (uint q = 0u; q < K; ++q) acc += deq(2, WT, wb, q) * rdf32(1, xb + 4u * q);
  }
  wrf32(0, tofs(0) + 4u * (tj * N + n), acc);
}
