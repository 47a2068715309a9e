// Fused attention (flash-attention style, online softmax) with grouped-query heads.
//
// Batch invariance: each query row walks the KV cells one at a time in a fixed order (the
// `order` input, or cell order), skipping masked cells entirely, so its result depends only
// on the cells it may see and their order - not on the batch, the padding of n_kv, or how
// cells of other sequences are interleaved. Query rows of one KV head are processed in
// tiles that share each K/V row conversion, with exactly the per-row arithmetic of a tile of 1.
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu/kernels/common.h"

namespace pyfast {

namespace {

constexpr int kTile = 8;  // query rows per tile

// Dot product with a fixed 8-lane order; the AVX2 and scalar versions differ only in speed
// (they are separate ISAs and need not agree bit for bit).
inline float dot_scalar(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

inline void axpy_scale_scalar(float* acc, float c, const float* v, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] * c + w * v[i];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  for (; i < n; ++i) t[i & 7] += a[i] * b[i];
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

__attribute__((target("avx2,fma,f16c"))) void axpy_scale_avx2(float* acc, float c, const float* v, float w, int64_t n) {
  const __m256 vc = _mm256_set1_ps(c), vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_loadu_ps(acc + i), vc)));
  for (; i < n; ++i) acc[i] = acc[i] * c + w * v[i];
}

__attribute__((target("avx2,fma,f16c"))) void f16_to_f32_avx2(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) d[i] = fp16_to_fp32(s[i]);
}
#endif

struct Kern {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float*, float, const float*, float, int64_t);
  bool avx2;
};

inline void load_row(const Node* t, const uint8_t* p, float* out, int64_t n, bool avx2) {
  if (t->dtype == DType::F32) { std::memcpy(out, p, (size_t)n * 4); return; }
#if defined(__x86_64__)
  if (avx2) { f16_to_f32_avx2(reinterpret_cast<const uint16_t*>(p), out, n); return; }
#endif
  (void)avx2;
  const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(s[i]);
}

}  // namespace

size_t cpu_attention_work_size(const Node& dst, const Node* const* src, int nth) {
  const int64_t D = src[0]->shape.dims[2], Dv = src[2]->shape.dims[2];
  // per thread: one K row, one V row, kTile accumulators, kTile query copies
  return (size_t)nth * (size_t)(D + Dv + kTile * Dv + kTile * D + 64) * sizeof(float);
}

void cpu_attention(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* Q = src[0];
  const Node* K = src[1];
  const Node* V = src[2];
  const Node* M = src[3];
  const Node* O = dst.n_src > 4 ? src[4] : nullptr;
  const float scale = dst.params.f[0];
  const int64_t T = Q->shape.dims[0], Hq = Q->shape.dims[1], D = Q->shape.dims[2];
  const int64_t n_kv = K->shape.dims[0], Hkv = K->shape.dims[1], Dv = V->shape.dims[2];
  const int64_t group = Hq / Hkv;

  Kern kern{dot_scalar, axpy_scale_scalar, false};
#if defined(__x86_64__)
  if (p.isa != CpuIsa::scalar) kern = Kern{dot_avx2, axpy_scale_avx2, true};
#endif

  float* w = reinterpret_cast<float*>(p.wdata) + (size_t)p.ith * (size_t)(D + Dv + kTile * Dv + kTile * D + 64);
  float* krow = w;
  float* vrow = krow + D;
  float* acc = vrow + Dv;           // [kTile][Dv]
  float* qbuf = acc + kTile * Dv;   // [kTile][D]

  // Work items: (kv head, tile of query rows); query rows are (token, head in group).
  const int64_t rows_per_head = T * group;
  const int64_t tiles_per_head = (rows_per_head + kTile - 1) / kTile;
  const int64_t n_items = Hkv * tiles_per_head;
  int64_t it0, it1;
  split_range(n_items, p.ith, p.nth, it0, it1);
  const float ninf = -std::numeric_limits<float>::infinity();

  for (int64_t item = it0; item < it1; ++item) {
    const int64_t hk = item / tiles_per_head;
    const int64_t r0 = (item % tiles_per_head) * kTile;
    const int nt = (int)std::min<int64_t>(kTile, rows_per_head - r0);
    int64_t tok[kTile], hq[kTile];
    float m[kTile], l[kTile];
    const float* mrow[kTile];
    for (int r = 0; r < nt; ++r) {
      tok[r] = (r0 + r) / group;
      hq[r] = hk * group + (r0 + r) % group;
      const float* q = reinterpret_cast<const float*>(Q->data + tok[r] * Q->shape.strides[0] + hq[r] * Q->shape.strides[1]);
      for (int64_t i = 0; i < D; ++i) qbuf[r * D + i] = q[i] * scale;
      m[r] = ninf;
      l[r] = 0.0f;
      std::memset(acc + r * Dv, 0, (size_t)Dv * 4);
      mrow[r] = reinterpret_cast<const float*>(M->data + tok[r] * M->shape.strides[0]);
    }
    for (int64_t jj = 0; jj < n_kv; ++jj) {
      const int64_t j = O ? *reinterpret_cast<const int32_t*>(O->data + jj * O->shape.strides[0]) : jj;
      if (j < 0 || j >= n_kv) continue;
      bool any = false;
      for (int r = 0; r < nt; ++r) any |= mrow[r][j] != ninf;
      if (!any) continue;
      load_row(K, K->data + j * K->shape.strides[0] + hk * K->shape.strides[1], krow, D, kern.avx2);
      load_row(V, V->data + j * V->shape.strides[0] + hk * V->shape.strides[1], vrow, Dv, kern.avx2);
      for (int r = 0; r < nt; ++r) {
        const float mk = mrow[r][j];
        if (mk == ninf) continue;
        const float s = kern.dot(qbuf + r * D, krow, D) + mk;
        if (s > m[r]) {
          const float c = std::exp(m[r] - s);  // 0 on the first cell
          m[r] = s;
          l[r] = l[r] * c + 1.0f;
          kern.axpy(acc + r * Dv, c, vrow, 1.0f, Dv);
        } else {
          const float e = std::exp(s - m[r]);
          l[r] += e;
          kern.axpy(acc + r * Dv, 1.0f, vrow, e, Dv);
        }
      }
    }
    for (int r = 0; r < nt; ++r) {
      float* out = reinterpret_cast<float*>(dst.data) + (tok[r] * Hq + hq[r]) * Dv;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t i = 0; i < Dv; ++i) out[i] = acc[r * Dv + i] * inv;
    }
  }
}

}  // namespace pyfast
