#version 450
// Row norms over the innermost dim: 0 rms_norm x / sqrt(mean(x^2) + eps), 1 l2_norm
// x / sqrt(sum(x^2) + eps). One workgroup per row; a fixed reduction tree.
#include "common.glsl"
layout(local_size_x = 128) in;
layout(constant_id = 0) const int NORM = 0;
shared float red[128];

void main() {
  const uint row = gid_linear();
  const uint n = uint(ne(1, 0));
  const uint nrows = nelem(0) / n;
  if (row >= nrows) return;
  const uint i1 = row % uint(ne(1, 1)), i2 = (row / uint(ne(1, 1))) % uint(ne(1, 2)), i3 = row / uint(ne(1, 1) * ne(1, 2));
  const uint base = roff(1, i1, i2, i3);
  const uint tid = gl_LocalInvocationID.x;
  float s = 0.0;
  for (uint k = tid; k < n; k += 128u) {
    const float x = rdf32(1, base + k * nb(1, 0));
    s += x * x;
  }
  red[tid] = s;
  barrier();
  for (uint w = 64u; w > 0u; w >>= 1) {
    if (tid < w) red[tid] += red[tid + w];
    barrier();
  }
  const float tot = red[0];
  const float scale = NORM == 0 ? 1.0 / sqrt(tot / float(n) + P.fp[0].x) : 1.0 / sqrt(tot + P.fp[0].x);
  for (uint k = tid; k < n; k += 128u) wrf32(0, tofs(0) + 4u * (row * n + k), rdf32(1, base + k * nb(1, 0)) * scale);
}
