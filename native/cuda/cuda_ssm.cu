// Recurrent ops with snapshot planes (algorithms.md §2, cpu/kernels/ssm.cpp): ssm_conv and the
// token-serial gated delta rule. Plane i of a segment's slot gets the state i tokens before the
// segment's end (i < min(n, P)), which is what speculative rollback selects; every thread reads
// its part of the source plane before writing any plane. Trailing blocks zero the output of
// tokens no segment covers.
#include "cuda/cuda_common.cuh"

namespace pyfast {
namespace cu {

namespace {

constexpr uint32_t MAXK = 16;   // ssm_conv kernel taps
constexpr uint32_t MAXS = 128;  // gated_delta_net head dim

// seqs rows (t0, n, slot, src_plane) of tensor t; true when token tt is inside some segment.
__device__ bool covered(const LaunchArgs& a, int t, uint32_t n_seg, uint32_t tt) {
  for (uint32_t r = 0u; r < n_seg; ++r) {
    const uint32_t sb = r * nb(a, t, 1);
    const uint32_t t0 = rd32(a, t, sb), n = rd32(a, t, sb + 4u);
    if (tt >= t0 && tt < t0 + n) return true;
  }
  return false;
}

// x [T, C], w [C, Kc], state [P, n_slot, Kc-1, C] (contiguous), seqs [n_seg, 4]. Blocks
// 0 .. n_seg * ceil(C / 64) - 1: one thread per (segment, channel).
__global__ void k_ssm_conv(const LaunchArgs a) {
  const uint32_t C = ne(a, 1, 0), T = ne(a, 1, 1);
  const uint32_t Kc = ne(a, 2, 0), K1 = Kc - 1u;
  const uint32_t n_slot = ne(a, 3, 2), Pn = ne(a, 3, 3);
  const uint32_t n_seg = ne(a, 4, 1);
  const uint32_t ncb = (C + 63u) / 64u;
  const uint32_t g = gid(), tid = threadIdx.x;
  if (g >= n_seg * ncb) {
    const uint32_t i = (g - n_seg * ncb) * 64u + tid;
    if (i >= T * C || covered(a, 4, n_seg, i / C)) return;
    wrf32(a, 0, 4u * i, 0.0f);
    return;
  }
  const uint32_t seg = g / ncb, c = (g % ncb) * 64u + tid;
  const uint32_t sb = seg * nb(a, 4, 1);
  const uint32_t t0 = rd32(a, 4, sb), n = rd32(a, 4, sb + 4u), slot = rd32(a, 4, sb + 8u), src = rd32(a, 4, sb + 12u);
  if (c >= C || n == 0u) return;
  float old[MAXK];
  const uint32_t stc = 4u * C;
  for (uint32_t r = 0u; r < K1; ++r) old[r] = rdf32(a, 3, ((src * n_slot + slot) * K1 + r) * stc + 4u * c);
  float wk[MAXK];
  for (uint32_t j = 0u; j < Kc; ++j) wk[j] = rdf32(a, 2, c * nb(a, 2, 1) + j * nb(a, 2, 0));
  for (uint32_t t = 0u; t < n; ++t) {
    float y = 0.0f;
    for (uint32_t j = 0u; j < Kc; ++j) {
      const uint32_t r = t + j;
      const float v = r < K1 ? old[r] : rdf32(a, 1, (t0 + r - K1) * nb(a, 1, 1) + c * nb(a, 1, 0));
      y += wk[j] * v;
    }
    wrf32(a, 0, 4u * ((t0 + t) * C + c), y);
  }
  const uint32_t n_snap = min(n, Pn);
  for (uint32_t i = 0u; i < n_snap; ++i)
    for (uint32_t r = 0u; r < K1; ++r) {
      const uint32_t q = n - i + r;  // window row
      const float v = q < K1 ? old[q] : rdf32(a, 1, (t0 + q - K1) * nb(a, 1, 1) + c * nb(a, 1, 0));
      wrf32(a, 3, ((i * n_slot + slot) * K1 + r) * stc + 4u * c, v);
    }
}

// q, k [T, Hk, S], v [T, Hv, S], g [T, Hv] or [T, Hv, S] (ip[1] = 3: per key), beta [T, Hv],
// state [P, n_slot, Hv, S*S] (M[i = key][j = value] row-major), seqs [n_seg, 4]. One block of
// 128 threads per (segment, value head); thread j owns column j of M (no reduction across
// threads). ip[0]: broadcast (0 tiled, 1 interleaved); fp[0]: scale.
__global__ void k_gated_delta_net(const LaunchArgs a) {
  __shared__ float qs[MAXS];
  __shared__ float ks[MAXS];
  __shared__ float gs[MAXS];
  const uint32_t S = ne(a, 3, 0), Hv = ne(a, 3, 1), T = ne(a, 3, 2);
  const uint32_t Hk = ne(a, 1, 1);
  const bool kda = a.P.ip[1] == 3;
  const uint32_t n_slot = ne(a, 6, 2), Pn = ne(a, 6, 3);
  const uint32_t n_seg = ne(a, 7, 1);
  const uint32_t g = gid(), j = threadIdx.x;
  if (g >= n_seg * Hv) {
    const uint32_t i = (g - n_seg * Hv) * 128u + j;
    if (i >= T * Hv * S || covered(a, 7, n_seg, i / (Hv * S))) return;
    wrf32(a, 0, 4u * i, 0.0f);
    return;
  }
  const uint32_t seg = g / Hv, h = g % Hv;
  const uint32_t sb = seg * nb(a, 7, 1);
  const uint32_t t0 = rd32(a, 7, sb), n = rd32(a, 7, sb + 4u), slot = rd32(a, 7, sb + 8u), src = rd32(a, 7, sb + 12u);
  if (n == 0u) return;  // uniform over the block
  const uint32_t hk = a.P.ip[0] == 0 ? h % Hk : h / (Hv / Hk);
  const float scale = a.P.fp[0];
  const bool live = j < S;
  float m[MAXS];
  const uint32_t plane_stride = n_slot * Hv * S * S;  // floats
  const uint32_t col = ((slot * Hv) + h) * S * S + j;
  if (live)
    for (uint32_t i = 0u; i < S; ++i) m[i] = rdf32(a, 6, 4u * (src * plane_stride + col + i * S));
  __syncthreads();
  for (uint32_t t = 0u; t < n; ++t) {
    const uint32_t tt = t0 + t;
    if (live) {
      qs[j] = rdf32(a, 1, tt * nb(a, 1, 2) + hk * nb(a, 1, 1) + j * nb(a, 1, 0));
      ks[j] = rdf32(a, 2, tt * nb(a, 2, 2) + hk * nb(a, 2, 1) + j * nb(a, 2, 0));
      gs[j] = kda ? expf(rdf32(a, 4, tt * nb(a, 4, 2) + h * nb(a, 4, 1) + j * nb(a, 4, 0))) : 0.0f;
    }
    __syncthreads();
    if (live) {
      const float beta = rdf32(a, 5, tt * nb(a, 5, 1) + h * nb(a, 5, 0));
      const float vj = rdf32(a, 3, tt * nb(a, 3, 2) + h * nb(a, 3, 1) + j * nb(a, 3, 0));
      float u = 0.0f;
      if (kda) {
        for (uint32_t i = 0u; i < S; ++i) { m[i] *= gs[i]; u += m[i] * ks[i]; }
      } else {
        const float d = expf(rdf32(a, 4, tt * nb(a, 4, 1) + h * nb(a, 4, 0)));
        for (uint32_t i = 0u; i < S; ++i) { m[i] *= d; u += m[i] * ks[i]; }
      }
      const float delta = beta * (vj - u);
      float o = 0.0f;
      for (uint32_t i = 0u; i < S; ++i) { m[i] += ks[i] * delta; o += m[i] * qs[i]; }
      wrf32(a, 0, 4u * ((tt * Hv + h) * S + j), scale * o);
      const uint32_t back = n - 1u - t;  // tokens before the end after this one
      if (back < Pn)
        for (uint32_t i = 0u; i < S; ++i) wrf32(a, 6, 4u * (back * plane_stride + col + i * S), m[i]);
    }
    __syncthreads();
  }
}

}  // namespace

void launch_ssm_conv(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_ssm_conv<<<g, 64, 0, s>>>(a); }
void launch_gated_delta_net(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) {
  k_gated_delta_net<<<g, 128, 0, s>>>(a);
}

}  // namespace cu
}  // namespace pyfast
