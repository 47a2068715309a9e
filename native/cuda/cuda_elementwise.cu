// Elementwise ops, norms, softmax, rope, argmax, and data movement (get_rows, cpy, set_rows,
// concat, sum, gather). Semantics as the Vulkan shaders of the same names (native/vulkan/shaders).
#include "cuda/cuda_common.cuh"

namespace pyfast {
namespace cu {

namespace {

// Elementwise f32 -> f32: 0 scale (fp[0]), 1 silu, 2 sigmoid, 3 softplus, 4 relu. Source may be
// strided.
__global__ void k_unary(const LaunchArgs a, int op) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  const U4 c = unflat(a, 0, i);
  const float x = rdf32(a, 1, eoff(a, 1, c.x, c.y, c.z, c.w));
  float y;
  if (op == 0) y = x * a.P.fp[0];
  else if (op == 1) y = x / (1.0f + expf(-x));
  else if (op == 2) y = 1.0f / (1.0f + expf(-x));
  else if (op == 3) y = x > 20.0f ? x : logf(1.0f + expf(x));
  else y = x > 0.0f ? x : 0.0f;
  wrf32(a, 0, 4u * i, y);
}

// a (op) b with b broadcast to a's shape: 0 add, 1 mul, 2 swiglu (silu(a) * b).
__global__ void k_binary(const LaunchArgs a, int op) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  const U4 c = unflat(a, 0, i);
  const float x = rdf32(a, 1, eoff(a, 1, c.x, c.y, c.z, c.w));
  const uint32_t b0 = ne(a, 2, 0) == 1 ? 0u : c.x, b1 = ne(a, 2, 1) == 1 ? 0u : c.y;
  const uint32_t b2 = ne(a, 2, 2) == 1 ? 0u : c.z, b3 = ne(a, 2, 3) == 1 ? 0u : c.w;
  const float b = rdf32(a, 2, eoff(a, 2, b0, b1, b2, b3));
  float y;
  if (op == 0) y = x + b;
  else if (op == 1) y = x * b;
  else y = x / (1.0f + expf(-x)) * b;
  wrf32(a, 0, 4u * i, y);
}

// Block-wide reduction over 128 threads with a fixed tree (max when is_max, else sum).
__device__ float reduce128(float v, float* red, bool is_max) {
  const uint32_t tid = threadIdx.x;
  red[tid] = v;
  __syncthreads();
  for (uint32_t w = 64u; w > 0u; w >>= 1) {
    if (tid < w) red[tid] = is_max ? fmaxf(red[tid], red[tid + w]) : red[tid] + red[tid + w];
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();
  return r;
}

// Row norms over the innermost dim: 0 rms_norm, 1 l2_norm. One block per row.
__global__ void k_norm(const LaunchArgs a, int kind) {
  __shared__ float red[128];
  const uint32_t row = gid();
  const uint32_t n = (uint32_t)ne(a, 1, 0);
  if (row >= nelem(a, 0) / n) return;
  const uint32_t i1 = row % (uint32_t)ne(a, 1, 1), i2 = (row / (uint32_t)ne(a, 1, 1)) % (uint32_t)ne(a, 1, 2);
  const uint32_t i3 = row / ((uint32_t)ne(a, 1, 1) * (uint32_t)ne(a, 1, 2));
  const uint32_t base = roff(a, 1, i1, i2, i3);
  float s = 0.0f;
  for (uint32_t k = threadIdx.x; k < n; k += 128u) {
    const float x = rdf32(a, 1, base + k * nb(a, 1, 0));
    s += x * x;
  }
  const float tot = reduce128(s, red, false);
  const float scale = kind == 0 ? 1.0f / sqrtf(tot / (float)n + a.P.fp[0]) : 1.0f / sqrtf(tot + a.P.fp[0]);
  for (uint32_t k = threadIdx.x; k < n; k += 128u)
    wrf32(a, 0, 4u * (row * n + k), rdf32(a, 1, base + k * nb(a, 1, 0)) * scale);
}

// softmax(x * scale + mask) over the innermost dim; mask (optional, ip[0] = 1) broadcasts.
__global__ void k_softmax(const LaunchArgs a) {
  __shared__ float red[128];
  const uint32_t row = gid();
  const uint32_t n = (uint32_t)ne(a, 1, 0);
  if (row >= nelem(a, 0) / n) return;
  const U4 c = unflat(a, 0, row * n);
  const uint32_t base = roff(a, 1, c.y, c.z, c.w);
  const bool has_mask = a.P.ip[0] != 0;
  uint32_t mbase = 0u, mst = 0u;
  if (has_mask) {
    mbase = roff(a, 2, ne(a, 2, 1) == 1 ? 0u : c.y, ne(a, 2, 2) == 1 ? 0u : c.z, ne(a, 2, 3) == 1 ? 0u : c.w);
    mst = ne(a, 2, 0) == 1 ? 0u : nb(a, 2, 0);
  }
  const float scale = a.P.fp[0];
  const float ninf = -INFINITY;
  float mx = ninf;
  for (uint32_t k = threadIdx.x; k < n; k += 128u) {
    float v = rdf32(a, 1, base + k * nb(a, 1, 0)) * scale;
    if (has_mask) v += rdf32(a, 2, mbase + k * mst);
    mx = fmaxf(mx, v);
  }
  mx = reduce128(mx, red, true);
  float s = 0.0f;
  for (uint32_t k = threadIdx.x; k < n; k += 128u) {
    float v = rdf32(a, 1, base + k * nb(a, 1, 0)) * scale;
    if (has_mask) v += rdf32(a, 2, mbase + k * mst);
    const float e = mx == ninf ? 0.0f : expf(v - mx);
    wrf32(a, 0, 4u * (row * n + k), e);
    s += e;
  }
  const float tot = reduce128(s, red, false);
  const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;
  for (uint32_t k = threadIdx.x; k < n; k += 128u) {
    const uint32_t o = 4u * (row * n + k);
    wrf32(a, 0, o, rdf32(a, 0, o) * inv);
  }
}

// (v, i) ranks before (w, j): numpy's argmax (the first NaN, else the first of the largest).
__device__ bool better(float v, int i, float w, int j) {
  if (j < 0) return i >= 0;
  if (i < 0) return false;
  const bool vn = isnan(v), wn = isnan(w);
  if (vn != wn) return vn;
  if (vn || v == w) return i < j;
  return v > w;
}

__global__ void k_argmax(const LaunchArgs a) {
  __shared__ float rv[128];
  __shared__ int ri[128];
  const uint32_t row = gid();
  const uint32_t n = (uint32_t)ne(a, 1, 0);
  if (row >= nelem(a, 1) / n) return;
  const U4 c = unflat(a, 1, row * n);
  const uint32_t base = roff(a, 1, c.y, c.z, c.w);
  const uint32_t tid = threadIdx.x;
  float best = 0.0f;
  int bi = -1;
  for (uint32_t k = tid; k < n; k += 128u) {
    const float v = rdf32(a, 1, base + k * nb(a, 1, 0));
    if (better(v, (int)k, best, bi)) { best = v; bi = (int)k; }
  }
  rv[tid] = best;
  ri[tid] = bi;
  __syncthreads();
  for (uint32_t w = 64u; w > 0u; w >>= 1) {
    if (tid < w && better(rv[tid + w], ri[tid + w], rv[tid], ri[tid])) { rv[tid] = rv[tid + w]; ri[tid] = ri[tid + w]; }
    __syncthreads();
  }
  if (tid == 0u) reinterpret_cast<int32_t*>(a.B[0])[row] = ri[0] < 0 ? 0 : ri[0];
}

// Rotary embedding of x[T, H, D] by pos[T] (cpu/kernels/rope.cpp): ip[0] n_dims, ip[1] mode (0
// normal: pairs (2i, 2i+1), 2 neox: (i, i + n_dims/2)), ip[2] = 1: freq_factors[n_dims/2] (tensor
// 3) divide the frequencies; fp[0] freq_base, fp[1] freq_scale, fp[2] ext_factor (YaRN: mix the
// unscaled angle back in along a ramp over pairs [fp[4], fp[5]] and scale cos / sin by
// 1 + 0.1 ln(1 / freq_scale)), fp[3] attn_factor. Angles in double, as the CPU's. Dims past n_dims
// pass through. One thread per (token, head, pair or pass-through element).
__global__ void k_rope(const LaunchArgs a) {
  const uint32_t D = ne(a, 1, 0), H = ne(a, 1, 1), T = ne(a, 1, 2);
  const uint32_t n_dims = (uint32_t)a.P.ip[0];
  const uint32_t half_ = n_dims / 2u;
  const uint32_t per = half_ + (D - n_dims);
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= T * H * per) return;
  const uint32_t k = i % per, h = (i / per) % H, t = i / (per * H);
  const uint32_t xin = t * nb(a, 1, 2) + h * nb(a, 1, 1);
  const uint32_t out = 4u * ((t * H + h) * D);
  if (k >= half_) {
    const uint32_t d = n_dims + (k - half_);
    wrf32(a, 0, out + 4u * d, rdf32(a, 1, xin + d * nb(a, 1, 0)));
    return;
  }
  const double p = (double)(int)rd32(a, 2, t * nb(a, 2, 0));
  const double fscale = a.P.fp[1], ext = a.P.fp[2];
  double inv = pow((double)a.P.fp[0], -2.0 * (double)k / (double)n_dims);
  if (a.P.ip[2]) inv /= (double)rdf32(a, 3, k * nb(a, 3, 0));
  double theta = p * fscale * inv, mscale = a.P.fp[3];
  if (ext != 0.0) {
    const double lo = a.P.fp[4], hi = a.P.fp[5];
    const double y = ((double)k - lo) / fmax(0.001, hi - lo);
    const double mix = (1.0 - fmin(1.0, fmax(0.0, y))) * ext;
    theta = theta * (1.0 - mix) + p * inv * mix;
    mscale *= 1.0 + 0.1 * log(1.0 / fscale);
  }
  const float cs = (float)(cos(theta) * mscale), sn = (float)(sin(theta) * mscale);
  uint32_t i0, i1;
  if (a.P.ip[1] == 2) { i0 = k; i1 = k + half_; }
  else { i0 = 2u * k; i1 = 2u * k + 1u; }
  const float x0 = rdf32(a, 1, xin + i0 * nb(a, 1, 0)), x1 = rdf32(a, 1, xin + i1 * nb(a, 1, 0));
  wrf32(a, 0, out + 4u * i0, x0 * cs - x1 * sn);
  wrf32(a, 0, out + 4u * i1, x0 * sn + x1 * cs);
}

// out[r, ...] = table[ids[r], ...] decoded to f32 (table type ty; ip[0]: table ndim).
__global__ void k_get_rows(const LaunchArgs a, int ty) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  const int nd = a.P.ip[0];
  const uint32_t n0 = ne(a, 1, 0);
  uint32_t row_elems = 1u;
  for (int d = 0; d < nd - 1; ++d) row_elems *= (uint32_t)ne(a, 1, d);
  const uint32_t r = i / row_elems, e = i % row_elems;
  const int id = (int)rd32(a, 2, r * nb(a, 2, 0));
  const int V = ne(a, 1, nd - 1);
  float v = 0.0f;
  if (id >= 0 && id < V) {
    const uint32_t e0 = e % n0, rest = e / n0;
    uint32_t base = (uint32_t)id * nb(a, 1, nd - 1);
    if (nd >= 3) base += (rest % (uint32_t)ne(a, 1, 1)) * nb(a, 1, 1);
    if (nd >= 4) base += (rest / (uint32_t)ne(a, 1, 1)) * nb(a, 1, 2);
    v = deq(a, 1, ty, base, e0);
  }
  wrf32(a, 0, 4u * i, v);
}

