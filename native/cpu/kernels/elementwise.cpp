// Elementwise and data-movement kernels: add, mul, scale, silu, swiglu, sigmoid, softplus, relu, gelu, tanh, cpy,
// get_rows, set_rows, concat, argmax, sum. Work is split over output rows; a reduction (argmax,
// sum) reads only the input elements of its own output element, in a fixed order.
#include <algorithm>
#include <stdexcept>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/kernels/common.h"
#include "cpu/kernels/vexp.h"
#include "cpu/quant/quant.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pyfast {

namespace {

// SiLU with the kernels' exp (vexp.h): x / (1 + exp(-x)), bit-identical in every ISA.
inline float silu_f(float x) { return x / (1.0f + exp_f32(-x)); }

// o[i] = silu(x[i]) * u[i] (u == nullptr: silu(x[i])) over a contiguous row, SIMD where the ISA
// has it; per element exactly silu_f (and the product), so the result is the same in every ISA.
#if defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t silu_mul_avx512(const float* x, const float* u, float* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __m512 y = _mm512_div_ps(v, _mm512_add_ps(one, exp_f32x16(_mm512_sub_ps(zero, v))));
    if (u) y = _mm512_mul_ps(y, _mm512_loadu_ps(u + i));
    _mm512_storeu_ps(o + i, y);
  }
  return i;
}
__attribute__((target("avx2,fma"))) int64_t silu_mul_avx2(const float* x, const float* u, float* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    __m256 y = _mm256_div_ps(v, _mm256_add_ps(one, exp_f32x8(_mm256_sub_ps(zero, v))));
    if (u) y = _mm256_mul_ps(y, _mm256_loadu_ps(u + i));
    _mm256_storeu_ps(o + i, y);
  }
  return i;
}

// o[i] = 1 / (1 + exp(-x[i])), per element exactly the scalar form in cpu_sigmoid.
__attribute__((target("avx512f"))) int64_t sigmoid_avx512(const float* x, float* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(o + i, _mm512_div_ps(one, _mm512_add_ps(one, exp_f32x16(_mm512_sub_ps(zero, _mm512_loadu_ps(x + i))))));
  return i;
}
__attribute__((target("avx2,fma"))) int64_t sigmoid_avx2(const float* x, float* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(o + i, _mm256_div_ps(one, _mm256_add_ps(one, exp_f32x8(_mm256_sub_ps(zero, _mm256_loadu_ps(x + i))))));
  return i;
}
#endif

// Largest value of x[0..n) (contiguous) and whether a NaN occurs, 16 / 8 lanes at a time; returns
// how many elements it covered (the caller finishes the rest).
#if defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t max_scan_avx512(const float* x, int64_t n, float& mx, bool& nan) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 un = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(v, m);
  }
  mx = _mm512_reduce_max_ps(m);
  nan = un != 0;
  return i;
}
__attribute__((target("avx2"))) int64_t max_scan_avx2(const float* x, int64_t n, float& mx, bool& nan) {
  __m256 m = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(v, m);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, m);
  mx = t[0];
  for (int l = 1; l < 8; ++l) mx = t[l] > mx ? t[l] : mx;
  nan = _mm256_movemask_ps(un) != 0;
  return i;
}
#endif

