#version 450
// Attention of q[T, Hq, D] over k[n_kv, Hkv, D] / v[n_kv, Hkv, Dv] (types KT / VT: F32, F16,
// Q8_0) with mask[T, n_kv] (added to the score; -inf hides a cell) and, when ip[0].x = 1, the
// walk order order[n_kv]. One workgroup per (token, query head). The threads score a tile of 64
// cells in parallel (each score a fixed sequential dot product of q * scale and k); then every
// thread walks the tile's visible cells in order with an online softmax for the output dims it
// owns, so a row's result depends only on the cells it sees and their order (batch invariant).
#include "common.glsl"
#include "dequant.glsl"
layout(local_size_x = 64) in;
layout(constant_id = 0) const int KT = 1;
layout(constant_id = 1) const int VT = 1;
const uint MAXD = 8u;  // output dims per thread: Dv <= 512
shared float sc[64];
shared float qs[512];

void main() {
  const uint D = uint(ne(1, 0)), Hq = uint(ne(1, 1)), T = uint(ne(1, 2));
  const uint Hkv = uint(ne(2, 1)), n_kv = uint(ne(2, 2)), Dv = uint(ne(3, 0));
  const uint g = gid_linear();
  if (g >= T * Hq) return;
  const uint t = g / Hq, hq = g % Hq, hk = hq / (Hq / Hkv);
  const uint tid = gl_LocalInvocationID.x;
  const float scale = P.fp[0].x;
  const bool has_order = P.ip[0].x != 0;
  const uint qb = tofs(1) + t * nb(1, 2) + hq * nb(1, 1);
  for (uint d = tid; d < D; d += 64u) qs[d] = rdf32(1, qb + 4u * d) * scale;
  const uint mb = tofs(4) + t * nb(4, 1);
  float acc[MAXD];
  for (uint j = 0u; j < MAXD; ++j) acc[j] = 0.0;
  float m = -1.0 / 0.0, l = 0.0;
  const float ninf = -1.0 / 0.0;
  barrier();
  for (uint c0 = 0u; c0 < n_kv; c0 += 64u) {
    // score of walk position c0 + tid
    float s = ninf;
    int cell = -1;
    const uint c = c0 + tid;
    if (c < n_kv) {
      cell = has_order ? int(rd32(5, tofs(5) + c * nb(5, 0))) : int(c);
      if (cell >= 0 && uint(cell) < n_kv) {
        const float mk = rdf32(4, mb + uint(cell) * nb(4, 0));
        if (mk != ninf) {
          const uint kb = tofs(2) + uint(cell) * nb(2, 2) + hk * nb(2, 1);
          float dot = 0.0;
          for (uint d = 0u; d < D; ++d) dot += qs[d] * deq(2, KT, kb, d);
          s = dot + mk;
        }
      }
    }
    sc[tid] = s;
    barrier();
    const uint nc = min(64u, n_kv - c0);
    for (uint i = 0u; i < nc; ++i) {
      const float si = sc[i];
      if (si == ninf) continue;
      const uint ci = uint(has_order ? int(rd32(5, tofs(5) + (c0 + i) * nb(5, 0))) : int(c0 + i));
      const uint vb = tofs(3) + ci * nb(3, 2) + hk * nb(3, 1);
      float cr = 1.0, e = 1.0;
      if (si > m) {
        cr = m == ninf ? 0.0 : exp(m - si);
        m = si;
        l = l * cr + 1.0;
      } else {
        e = exp(si - m);
        l += e;
      }
      for (uint j = 0u; j < MAXD; ++j) {
        const uint d = tid + 64u * j;
        if (d >= Dv) break;
        acc[j] = acc[j] * cr + e * deq(3, VT, vb, d);
      }
    }
    barrier();
  }
  const float inv = l > 0.0 ? 1.0 / l : 0.0;
  const uint ob = tofs(0) + 4u * ((t * Hq + hq) * Dv);
  for (uint j = 0u; j < MAXD; ++j) {
    const uint d = tid + 64u * j;
    if (d >= Dv) break;
    wrf32(0, ob + 4u * d, acc[j] * inv);
  }
}
