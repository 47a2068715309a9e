#version 450
// a (op) b with b broadcast to a's shape (a dim of 1 repeats): 0 add, 1 mul, 2 swiglu
// (silu(a) * b, same shapes). Sources may be strided; the output is contiguous.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int BOP = 0;

void main() {
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= nelem(0)) return;
  const uvec4 c = unflat(0, i);
  const float a = rdf32(1, eoff(1, c.x, c.y, c.z, c.w));
  const uvec4 cb = uvec4(ne(2, 0) == 1 ? 0u : c.x, ne(2, 1) == 1 ? 0u : c.y, ne(2, 2) == 1 ? 0u : c.z,
                         ne(2, 3) == 1 ? 0u : c.w);
  const float b = rdf32(2, eoff(2, cb.x, cb.y, cb.z, cb.w));
  float y;
  if (BOP == 0) y = a + b;
  else if (BOP == 1) y = a * b;
  else y = a / (1.0 + exp(-a)) * b;
  wrf32(0, tofs(0) + 4u * i, y);
}
