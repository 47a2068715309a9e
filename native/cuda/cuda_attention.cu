// Attention of q[T, Hq, D] over k[n_kv, Hkv, D] / v[n_kv, Hkv, Dv] (types kt / vt: F32, F16,
// Q8_0) with mask[T, n_kv] (added to the score; -inf hides a cell) and, when ip[0] = 1, the walk
// order order[n_kv]. One block of 64 threads per (token, query head): the threads score a tile of
// 64 cells in parallel (each a fixed sequential dot product of q * scale and k), then every
// thread walks the tile's visible cells in order with an online softmax for the output dims it
// owns, so a row's result depends only on the cells it sees and their order (batch invariant).
#include "cuda/cuda_common.cuh"

namespace pyfast {
namespace cu {

namespace {

constexpr uint32_t MAXD = 8;  // output dims per thread: Dv <= 512

__global__ void k_attention(const LaunchArgs a, int kt, int vt) {
  __shared__ float sc[64];
  __shared__ float qs[512];
  const uint32_t D = ne(a, 1, 0), Hq = ne(a, 1, 1), T = ne(a, 1, 2);
  const uint32_t Hkv = ne(a, 2, 1), n_kv = ne(a, 2, 2), Dv = ne(a, 3, 0);
  const uint32_t g = gid();
  if (g >= T * Hq) return;
  const uint32_t t = g / Hq, hq = g % Hq, hk = hq / (Hq / Hkv);
  const uint32_t tid = threadIdx.x;
  const float scale = a.P.fp[0];
  const bool has_order = a.P.ip[0] != 0;
  const float ninf = -INFINITY;
  const uint32_t qb = t * nb(a, 1, 2) + hq * nb(a, 1, 1);
  for (uint32_t d = tid; d < D; d += 64u) qs[d] = rdf32(a, 1, qb + 4u * d) * scale;
  const uint32_t mb = t * nb(a, 4, 1);
  float acc[MAXD];
  for (uint32_t j = 0u; j < MAXD; ++j) acc[j] = 0.0f;
  float m = ninf, l = 0.0f;
  __syncthreads();
  for (uint32_t c0 = 0u; c0 < n_kv; c0 += 64u) {
    float s = ninf;
    const uint32_t c = c0 + tid;
    if (c < n_kv) {
      const int cell = has_order ? (int)rd32(a, 5, c * nb(a, 5, 0)) : (int)c;
      if (cell >= 0 && (uint32_t)cell < n_kv) {
        const float mk = rdf32(a, 4, mb + (uint32_t)cell * nb(a, 4, 0));
        if (mk != ninf) {
          const uint32_t kb = (uint32_t)cell * nb(a, 2, 2) + hk * nb(a, 2, 1);
          float dot = 0.0f;
          for (uint32_t d = 0u; d < D; ++d) dot += qs[d] * deq(a, 2, kt, kb, d);
          s = dot + mk;
        }
      }
    }
    sc[tid] = s;
    __syncthreads();
    const uint32_t nc = min(64u, n_kv - c0);
    for (uint32_t i = 0u; i < nc; ++i) {
      const float si = sc[i];
      if (si == ninf) continue;
      const uint32_t ci = has_order ? (uint32_t)(int)rd32(a, 5, (c0 + i) * nb(a, 5, 0)) : c0 + i;
      const uint32_t vb = ci * nb(a, 3, 2) + hk * nb(a, 3, 1);
      float cr = 1.0f, e = 1.0f;
      if (si > m) {
        cr = m == ninf ? 0.0f : expf(m - si);
        m = si;
        l = l * cr + 1.0f;
      } else {
        e = expf(si - m);
        l += e;
      }
      for (uint32_t j = 0u; j < MAXD; ++j) {
        const uint32_t d = tid + 64u * j;
        if (d >= Dv) break;
        acc[j] = acc[j] * cr + e * deq(a, 3, vt, vb, d);
      }
    }
    __syncthreads();
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  const uint32_t ob = 4u * ((t * Hq + hq) * Dv);
  for (uint32_t j = 0u; j < MAXD; ++j) {
    const uint32_t d = tid + 64u * j;
    if (d >= Dv) break;
    wrf32(a, 0, ob + 4u * d, acc[j] * inv);
  }
}

}  // namespace

void launch_attention(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) {
  k_attention<<<g, 64, 0, s>>>(a, spec[0], spec[1]);
}

}  // namespace cu
}  // namespace pyfast
