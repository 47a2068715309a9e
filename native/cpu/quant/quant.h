// GGUF block formats (bit-compatible with ggml), reference (de)quantizers and the matmul
// kernel internals. Layouts: every block starts with an fp16 scale `d`; see the struct comments.
#pragma once
#include <cstddef>
#include <cstdint>

#include "pyfast/cpu.h"
#include "pyfast/dtype.h"

namespace pyfast {

constexpr int QK = 32;     // elements per block for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1
constexpr int QK_K = 256;  // elements per super-block for the K-quants

#pragma pack(push, 1)
struct block_q4_0 { uint16_t d; uint8_t qs[QK / 2]; };           // x = d * (q - 8); low nibbles = elems 0..15
struct block_q4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };        // x = d * q + m
// 5-bit: q = nibble | (bit << 4); nibbles as Q4_0 (low = elems 0..15), bit j of qh (little-endian
// u32) = bit 4 of element j.
struct block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };     // x = d * (q - 16)
struct block_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; };  // x = d * q + m
struct block_q8_0 { uint16_t d; int8_t qs[QK]; };                // x = d * q
struct block_q8_1 { uint16_t d, s; int8_t qs[QK]; };             // x = d * q; s = d * sum(q)
// K-quants: 256 elements in sub-blocks (8 x 32 for Q4_K / Q5_K, 16 x 16 for Q6_K).
//  Q4_K / Q5_K: sub-block j has 6-bit scale sc_j and min m_j packed in `scales` (j < 4: low 6 bits
//  of scales[j] / scales[j + 4]; j >= 4: low / high nibble of scales[j + 4] plus the top 2 bits of
//  scales[j - 4] / scales[j]); x = d * sc_j * q - dmin * m_j. qs[32 p + l] holds element l of
//  sub-blocks 2p (low nibble) and 2p + 1 (high nibble); Q5_K's bit 4 of element l of sub-block j
//  is bit j of qh[l].
//  Q6_K: element e = 128 h + 64 s + l (l < 64) has low 4 bits in ql[64 h + l] >> 4 s; element
//  e = 128 h + 32 t + l (l < 32) has high 2 bits in qh[32 h + l] >> 2 t; x = d * scales[e / 16] * (q - 32).
struct block_q4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct block_q5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
#pragma pack(pop)
static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
static_assert(sizeof(block_q5_0) == 22, "q5_0 layout");
static_assert(sizeof(block_q5_1) == 24, "q5_1 layout");
static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
static_assert(sizeof(block_q8_1) == 36, "q8_1 layout");
static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
static_assert(sizeof(block_q6_K) == 210, "q6_K layout");

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed scale bytes.
inline void kscale_get(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Reference dequantize / quantize of one contiguous row of n elements (n a multiple of the block
// size for the block types). Handles F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q4_K, Q5_K,
// Q6_K; dequantization is bit-identical to gguf.quants. The 32-block quantizers round exactly like
// ggml's reference (gguf.quants): Q8_0/Q8_1 roundf (half away from zero), Q4_0/Q5_0 truncation of
// x*id + 8.5 / 16.5, Q4_1/Q5_1 truncation of (x-min)*id + 0.5; scales are stored as fp16 (nearest
// even). The K-quant quantizers search each sub-block's scale (and min) for the least squared
// error and then refit the super-block scales (quant_k.cpp); they are deterministic.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
void quantize_row_ref(DType t, const float* src, void* dst, int64_t n);
// Whether the row codec above handles t.
bool quant_supported(DType t);

// K-quant codecs (quant_k.cpp); n is a multiple of 256.
void dequantize_row_k(DType t, const void* src, float* dst, int64_t n);
void quantize_row_k(DType t, const float* src, void* dst, int64_t n);
// The quantizer for whole tensors (pyfast quantize): like quantize_row_ref, except that Q4_0,
// Q4_1, Q5_0 and Q5_1 search each block's scale (and min) for the least squared error instead of
// deriving it from the block's extremes (lower round-trip error; not bit-identical to gguf's
// reference). Deterministic.
void quantize_row_fit(DType t, const float* src, void* dst, int64_t n);

// Quantize a [nrows, ncols] f32 matrix to t with quantize_row_fit on n_threads threads (rows split
// between them; the result does not depend on n_threads). dst holds nrows * dtype_row_size(t, ncols)
// bytes.
void quantize_rows(DType t, const float* src, void* dst, int64_t nrows, int64_t ncols, int n_threads);

// Scratch bytes (p.wdata) cpu_matmul needs for nth threads: the activations quantized once per
// op (for quantized weights) plus a small per-thread area; 0 for F32/F16/BF16 weights.
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
//  Quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). x rows are quantized per
//  32-block to int8 with a float scale dx = amax/127, q = clamp(rne(x * (1/dx)), -127, 127),
//  sx = sum(q), hx = sum of the first 16 q, fx = dx * (float)sx. Every weight row is read as
//  32-blocks too (a K-quant super-block is 8 of them); block b of a weight row gives exact
//  integer codes c_b[32], a float scale dw_b and, for the types with a min, a float mw_b:
//      Q4_0  c = q - 8           dw = d                        Q4_1  c = q   dw = d   mw = m
//      Q5_0  c = q - 16          dw = d                        Q5_1  c = q   dw = d   mw = m
//      Q8_0  c = q               dw = d
//      Q4_K, Q5_K (sub-block j = b % 8 of super-block b / 8):  c = q   dw = d * sc_j
//                                                              mw = -(dmin * m_j)
//      Q6_K (32-block j = b % 8 covers 16-sub-blocks 2j, 2j+1): c = scales[2j or 2j+1] * (q - 32)
//                                                              dw = d
//  (d, m, dmin are the fp16 fields widened to f32; d * sc_j and dmin * m_j are exact in f32.)
//  Then, over blocks b in order, with isum_b = sum_k c_b[k] * q[k] (exact in int32; for Q6_K
//  |isum| < 2^24 so (float)isum_b is exact too):
//      acc = fma(dx_b * dw_b, (float)isum_b, acc)         (acc starts at +0)
//      acc = fma(mw_b, fx_b, acc)                          (types with a min only)
//  This is the same in every ISA (scalar uses std::fma), so quantized results are bit-identical
//  across scalar / avx2 / avx512 / neon too. (SIMD kernels form isum from unsigned weight codes and
//  subtract the offset times sx / hx; integer sums are exact, so this changes nothing.) For Q6_K
//  the SIMD kernels with several activation rows form (float)isum_b as
//  fma((float)scale_lo, (float)isum_lo, (float)scale_hi * (float)isum_hi) over the block's two
//  16-halves: every term and partial sum is an integer below 2^24, so this is exact as well.
//
//  How work is laid out does not matter either. With one activation row the SIMD kernels reduce
//  per pair (a weight row per 128-bit lane); with several rows (avx2 / avx512, see
//  mm_avx512.cpp) each weight block of the chunk is first decoded once into a transposed form
//  (lane r = four codes of weight row r) and every activation row then takes its 16 (8) block
//  sums with eight vpdpbusd / maddubs against broadcast dwords of its int8 block.
//
//  F32 / F16 / BF16 weights (weights widened exactly to f32; any K). Per pair, an L-lane f32
//  accumulator takes element k in lane k % L: acc[l] = fma(x[k], w[k], acc[l]) in k order, the
//  last partial step padding with zeros; then a fixed tree: per 4-lane group
//  g = (a0 + a2) + (a1 + a3); L = 8: g0 + g1; L = 16: (g0 + g1) + (g2 + g3).
//  avx512, neon and scalar use L = 16 (bit-identical); avx2 uses L = 8.
// ---------------------------------------------------------------------------------------------
// Packed ("x16") weights. A [N, K] weight of a packable type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
// Q6_K) with N % 16 == 0 may be stored in chunks of 16 rows, laid out so that the kernels read a
// block of all 16 rows with a few plain vector loads instead of gathers from 16 rows: chunk c
// keeps the bytes its rows had (offset c * 16 * row_bytes) and block b of it (a super-block for
// the K-quants) sits at b * 16 * bs (bs = the row-major block's bytes). Inside it, each field of
// the row-major block (kPackFmt: scales, mins, packed scale bytes, high bits, codes) becomes
// field.bytes / field.unit vectors of 16 units, unit u of row r at field.at + u * stride + r * unit
// (stride 16 * unit unless given): fp16 scales as [16] halves (one 32-byte vector per scale),
// everything else as dwords, so that a 64-byte vector holds, in lane r, the 4 bytes row r has at
// one byte offset of the block. The fields are in the order the 1-row kernels read them, so that
// a chunk is one forward stream (the hardware prefetchers follow it; Q6_K interleaves its code
// fields for that). Same values, same arithmetic: results are bit-identical to the row-major
// weight. The model loader packs weights in memory (pyfast.models.base); matmul and get_rows
// read them.
struct PackField {
  int off, bytes, unit, at;  // row-major offset and size, unit (2: fp16, 4: dwords), packed offset
  int stride = 0;            // bytes between the field's vectors (0: 16 * unit, back to back)
  constexpr int step() const { return stride ? stride : 16 * unit; }
};
struct PackFmt {
  int bs = 0;        // bytes of one row-major block (0: not packable)
  int n_fields = 0;
  PackField f[8] = {};
};
constexpr PackFmt kPackFmt(DType t) {
  switch (t) {
    case DType::Q4_0: return {18, 2, {{0, 2, 2, 0}, {2, 16, 4, 32}}};
    case DType::Q4_1: return {20, 3, {{0, 2, 2, 0}, {2, 2, 2, 32}, {4, 16, 4, 64}}};
    case DType::Q8_0: return {34, 2, {{0, 2, 2, 0}, {2, 32, 4, 32}}};
    case DType::Q4_K: return {144, 4, {{0, 2, 2, 0}, {2, 2, 2, 32}, {4, 12, 4, 64}, {16, 128, 4, 256}}};
    case DType::Q5_K:
      return {176, 5, {{0, 2, 2, 0}, {2, 2, 2, 32}, {4, 12, 4, 64}, {16, 32, 4, 256}, {48, 128, 4, 768}}};
    case DType::Q6_K:
      // scales, d, then per half h: vector g of ql[64h ..], ql[64h + 32 ..] and qh[32h ..]
      // side by side (the three the half's four blocks need for their elements 4g .. 4g + 3)
      return {210, 8, {{192, 16, 4, 0}, {208, 2, 2, 256},
                       {0, 32, 4, 288, 192}, {32, 32, 4, 352, 192}, {128, 32, 4, 416, 192},
                       {64, 32, 4, 1824, 192}, {96, 32, 4, 1888, 192}, {160, 32, 4, 1952, 192}}};
    default: return {};
  }
}
bool packable(DType t);
// src row-major -> dst packed (distinct buffers of N * row_bytes).
void pack_x16(DType t, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K);
// Rows r0 .. r0+nr-1 (< 16) of the packed chunk at `chunk` back to row-major rows at dst.
void unpack_x16(DType t, const uint8_t* chunk, int64_t K, int r0, int nr, uint8_t* dst);

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
// data in groups of 4 rows: element (r, b) at meta(r, b) of d (scale), s (sum of q), f (d*s) and
// h (sum of the block's first 16 q).
struct ActQ {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int32_t* s = nullptr;
  const float* f = nullptr;
  const int32_t* h = nullptr;
  int64_t K = 0, nb = 0;
  size_t meta(int64_t r, int64_t b) const { return (size_t)((((r >> 2) * nb + b) << 2) + (r & 3)); }
};

// Quantize one row of nb blocks; d, s, f, h point at the row's block-0 slot (stride 4 between
// blocks). All versions give bit-identical results.
void quant_act_scalar(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb);
void quant_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb);
void quant_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb);
void quant_act_neon(const float* x, int8_t* q, float* d, int32_t* s, float* f, int32_t* h, int64_t nb);

