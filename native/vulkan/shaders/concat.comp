#version 450
// a and b joined along axis ip[0].x (given innermost first: ip[0].y); sources may be strided.
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= nelem(0)) return;
  uvec4 c = unflat(0, i);
  const int d = P.ip[0].y;
  const uint na = uint(ne(1, d));
  float v;
  if (c[d] < na) {
    v = rdf32(1, eoff(1, c.x, c.y, c.z, c.w));
  } else {
    c[d] -= na;
    v = rdf32(2, eoff(2, c.x, c.y, c.z, c.w));
  }
  wrf32(0, tofs(0) + 4u * i, v);
}
