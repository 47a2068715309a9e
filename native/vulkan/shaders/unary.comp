#version 450
// Elementwise f32 -> f32: 0 scale (fp[0]), 1 silu, 2 sigmoid, 3 softplus. Source may be strided.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int UOP = 0;

void main() {
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= nelem(0)) return;
  const uvec4 c = unflat(0, i);
  const float x = rdf32(1, eoff(1, c.x, c.y, c.z, c.w));
  float y;
  if (UOP == 0) y = x * P.fp[0].x;
  else if (UOP == 1) y = x / (1.0 + exp(-x));
  else if (UOP == 2) y = 1.0 / (1.0 + exp(-x));
  else y = x > 20.0 ? x : log(1.0 + exp(x));
  wrf32(0, tofs(0) + 4u * i, y);
}