// Contiguous copy with conversion: source type st (any float or block type) to dt (F32, F16,
// BF16). One thread per element.
__global__ void k_cpy(const LaunchArgs a, int st, int dt) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  const U4 c = unflat(a, 1, i);
  float v;
  if (st == T_F32 || st == T_F16 || st == T_BF16) v = rdt(a, 1, st, eoff(a, 1, c.x, c.y, c.z, c.w));
  else v = deq(a, 1, st, roff(a, 1, c.y, c.z, c.w), c.x);
  if (dt == T_F32) wrf32(a, 0, 4u * i, v);
  else wr16(a, 0, 2u * i, dt == T_F16 ? to_f16(v) : to_bf16(v));
}

// src [R, ...] f32: element e of row r (row = dims[1:], flattened); ip[1]: src ndim.
__device__ float set_rows_src(const LaunchArgs& a, uint32_t r, uint32_t e) {
  const uint32_t n0 = ne(a, 2, 0);
  const int nd = a.P.ip[1];
  uint32_t b = r * nb(a, 2, nd - 1);
  const uint32_t e0 = e % n0, rest = e / n0;
  if (nd >= 3) b += (rest % (uint32_t)ne(a, 2, 1)) * nb(a, 2, 1);
  if (nd >= 4) b += (rest / (uint32_t)ne(a, 2, 1)) * nb(a, 2, 2);
  return rdf32(a, 2, b + e0 * nb(a, 2, 0));
}

