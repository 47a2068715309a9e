#version 450
// Index of the maximum of each row, as numpy's argmax: the first NaN if there is one, else the
// first of the largest values. One workgroup per row; a fixed reduction tree.
#include "common.glsl"
layout(local_size_x = 128) in;
shared float rv[128];
shared int ri[128];

// (v, i) ranks before (w, j)
bool better(float v, int i, float w, int j) {
  if (j < 0) return i >= 0;
  if (i < 0) return false;
  const bool vn = isnan(v), wn = isnan(w);
  if (vn != wn) return vn;
  if (vn || v == w) return i < j;
  return v > w;
}

void main() {
  const uint row = gid_linear();
  const uint n = uint(ne(1, 0));
  if (row >= nelem(1) / n) return;
  const uvec4 c = unflat(1, row * n);
  const uint base = roff(1, c.y, c.z, c.w);
  const uint tid = gl_LocalInvocationID.x;
  float best = 0.0;
  int bi = -1;
  for (uint k = tid; k < n; k += 128u) {
    const float v = rdf32(1, base + k * nb(1, 0));
    if (better(v, int(k), best, bi)) { best = v; bi = int(k); }
  }
  rv[tid] = best;
  ri[tid] = bi;
  barrier();
  for (uint w = 64u; w > 0u; w >>= 1) {
    if (tid < w && better(rv[tid + w], ri[tid + w], rv[tid], ri[tid])) { rv[tid] = rv[tid + w]; ri[tid] = ri[tid + w]; }
    barrier();
  }
  if (tid == 0u) B[0].w[(tofs(0) >> 2) + row] = uint(ri[0] < 0 ? 0 : ri[0]);
}