// numpy's argmax of x[c0..c1) (stride ia): the first NaN if there is one, else the first maximum;
// -1 for an empty range. bv gets the value.
int64_t argmax_range(const float* x, int64_t ia, int64_t c0, int64_t c1, CpuIsa isa, float& bv) {
  if (c1 <= c0) return -1;
  if (ia == 1) {  // two passes: the maximum (vectorized), then where it first occurs
    float mx = -INFINITY;
    bool nan = false;
    int64_t i = 0;
    const int64_t n = c1 - c0;
    const float* y = x + c0;
#if defined(__x86_64__)
    if (isa == CpuIsa::avx512) i = max_scan_avx512(y, n, mx, nan);
    else if (isa == CpuIsa::avx2) i = max_scan_avx2(y, n, mx, nan);
#else
    (void)isa;
#endif
    for (; i < n; ++i) {
      nan |= y[i] != y[i];
      mx = y[i] > mx ? y[i] : mx;
    }
    for (i = 0; i < n; ++i)
      if (nan ? y[i] != y[i] : y[i] == mx) break;
    bv = y[i];
    return c0 + i;
  }
  int64_t best = c0;
  bv = x[c0 * ia];
  if (bv != bv) return best;
  for (int64_t i = c0 + 1; i < c1; ++i) {
    const float v = x[i * ia];
    if (v != v) { bv = v; return i; }
    if (v > bv) { bv = v; best = i; }
  }
  return best;
}

void silu_mul_row(const float* x, const float* u, float* o, int64_t n, CpuIsa isa) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (isa == CpuIsa::avx512) i = silu_mul_avx512(x, u, o, n);
  else if (isa == CpuIsa::avx2) i = silu_mul_avx2(x, u, o, n);
#else
  (void)isa;
#endif
  for (; i < n; ++i) o[i] = u ? silu_f(x[i]) * u[i] : silu_f(x[i]);
}

template <typename F>
void binary_rows(const ComputeParams& p, Node& dst, const Node* a, const Node* b, F f) {
  const Shape& sa = a->shape;
  const Shape& sb = b->shape;
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const int64_t ia = inner_stride(sa) / 4;
  const int64_t ib = sb.dims[sb.ndim - 1] == 1 ? 0 : inner_stride(sb) / 4;
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
    const float* y = reinterpret_cast<const float*>(b->data + bcast_row_offset(sa, sb, r));
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    if (ia == 1 && ib == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = f(x[i], y[i]);
    } else if (ia == 1 && ib == 0) {
      const float yv = y[0];
      for (int64_t i = 0; i < n; ++i) o[i] = f(x[i], yv);
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = f(x[i * ia], y[i * ib]);
    }
  }
}

template <typename F>
void unary_rows(const ComputeParams& p, Node& dst, const Node* a, F f) {
  const Shape& sa = a->shape;
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const int64_t ia = inner_stride(sa) / 4;
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    if (ia == 1) for (int64_t i = 0; i < n; ++i) o[i] = f(x[i]);
    else for (int64_t i = 0; i < n; ++i) o[i] = f(x[i * ia]);
  }
}

}  // namespace

void cpu_add(const ComputeParams& p, Node& dst, const Node* const* src) {
  binary_rows(p, dst, src[0], src[1], [](float x, float y) { return x + y; });
}

void cpu_mul(const ComputeParams& p, Node& dst, const Node* const* src) {
  binary_rows(p, dst, src[0], src[1], [](float x, float y) { return x * y; });
}

void cpu_scale(const ComputeParams& p, Node& dst, const Node* const* src) {
  const float s = dst.params.f[0];
  unary_rows(p, dst, src[0], [s](float x) { return x * s; });
}

void cpu_silu(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Shape& sa = src[0]->shape;
  if (inner_stride(sa) != 4) return unary_rows(p, dst, src[0], silu_f);
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r)
    silu_mul_row(reinterpret_cast<const float*>(src[0]->data + row_offset(sa, r)), nullptr,
                 reinterpret_cast<float*>(dst.data) + r * n, n, p.isa);
}

void cpu_swiglu(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Shape& sa = src[0]->shape;
  const Shape& sb = src[1]->shape;
  if (inner_stride(sa) != 4 || sb.dims[sb.ndim - 1] == 1 || inner_stride(sb) != 4)
    return binary_rows(p, dst, src[0], src[1], [](float g, float u) { return silu_f(g) * u; });
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r)
    silu_mul_row(reinterpret_cast<const float*>(src[0]->data + row_offset(sa, r)),
                 reinterpret_cast<const float*>(src[1]->data + bcast_row_offset(sa, sb, r)),
                 reinterpret_cast<float*>(dst.data) + r * n, n, p.isa);
}