// dst[idx[r], ...] = src[r, ...] converted to dst's type dt (F32 / F16 / BF16: an element per
// thread; Q8_0: a block per thread, d = amax / 127, q = round(x / d), halves away from zero).
// Indices outside dst are skipped. ip[0]: dst ndim.
__global__ void k_set_rows(const LaunchArgs a, int dt) {
  const int nd = a.P.ip[0];
  const uint32_t R = ne(a, 3, 0);
  uint32_t row_elems = 1u;
  for (int d = 0; d < nd - 1; ++d) row_elems *= (uint32_t)ne(a, 0, d);
  const uint32_t unit = dt == T_Q8_0 ? 32u : 1u;
  const uint32_t per_row = row_elems / unit;
  const uint32_t i = gid() * 64u + threadIdx.x;
  if (i >= R * per_row) return;
  const uint32_t r = i / per_row, u = i % per_row;
  const int id = (int)rd32(a, 3, r * nb(a, 3, 0));
  if (id < 0 || id >= ne(a, 0, nd - 1)) return;
  const uint32_t rb = (uint32_t)id * nb(a, 0, nd - 1);
  if (dt == T_F32) {
    wrf32(a, 0, rb + 4u * u, set_rows_src(a, r, u));
  } else if (dt == T_F16 || dt == T_BF16) {
    const float v = set_rows_src(a, r, u);
    wr16(a, 0, rb + 2u * u, dt == T_F16 ? to_f16(v) : to_bf16(v));
  } else {
    float v[32];
    float amax = 0.0f;
    for (uint32_t e = 0u; e < 32u; ++e) {
      v[e] = set_rows_src(a, r, 32u * u + e);
      amax = fmaxf(amax, fabsf(v[e]));
    }
    const float d = amax / 127.0f;
    const float id_ = d != 0.0f ? 1.0f / d : 0.0f;
    const uint32_t bb = rb + 34u * u;
    wr16(a, 0, bb, to_f16(d));
    for (uint32_t e = 0u; e < 32u; ++e) {
      const float s = v[e] * id_;
      const int q = (int)(copysignf(1.0f, s) * floorf(fabsf(s) + 0.5f));
      a.B[0][bb + 2u + e] = (uint8_t)(q & 0xff);
    }
  }
}

