#version 450
// out[r, ...] = table[ids[r], ...] decoded to f32 (table type: spec constant TY). The table row
// is dims[1:], read as runs of its (contiguous) innermost dim.
#include "common.glsl"
#include "dequant.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int TY = 0;

void main() {
  // table dims innermost first: ne(1,0) = run length, then up to two more row dims, outermost = V
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= nelem(0)) return;
  const int nd = P.ip[0].x;  // table ndim
  const uint n0 = uint(ne(1, 0));
  uint row_elems = 1u;
  for (int d = 0; d < nd - 1; ++d) row_elems *= uint(ne(1, d));
  const uint r = i / row_elems, e = i % row_elems;
  const int id = int(rd32(2, tofs(2) + r * nb(2, 0)));
  const int V = ne(1, nd - 1);
  float v = 0.0;
  if (id >= 0 && id < V) {
    const uint e0 = e % n0, rest = e / n0;
    uint base = tofs(1) + uint(id) * nb(1, nd - 1);
    if (nd >= 3) base += (rest % uint(ne(1, 1))) * nb(1, 1);
    if (nd >= 4) base += (rest / uint(ne(1, 1))) * nb(1, 2);
    v = deq(1, TY, base, e0);
  }
  wrf32(0, tofs(0) + 4u * i, v);
}
