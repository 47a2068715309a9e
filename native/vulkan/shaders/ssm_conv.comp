#version 450
// Causal depthwise conv per segment with state windows (see cpu/kernels/ssm.cpp): x [T, C],
// w [C, Kc], state [P, n_slot, Kc-1, C], seqs [n_seg, 4] rows (t0, n, slot, src_plane).
// Workgroups 0 .. n_seg * ceil(C / 64) - 1: one thread per (segment, channel), which reads the
// source plane's window first, then writes y and the snapshot planes (plane i = the Kc-1 inputs
// ending i tokens before the segment's end, i < min(n, P)). The remaining workgroups zero the
// output of tokens no segment covers.
#include "common.glsl"
layout(local_size_x = 64) in;
const int MAXK = 16;  // Kc <= MAXK

void main() {
  const uint C = uint(ne(1, 0)), T = uint(ne(1, 1));
  const uint Kc = uint(ne(2, 0)), K1 = Kc - 1u;
  const uint n_slot = uint(ne(3, 2)), Pn = uint(ne(3, 3));
  const uint n_seg = uint(ne(4, 1));
  const uint ncb = (C + 63u) / 64u;
  const uint g = gid_linear();
  const uint tid = gl_LocalInvocationID.x;
  if (g >= n_seg * ncb) {  // zero uncovered tokens
    const uint i = (g - n_seg * ncb) * 64u + tid;
    if (i >= T * C) return;
    const uint t = i / C;
    for (uint r = 0u; r < n_seg; ++r) {
      const uint sb = tofs(4) + r * nb(4, 1);
      const uint t0 = rd32(4, sb), n = rd32(4, sb + 4u);
      if (t >= t0 && t < t0 + n) return;
    }
    wrf32(0, tofs(0) + 4u * i, 0.0);
    return;
  }
  const uint seg = g / ncb, c = (g % ncb) * 64u + tid;
  const uint sb = tofs(4) + seg * nb(4, 1);
  const uint t0 = rd32(4, sb), n = rd32(4, sb + 4u), slot = rd32(4, sb + 8u), src = rd32(4, sb + 12u);
  if (c >= C || n == 0u) return;
  float old[MAXK];
  const uint stc = 4u * C;  // state is contiguous
  for (uint r = 0u; r < K1; ++r) old[r] = rdf32(3, tofs(3) + ((src * n_slot + slot) * K1 + r) * stc + 4u * c);
  float wk[MAXK];
  for (uint j = 0u; j < Kc; ++j) wk[j] = rdf32(2, tofs(2) + c * nb(2, 1) + j * nb(2, 0));
  for (uint t = 0u; t < n; ++t) {
    float y = 0.0;
    for (uint j = 0u; j < Kc; ++j) {
      const uint r = t + j;
      const float v = r < K1 ? old[r] : rdf32(1, tofs(1) + (t0 + r - K1) * nb(1, 1) + c * nb(1, 0));
      y += wk[j] * v;
    }
    wrf32(0, tofs(0) + 4u * ((t0 + t) * C + c), y);
  }
  const uint n_snap = min(n, Pn);
  for (uint i = 0u; i < n_snap; ++i)
    for (uint r = 0u; r < K1; ++r) {
      const uint q = n - i + r;  // window row
      const float v = q < K1 ? old[q] : rdf32(1, tofs(1) + (t0 + q - K1) * nb(1, 1) + c * nb(1, 0));
      wrf32(3, tofs(3) + ((i * n_slot + slot) * K1 + r) * stc + 4u * c, v);
    }
}