void cpu_cpy(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const size_t out_row = dtype_row_size(dst.dtype, n);
  const int64_t es = (int64_t)dtype_type_size(a->dtype);
  const bool inner_contig = dtype_is_quantized(a->dtype) || inner_stride(sa) == es || n == 1;
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  // Per-thread scratch that grows once and is reused across calls.
  thread_local std::vector<float> tmp;
  thread_local std::vector<uint8_t> gather;
  if (dst.dtype != DType::F32 && a->dtype != dst.dtype && tmp.size() < (size_t)n) tmp.resize((size_t)n);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* x = a->data + row_offset(sa, r);
    if (!inner_contig) {
      gather.resize((size_t)(n * es));
      for (int64_t i = 0; i < n; ++i) std::memcpy(&gather[(size_t)(i * es)], x + i * inner_stride(sa), (size_t)es);
      x = gather.data();
    }
    uint8_t* o = dst.data + r * out_row;
    if (a->dtype == dst.dtype) {
      std::memcpy(o, x, out_row);
    } else if (dst.dtype == DType::F32) {
      row_to_f32(a->dtype, x, reinterpret_cast<float*>(o), n);
    } else {
      row_to_f32(a->dtype, x, tmp.data(), n);
      row_from_f32(dst.dtype, tmp.data(), o, n);
    }
  }
}

void cpu_get_rows(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* t = src[0];
  const Node* ids = src[1];
  const int64_t n_ids = ids->shape.dims[0];
  const int64_t V = t->shape.dims[0];
  const int64_t row_elems = t->shape.numel() / V;
  // A table row is dims[1:]; it is read as runs of its innermost dim, which may be strided
  // (e.g. a permuted [V, H, D] view) but is itself contiguous.
  Shape inner = t->shape;
  inner.ndim = t->shape.ndim - 1;
  for (int k = 0; k < inner.ndim; ++k) { inner.dims[k] = t->shape.dims[k + 1]; inner.strides[k] = t->shape.strides[k + 1]; }
  const bool contiguous = is_contiguous(t->dtype, inner);
  const int64_t n_inner = inner.dims[inner.ndim - 1];
  const int64_t runs = row_elems / n_inner;
  int64_t r0, r1;
  split_range(n_ids, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t id = *reinterpret_cast<const int32_t*>(ids->data + r * ids->shape.strides[0]);
    float* o = reinterpret_cast<float*>(dst.data) + r * row_elems;
    if (id < 0 || id >= V) {  // validated by the caller; never read out of bounds
      std::memset(o, 0, (size_t)row_elems * 4);
      continue;
    }
    const uint8_t* row = t->data + (int64_t)id * t->shape.strides[0];
    if (t->packed) {  // the row back out of its 16-row chunk (quant.h)
      thread_local std::vector<uint8_t> tmp_row;
      tmp_row.resize((size_t)t->shape.strides[0]);
      unpack_x16(t->dtype, t->data + (int64_t)(id & ~15) * t->shape.strides[0], n_inner, id & 15, 1, tmp_row.data());
      row_to_f32(t->dtype, tmp_row.data(), o, row_elems);
    } else if (contiguous) {
      row_to_f32(t->dtype, row, o, row_elems);
    } else {
      for (int64_t q = 0; q < runs; ++q) row_to_f32(t->dtype, row + row_offset(inner, q), o + q * n_inner, n_inner);
    }
  }
}

