// GGUF block formats (bit-compatible with ggml), reference (de)quantizers and the matmul
// kernel internals. Layouts: every block starts with an fp16 scale `d`; see the struct comments.
#pragma once
#include <cstddef>
#include <cstdint>

#include "pyfast/cpu.h"
#include "pyfast/dtype.h"

namespace pyfast {

constexpr int QK = 32;  // elements per block for Q4_0, Q4_1, Q8_0, Q8_1

#pragma pack(push, 1)
struct block_q4_0 { uint16_t d; uint8_t qs[QK / 2]; };           // x = d * (q - 8); low nibbles = elems 0..15
struct block_q4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };        // x = d * q + m
struct block_q8_0 { uint16_t d; int8_t qs[QK]; };                // x = d * q
struct block_q8_1 { uint16_t d, s; int8_t qs[QK]; };             // x = d * q; s = d * sum(q)
#pragma pack(pop)
static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
static_assert(sizeof(block_q8_1) == 36, "q8_1 layout");

// Reference dequantize / quantize of one contiguous row of n elements (n % 32 == 0 for the
// block types). Handles F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q8_1. The quantizers round exactly
// like ggml's reference (gguf.quants): Q8_0/Q8_1 roundf (half away from zero), Q4_0/Q4_1
// truncation of x*id + 8.5 / (x-min)*id + 0.5; scales are stored as fp16 (nearest even).
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
void quantize_row_ref(DType t, const float* src, void* dst, int64_t n);
// Whether the row codec above handles t.
bool quant_supported(DType t);

// Scratch bytes (p.wdata) cpu_matmul needs for nth threads: the activations quantized once per
// op (for Q4_0 / Q4_1 / Q8_0 weights) plus a small per-thread area; 0 for F32/F16/BF16 weights.
size_t cpu_matmul_work_size(const Node& dst, const Node* const* src, int nth);
// Weight dtypes cpu_matmul accepts (x must be F32).
bool matmul_weight_supported(DType t);

// ---------------------------------------------------------------------------------------------
// Matmul internals (cpu/kernels/matmul.cpp drives; cpu/quant/mm_<isa>.cpp compute).
//
// Batch invariance: every output element y[m, n] is computed by one call, and its floating
// point operations depend only on x row m, w row n and the ISA -- never on M, the tile it was
// computed in, or the thread. The per-pair arithmetic is fixed:
//
//  Quantized weights (Q4_0, Q4_1, Q8_0). x rows are quantized per 32-block to int8 with a float
//  scale dx = amax/127, q = clamp(rne(x * (1/dx)), -127, 127), sx = sum(q), fx = dx * (float)sx.
//  Then, over blocks b in order, with isum_b the exact integer dot of the block
//  (sum q_w * q_x, with q_w - 8 for Q4_0) and dw, mw the fp16 block scale/min:
//      acc = fma(dx_b * dw_b, (float)isum_b, acc)         (acc starts at +0)
//      acc = fma(mw_b, fx_b, acc)                          (Q4_1 only)
//  This is the same in every ISA (scalar uses std::fma), so quantized results are bit-identical
//  across scalar / avx2 / avx512 too.
//
//  F32 / F16 / BF16 weights (weights widened exactly to f32; any K). Per pair, an L-lane f32
//  accumulator takes element k in lane k % L: acc[l] = fma(x[k], w[k], acc[l]) in k order, the
//  last partial step padding with zeros; then a fixed tree: per 4-lane group
//  g = (a0 + a2) + (a1 + a3); L = 8: g0 + g1; L = 16: (g0 + g1) + (g2 + g3).
//  avx512 and scalar use L = 16 (bit-identical); avx2 uses L = 8.
// ---------------------------------------------------------------------------------------------
namespace mm {

constexpr int kChunkN = 16;  // weight rows per work item (one kernel call)
constexpr int kChunkM = 64;  // activation rows per work item (multiple of 4)

// Row r of a tensor whose rows are its innermost dimension: up to 3 outer dims (d0, d1, d2) with
// byte strides; r runs over d0*d1*d2 rows in row-major order.
struct RowView {
  uint8_t* base = nullptr;
  int64_t d0 = 1, d1 = 1, d2 = 1;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  int64_t flat = 0;  // != 0: row r is at base + r * flat (no divisions); set by finalize()
  void finalize() {
    const int64_t d[3] = {d0, d1, d2}, s[3] = {s0, s1, s2};
    int64_t unit = 0, expect = 0;
    bool have = false;
    flat = 0;
    for (int i = 2; i >= 0; --i) {
      if (d[i] == 1) continue;
      if (!have) {
        unit = s[i];
        expect = s[i] * d[i];
        have = true;
      } else if (s[i] != expect) {
        return;
      } else {
        expect *= d[i];
      }
    }
    flat = have ? unit : 1;
  }
  uint8_t* row(int64_t r) const {
    if (flat) return base + r * flat;
    const int64_t i2 = r % d2;
    const int64_t r1 = r / d2;
    const int64_t i1 = r1 % d1;
    const int64_t i0 = r1 / d1;
    return base + i0 * s0 + i1 * s1 + i2 * s2;
  }
};

// Activations quantized once per op (shared scratch). Row r: int8 values at q + r*K. Per-block
// data in groups of 4 rows: element (r, b) at meta(r, b) of d (scale), s (sum of q), f (d*s).
struct ActQ {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int32_t* s = nullptr;
  const float* f = nullptr;
  int64_t K = 0, nb = 0;
  size_t meta(int64_t r, int64_t b) const { return (size_t)((((r >> 2) * nb + b) << 2) + (r & 3)); }
};

// Quantize one row of nb blocks; d, s, f point at the row's block-0 slot (stride 4 between blocks).
// All versions give bit-identical results.
void quant_act_scalar(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb);
void quant_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb);
void quant_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, float* f, int64_t nb);