// One work item with a quantized weight: y[m, n] for m in [m0, m1), n in [n0, n1), n1-n0 <= 16.
struct QJob {
  DType wt = DType::Q8_0;
  const uint8_t* w = nullptr;  // weight row n at w + n * w_stride
  int64_t w_stride = 0;
  bool packed = false;         // w is packed (x16, above): the chunk of rows n0.. at w + n0 * w_stride
  int64_t n0 = 0, n1 = 0;
  ActQ a;
  int64_t m0 = 0, m1 = 0;
  RowView y;                   // f32 output rows
  float* scratch = nullptr;    // per-thread, qjob_scratch_floats(nb) floats, 64-byte aligned
  // Consecutive items of one thread on the same weight rows (a prompt's row chunks): the avx512
  // K-quant kernels decode the chunk's blocks and scale tables into the scratch once. reuse: the
  // scratch already holds them for these rows; the kernel sets *stored (when given) if it leaves
  // them there (stored, or reused). Which item decodes does not change any result.
  bool reuse = false;
  bool* stored = nullptr;
};
// Room for the chunk's weights decoded to u8 codes (16 rows x K bytes; SIMD kernels with several
// activation rows), four [nb][16] tables (+16 padding each: weight scales, mins / sub-scales) and
// two per-(activation row, block) int32 tables for up to kChunkM (+3) rows.
inline size_t qjob_scratch_floats(int64_t nb) { return (size_t)(nb + 1) * (128 + 64 + 2 * (kChunkM + 4) + 96); }
void qgemm_scalar(const QJob& j);
void qgemm_avx2(const QJob& j);
// The avx2 path uses AVX-VNNI (vpdpbusd on ymm) when the CPU has it; tests switch it off to cover
// the maddubs variant too (same results: integer sums are exact).
void avx2_use_vnni(bool on);
bool avx2_uses_vnni();
void qgemm_avx512(const QJob& j);
void qgemm_neon(const QJob& j);
// The neon path uses the dotprod extension (sdot, vdotq_s32) when the CPU has it; tests switch it
// off to cover the plain NEON variant (vmull_s8 / vpadalq_s16) too (same results: integer sums
// are exact). No-ops / false when not built for aarch64.
void neon_use_dotprod(bool on);
bool neon_uses_dotprod();
// One work item with isa's kernel (scalar / avx2 / avx512 / neon). A packed chunk goes to the
// kernels that do not read the packed layout (all but avx512) as a row-major copy of its rows
// n0 .. n1-1 first (a thread-local buffer); K: the weight's columns.
void qgemm_run(CpuIsa isa, const QJob& j, int64_t K);

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
void fgemm_neon(const FJob& j);

// Block b of a weight row, as quant.h's arithmetic reads it: the exact integer codes c[32], the
// scale dw and (types with a min) mw. Reference (scalar) decoding.
void wblock_decode(DType wt, const uint8_t* row, int64_t b, int32_t* c, float* dw, float* mw);
// Whether the weight type adds the mw * fx term.
inline bool wtype_has_min(DType t) {
  return t == DType::Q4_1 || t == DType::Q5_1 || t == DType::Q4_K || t == DType::Q5_K;
}
// isum_b of quant.h for weight row `row`, block b, activation codes q (exact).
int32_t block_dot_ref(DType wt, const uint8_t* row, int64_t b, const int8_t* q);
// Bytes of one 32-block for the 32-block types (0 for the K-quants).
inline int wblock_bytes(DType t) {
  switch (t) {
    case DType::Q4_0: return 18;
    case DType::Q4_1: return 20;
    case DType::Q5_0: return 22;
    case DType::Q5_1: return 24;
    case DType::Q8_0: return 34;
    default: return 0;
  }
}

}  // namespace mm

}  // namespace pyfast