void cpu_set_rows(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* d = src[0];
  const Node* s = src[1];
  const Node* idx = src[2];
  const int64_t n = s->shape.dims[0];
  const int64_t R = d->shape.dims[0];
  const int64_t row_elems = s->shape.numel() / n;
  int64_t r0, r1;
  split_range(n, p.ith, p.nth, r0, r1);
  thread_local std::vector<float> tmp;
  for (int64_t r = r0; r < r1; ++r) {
    const int32_t row = *reinterpret_cast<const int32_t*>(idx->data + r * idx->shape.strides[0]);
    if (row < 0 || row >= R) continue;
    // src rows may be strided views; gather into a contiguous row first when needed.
    const Shape& ss = s->shape;
    const float* x;
    Shape inner = ss;
    inner.ndim = ss.ndim - 1;
    for (int k = 0; k < inner.ndim; ++k) { inner.dims[k] = ss.dims[k + 1]; inner.strides[k] = ss.strides[k + 1]; }
    if (inner.ndim == 0 || is_contiguous(DType::F32, inner)) {
      x = reinterpret_cast<const float*>(s->data + r * ss.strides[0]);
    } else {
      tmp.resize((size_t)row_elems);
      const int64_t inner_n = inner.dims[inner.ndim - 1];
      const int64_t rows = row_elems / inner_n;
      for (int64_t q = 0; q < rows; ++q) {
        const uint8_t* base = s->data + r * ss.strides[0] + row_offset(inner, q);
        for (int64_t i = 0; i < inner_n; ++i)
          tmp[(size_t)(q * inner_n + i)] = *reinterpret_cast<const float*>(base + i * inner.strides[inner.ndim - 1]);
      }
      x = tmp.data();
    }
    row_from_f32(d->dtype, x, dst.data + (int64_t)row * d->shape.strides[0], row_elems);
  }
}

// Long rows (logits: the output of a matmul split over threads by 16-column chunks) are split by
// columns the same way, so each thread scans the part it has just written (in its own cache) and
// the per-thread maxima are combined after a barrier; short rows are split by rows. Either way
// the first maximum wins (strict >, columns in order).
constexpr int64_t kArgmaxColumnSplit = 4096;

bool cpu_argmax_syncs(const Node& dst, const Node* const* src, int nth) {
  (void)dst;
  return nth > 1 && src[0]->shape.dims[src[0]->shape.ndim - 1] >= kArgmaxColumnSplit;
}

size_t cpu_argmax_work_size(const Node& dst, const Node* const* src, int nth) {
  return cpu_argmax_syncs(dst, src, nth) ? (size_t)nth * (size_t)n_rows(src[0]->shape) * 8 : 0;
}

void cpu_argmax(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  const int64_t ia = inner_stride(sa) / 4;
  int64_t r0, r1;
  if (cpu_argmax_syncs(dst, src, p.nth)) {
    int64_t c0, c1;
    split_range((n + 15) / 16, p.ith, p.nth, c0, c1);
    c0 *= 16;
    c1 = std::min(c1 * 16, n);
    float* pv = reinterpret_cast<float*>(p.wdata);              // [nth][nr] maxima
    int32_t* pi = reinterpret_cast<int32_t*>(pv + p.nth * nr);   // [nth][nr] their columns
    for (int64_t r = 0; r < nr; ++r) {
      float bv = 0.0f;
      const int64_t best = argmax_range(reinterpret_cast<const float*>(a->data + row_offset(sa, r)), ia, c0, c1,
                                        p.isa, bv);
      pv[p.ith * nr + r] = bv;
      pi[p.ith * nr + r] = (int32_t)best;
    }
    p.barrier();
    split_range(nr, p.ith, p.nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {  // the threads' ranges in column order: the first NaN / maximum wins
      int32_t best = -1;
      float bv = 0.0f;
      for (int t = 0; t < p.nth; ++t) {
        const int32_t i = pi[t * nr + r];
        const float v = pv[t * nr + r];
        if (i < 0 || (best >= 0 && (bv != bv || !(v > bv || v != v)))) continue;
        bv = v;
        best = i;
      }
      reinterpret_cast<int32_t*>(dst.data)[r] = best;
    }
    return;
  }
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    float bv;
    reinterpret_cast<int32_t*>(dst.data)[r] =
        (int32_t)argmax_range(reinterpret_cast<const float*>(a->data + row_offset(sa, r)), ia, 0, n, p.isa, bv);
  }
}