// One work item with a quantized weight: y[m, n] for m in [m0, m1), n in [n0, n1), n1-n0 <= 16.
struct QJob {
  DType wt = DType::Q8_0;
  const uint8_t* w = nullptr;  // weight row n at w + n * w_stride
  int64_t w_stride = 0;
  int64_t n0 = 0, n1 = 0;
  ActQ a;
  int64_t m0 = 0, m1 = 0;
  RowView y;                   // f32 output rows
  float* scratch = nullptr;    // per-thread, qjob_scratch_floats(nb) floats, 64-byte aligned
};
inline size_t qjob_scratch_floats(int64_t nb) { return (size_t)(nb + 2) * 32; }
void qgemm_scalar(const QJob& j);
void qgemm_avx2(const QJob& j);
// The avx2 path uses AVX-VNNI (vpdpbusd on ymm) when the CPU has it; tests switch it off to cover
// the maddubs variant too (same results: integer sums are exact).
void avx2_use_vnni(bool on);
bool avx2_uses_vnni();
void qgemm_avx512(const QJob& j);

// One work item with an F32/F16/BF16 weight (x rows are f32, read in place).
struct FJob {
  DType wt = DType::F32;
  const uint8_t* w = nullptr;
  int64_t w_stride = 0;
  int64_t n0 = 0, n1 = 0;     // n1 - n0 <= 16
  RowView x;
  int64_t m0 = 0, m1 = 0;
  int64_t K = 0;
  RowView y;
};
void fgemm_scalar(const FJob& j);
void fgemm_avx2(const FJob& j);
void fgemm_avx512(const FJob& j);

// Integer dot of one 32-element weight block with 32 int8 activations (exact; q_w - 8 for Q4_0).
int32_t block_dot_ref(DType wt, const uint8_t* wblock, const int8_t* q);
// Byte layout of a weight block: size, offset of the quant bytes.
inline int wblock_bytes(DType t) {
  return t == DType::Q4_0 ? 18 : t == DType::Q4_1 ? 20 : t == DType::Q8_0 ? 34 : 0;
}

}  // namespace mm

}  // namespace pyfast
