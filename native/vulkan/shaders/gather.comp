#version 450
// out[..., j] = a[..., ids[..., j]] (take along the last dim). An id outside [0, E) gives 0 (the
// CPU kernel raises; the graph's callers never pass one).
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= nelem(0)) return;
  const uvec4 c = unflat(0, i);
  const int id = int(rd32(2, eoff(2, c.x, c.y, c.z, c.w)));
  float v = 0.0;
  if (id >= 0 && id < ne(1, 0)) v = rdf32(1, eoff(1, uint(id), c.y, c.z, c.w));
  wrf32(0, tofs(0) + 4u * i, v);
}