// sigmoid with the kernels' exp (vectorized over contiguous rows: the attention output gates of
// the Qwen3.5 family are [T, n_head * head_dim]); softplus with libm (it runs on small gates).
inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

void cpu_sigmoid(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Shape& sa = src[0]->shape;
  if (inner_stride(sa) != 4) return unary_rows(p, dst, src[0], sigmoid_f);
  const int64_t nr = n_rows(sa), n = sa.dims[sa.ndim - 1];
  int64_t r0, r1;
  split_range(nr, p.ith, p.nth, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reinterpret_cast<const float*>(src[0]->data + row_offset(sa, r));
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    int64_t i = 0;
#if defined(__x86_64__)
    if (p.isa == CpuIsa::avx512) i = sigmoid_avx512(x, o, n);
    else if (p.isa == CpuIsa::avx2) i = sigmoid_avx2(x, o, n);
#endif
    for (; i < n; ++i) o[i] = sigmoid_f(x[i]);
  }
}

// log(1 + exp(x)), and x itself above torch's default threshold of 20.
void cpu_softplus(const ComputeParams& p, Node& dst, const Node* const* src) {
  unary_rows(p, dst, src[0], [](float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); });
}

// max(x, 0); NaN stays NaN (x > 0 is false for NaN, so it is written through as x).
// GELU in its tanh form (Gemma's gelu_pytorch_tanh), computed in double so the rounding is the
// same in every ISA.
void cpu_gelu(const ComputeParams& p, Node& dst, const Node* const* src) {
  unary_rows(p, dst, src[0], [](float x) {
    const double v = x;
    return (float)(0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
  });
}

void cpu_tanh(const ComputeParams& p, Node& dst, const Node* const* src) {
  unary_rows(p, dst, src[0], [](float x) { return std::tanh(x); });
}

void cpu_relu(const ComputeParams& p, Node& dst, const Node* const* src) {
  unary_rows(p, dst, src[0], [](float x) { return x < 0.0f ? 0.0f : x; });
}

namespace {

// Byte offset of the element with multi-index idx[0..ndim) in a strided shape.
inline int64_t elem_offset(const Shape& s, const int64_t* idx) {
  int64_t off = 0;
  for (int d = 0; d < s.ndim; ++d) off += idx[d] * s.strides[d];
  return off;
}

// Copy n f32 elements from x (element stride st) to o (contiguous).
inline void copy_row(float* o, const float* x, int64_t n, int64_t st) {
  if (st == 1) std::memcpy(o, x, (size_t)n * 4);
  else for (int64_t i = 0; i < n; ++i) o[i] = x[i * st];
}

}  // namespace

// concat: output rows (all dims but the last) are split over threads; each output row is
// copied from a or b (axis < last) or from both (axis == last).
void cpu_concat(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Node* b = src[1];
  const Shape& so = dst.shape;
  const int nd = so.ndim;
  const int ax = dst.params.i[0];
  const int64_t n = so.dims[nd - 1];
  const int64_t na = a->shape.dims[ax];
  const int64_t sta = inner_stride(a->shape) / 4, stb = inner_stride(b->shape) / 4;
  int64_t r0, r1;
  split_range(n_rows(so), p.ith, p.nth, r0, r1);
  int64_t idx[kMaxDims] = {0, 0, 0, 0};
  for (int64_t r = r0; r < r1; ++r) {
    int64_t q = r;
    for (int d = nd - 2; d >= 0; --d) {
      idx[d] = q % so.dims[d];
      q /= so.dims[d];
    }
    idx[nd - 1] = 0;
    float* o = reinterpret_cast<float*>(dst.data) + r * n;
    if (ax == nd - 1) {
      const float* xa = reinterpret_cast<const float*>(a->data + elem_offset(a->shape, idx));
      const float* xb = reinterpret_cast<const float*>(b->data + elem_offset(b->shape, idx));
      copy_row(o, xa, na, sta);
      copy_row(o + na, xb, n - na, stb);
    } else if (idx[ax] < na) {
      copy_row(o, reinterpret_cast<const float*>(a->data + elem_offset(a->shape, idx)), n, sta);
    } else {
      idx[ax] -= na;
      copy_row(o, reinterpret_cast<const float*>(b->data + elem_offset(b->shape, idx)), n, stb);
    }
  }
}

// sum over one axis. Every output element is reduced in the same fixed order whatever the axis,
// thread split or batch: element i of the reduced axis goes to lane i % 8, then the lanes are
// combined by the tree ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) (as rms_norm's sum).
void cpu_sum(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* a = src[0];
  const Shape& sa = a->shape;
  const int nd = sa.ndim;
  const int ax = dst.params.i[0];
  const int64_t L = sa.dims[ax];
  const int64_t sl = sa.strides[ax] / 4;  // elements between neighbours along the axis
  float* out = reinterpret_cast<float*>(dst.data);
  auto tree = [](const float* l) { return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])); };
  if (ax == nd - 1) {
    // One output element per input row.
    int64_t r0, r1;
    split_range(n_rows(sa), p.ith, p.nth, r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = reinterpret_cast<const float*>(a->data + row_offset(sa, r));
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      if (sl == 1)
        for (; i + 8 <= L; i += 8)
          for (int l = 0; l < 8; ++l) acc[l] += x[i + l];
      for (; i < L; ++i) acc[i & 7] += x[i * sl];
      out[r] = tree(acc);
    }
    return;
  }
  // The axis is not the innermost: an output row is the input's innermost dim (n elements) at a
  // multi-index of the other outer dims; it is accumulated in column blocks of kB.
  constexpr int64_t kB = 64;
  const int64_t n = sa.dims[nd - 1];
  const int64_t st = inner_stride(sa) / 4;
  int64_t n_out_rows = 1;
  for (int d = 0; d < nd - 1; ++d)
    if (d != ax) n_out_rows *= sa.dims[d];
  int64_t r0, r1;
  split_range(n_out_rows, p.ith, p.nth, r0, r1);
  int64_t idx[kMaxDims] = {0, 0, 0, 0};
  for (int64_t r = r0; r < r1; ++r) {
    int64_t q = r;
    for (int d = nd - 2; d >= 0; --d) {
      if (d == ax) { idx[d] = 0; continue; }
      idx[d] = q % sa.dims[d];
      q /= sa.dims[d];
    }
    idx[nd - 1] = 0;
    const float* x0 = reinterpret_cast<const float*>(a->data + elem_offset(sa, idx));
    float* o = out + r * n;
    for (int64_t c0 = 0; c0 < n; c0 += kB) {
      const int64_t nc = n - c0 < kB ? n - c0 : kB;
      float acc[8][kB];
      for (int l = 0; l < 8; ++l)
        for (int64_t c = 0; c < nc; ++c) acc[l][c] = 0.0f;
      for (int64_t i = 0; i < L; ++i) {
        const float* x = x0 + i * sl + c0 * st;
        float* ac = acc[i & 7];
        if (st == 1) for (int64_t c = 0; c < nc; ++c) ac[c] += x[c];
        else for (int64_t c = 0; c < nc; ++c) ac[c] += x[c * st];
      }
      for (int64_t c = 0; c < nc; ++c) {
        const float l[8] = {acc[0][c], acc[1][c], acc[2][c], acc[3][c], acc[4][c], acc[5][c], acc[6][c], acc[7][c]};
        o[c0 + c] = tree(l);
      }
    }
  }
}

}  // namespace pyfast
