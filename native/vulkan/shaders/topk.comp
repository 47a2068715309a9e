#version 450
// Indices of the k (ip[0].x) largest values of each row, largest first, ties to the lower index,
// NaN below every number (NaNs among themselves by index). Exact for any row length: every element counts the elements that rank
// before it (one thread per element) and, if fewer than k do, writes its index at that rank.
#include "common.glsl"
layout(local_size_x = 256) in;

// element (vj, j) ranks before (vi, i)
bool before(float vj, uint j, float vi, uint i) {
  const bool nj = isnan(vj), ni = isnan(vi);
  if (nj || ni) return nj == ni ? j < i : ni;
  return vj > vi || (vj == vi && j < i);
}

void main() {
  const uint E = uint(ne(1, 0));
  const uint nchunk = (E + 255u) / 256u;
  const uint g = gid_linear();
  const uint row = g / nchunk, i = (g % nchunk) * 256u + gl_LocalInvocationID.x;
  if (row >= nelem(1) / E || i >= E) return;
  const uvec4 c = unflat(1, row * E);
  const uint base = roff(1, c.y, c.z, c.w);
  const float vi = rdf32(1, base + i * nb(1, 0));
  const uint k = uint(P.ip[0].x);
  uint rank = 0u;
  for (uint j = 0u; j < E && rank < k; ++j) {
    if (before(rdf32(1, base + j * nb(1, 0)), j, vi, i)) ++rank;
  }
  if (rank < k) B[0].w[(tofs(0) >> 2) + row * k + rank] = i;
}