// a and b joined along dim ip[1] (innermost first); sources may be strided.
__global__ void k_concat(const LaunchArgs a) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  U4 c = unflat(a, 0, i);
  uint32_t cc[4] = {c.x, c.y, c.z, c.w};
  const int d = a.P.ip[1];
  const uint32_t na = ne(a, 1, d);
  float v;
  if (cc[d] < na) {
    v = rdf32(a, 1, eoff(a, 1, cc[0], cc[1], cc[2], cc[3]));
  } else {
    cc[d] -= na;
    v = rdf32(a, 2, eoff(a, 2, cc[0], cc[1], cc[2], cc[3]));
  }
  wrf32(a, 0, 4u * i, v);
}

// Sum over dim ip[1] (innermost first) of a, which the output drops; in index order.
__global__ void k_sum(const LaunchArgs a) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  const int da = a.P.ip[1];
  const U4 co = unflat(a, 0, i);
  const uint32_t o[4] = {co.x, co.y, co.z, co.w};
  uint32_t ca[4] = {0u, 0u, 0u, 0u};
  for (int d = 0; d < 4; ++d) {
    if (d < da) ca[d] = o[d];
    else if (d > da) ca[d] = o[d - 1];
  }
  const uint32_t L = ne(a, 1, da);
  float s = 0.0f;
  for (uint32_t l = 0u; l < L; ++l) {
    ca[da] = l;
    s += rdf32(a, 1, eoff(a, 1, ca[0], ca[1], ca[2], ca[3]));
  }
  wrf32(a, 0, 4u * i, s);
}

// out[..., j] = a[..., ids[..., j]]; an id outside [0, E) gives 0.
__global__ void k_gather(const LaunchArgs a) {
  const uint32_t i = gid() * 256u + threadIdx.x;
  if (i >= nelem(a, 0)) return;
  const U4 c = unflat(a, 0, i);
  const int id = (int)rd32(a, 2, eoff(a, 2, c.x, c.y, c.z, c.w));
  float v = 0.0f;
  if (id >= 0 && id < ne(a, 1, 0)) v = rdf32(a, 1, eoff(a, 1, (uint32_t)id, c.y, c.z, c.w));
  wrf32(a, 0, 4u * i, v);
}

}  // namespace

void launch_unary(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_unary<<<g, 256, 0, s>>>(a, spec[0]); }
void launch_binary(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_binary<<<g, 256, 0, s>>>(a, spec[0]); }
void launch_norm(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_norm<<<g, 128, 0, s>>>(a, spec[0]); }
void launch_softmax(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_softmax<<<g, 128, 0, s>>>(a); }
void launch_argmax(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_argmax<<<g, 128, 0, s>>>(a); }
void launch_rope(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_rope<<<g, 256, 0, s>>>(a); }
void launch_get_rows(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_get_rows<<<g, 256, 0, s>>>(a, spec[0]); }
void launch_cpy(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_cpy<<<g, 256, 0, s>>>(a, spec[0], spec[1]); }
void launch_set_rows(const LaunchArgs& a, uint32_t g, const int32_t* spec, cudaStream_t s) { k_set_rows<<<g, 64, 0, s>>>(a, spec[0]); }
void launch_concat(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_concat<<<g, 256, 0, s>>>(a); }
void launch_sum(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_sum<<<g, 256, 0, s>>>(a); }
void launch_gather(const LaunchArgs& a, uint32_t g, const int32_t*, cudaStream_t s) { k_gather<<<g, 256, 0, s>>>(a); }

}  // namespace cu
}  // namespace pyfast
