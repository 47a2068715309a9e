#version 450
// Sum over one dim of a (ip[0].y: that dim counted innermost first), which the output drops.
// One thread per output element, adding in index order.
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= nelem(0)) return;
  const int da = P.ip[0].y;
  const uvec4 co = unflat(0, i);
  uvec4 ca = uvec4(0u);
  for (int d = 0; d < 4; ++d) {
    if (d < da) ca[d] = co[d];
    else if (d > da) ca[d] = co[d - 1];
  }
  const uint L = uint(ne(1, da));
  float s = 0.0;
  for (uint l = 0u; l < L; ++l) {
    ca[da] = l;
    s += rdf32(1, eoff(1, ca.x, ca.y, ca.z, ca.w));
  }
  wrf32(0, tofs(0) + 4u * i, s);
}
