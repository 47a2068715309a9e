#version 450
// softmax(x * scale + mask) over the innermost dim; mask (optional, ip[0] = 1) broadcasts.
#include "common.glsl"
layout(local_size_x = 128) in;
shared float red[128];

void main() {
  const uint row = gid_linear();
  const uint n = uint(ne(1, 0));
  if (row >= nelem(0) / n) return;
  const uvec4 c = unflat(0, row * n);
  const uint base = roff(1, c.y, c.z, c.w);
  const bool has_mask = P.ip[0].x != 0;
  uint mbase = 0u;
  if (has_mask)
    mbase = roff(2, ne(2, 1) == 1 ? 0u : c.y, ne(2, 2) == 1 ? 0u : c.z, ne(2, 3) == 1 ? 0u : c.w);
  const uint mst = has_mask ? (ne(2, 0) == 1 ? 0u : nb(2, 0)) : 0u;
  const float scale = P.fp[0].x;
  const uint tid = gl_LocalInvocationID.x;
  float mx = -1.0 / 0.0;
  for (uint k = tid; k < n; k += 128u) {
    float v = rdf32(1, base + k * nb(1, 0)) * scale;
    if (has_mask) v += rdf32(2, mbase + k * mst);
    mx = max(mx, v);
  }
  red[tid] = mx;
  barrier();
  for (uint w = 64u; w > 0u; w >>= 1) {
    if (tid < w) red[tid] = max(red[tid], red[tid + w]);
    barrier();
  }
  mx = red[0];
  barrier();
  float s = 0.0;
  for (uint k = tid; k < n; k += 128u) {
    float v = rdf32(1, base + k * nb(1, 0)) * scale;
    if (has_mask) v += rdf32(2, mbase + k * mst);
    const float e = mx == -1.0 / 0.0 ? 0.0 : exp(v - mx);
    wrf32(0, tofs(0) + 4u * (row * n + k), e);
    s += e;
  }
  red[tid] = s;
  barrier();
  for (uint w = 64u; w > 0u; w >>= 1) {
    if (tid < w) red[tid] += red[tid + w];
    barrier();
  }
  const float inv = red[0] > 0.0 ? 1.0 / red[0] : 0.0;
  for (uint k = tid; k < n; k += 128u) {
    const uint o = tofs(0) + 4u * (row * n + k);
    wrf32(0, o, rdf32(0, o) * inv);
  }
}
