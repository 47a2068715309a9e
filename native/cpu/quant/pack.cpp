// The packed ("x16") weight layout of quant.h: 16 rows per chunk, each block's scales and
// transposed codes together. Packing only moves bytes.
#include <cstring>

#include "cpu/quant/quant.h"

namespace pyfast {

namespace {

// Byte offsets in a row-major block: scales (d, then m for Q4_1) and codes.
struct BlockFmt {
  int bs = 0, n_scale = 0, qs = 0, n_qs = 0;
};

BlockFmt fmt(DType t) {
  switch (t) {
    case DType::Q4_0: return {18, 1, 2, 16};
    case DType::Q4_1: return {20, 2, 4, 16};
    case DType::Q8_0: return {34, 1, 2, 32};
    default: return {};
  }
}

// Chunk block layout: [n_scale][16] fp16 scales, then n_qs / 4 vectors of 16 dwords.
inline void pack_block(const BlockFmt& f, const uint8_t* const* rows, int64_t b, uint8_t* out) {
  for (int k = 0; k < f.n_scale; ++k)
    for (int r = 0; r < 16; ++r) std::memcpy(out + (k * 16 + r) * 2, rows[r] + b * f.bs + 2 * k, 2);
  uint8_t* q = out + f.n_scale * 32;
  for (int g = 0; g < f.n_qs / 4; ++g)
    for (int r = 0; r < 16; ++r) std::memcpy(q + g * 64 + r * 4, rows[r] + b * f.bs + f.qs + 4 * g, 4);
}

}  // namespace

bool packable(DType t) { return fmt(t).bs != 0; }

void pack_x16(DType t, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K) {
  const BlockFmt f = fmt(t);
  const int64_t nb = K / QK, rb = nb * f.bs;
  for (int64_t c = 0; c < N / 16; ++c) {
    const uint8_t* rows[16];
    for (int r = 0; r < 16; ++r) rows[r] = src + (c * 16 + r) * rb;
    uint8_t* out = dst + c * 16 * rb;
    for (int64_t b = 0; b < nb; ++b) pack_block(f, rows, b, out + b * 16 * f.bs);
  }
}

void unpack_x16(DType t, const uint8_t* chunk, int64_t K, int r0, int nr, uint8_t* dst) {
  const BlockFmt f = fmt(t);
  const int64_t nb = K / QK, rb = nb * f.bs;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* in = chunk + b * 16 * f.bs;
    for (int i = 0; i < nr; ++i) {
      const int r = r0 + i;
      uint8_t* o = dst + i * rb + b * f.bs;
      for (int k = 0; k < f.n_scale; ++k) std::memcpy(o + 2 * k, in + (k * 16 + r) * 2, 2);
      for (int g = 0; g < f.n_qs / 4; ++g) std::memcpy(o + f.qs + 4 * g, in + f.n_scale * 32 + g * 64 + r * 4, 4);
    }
  }
}

}  // namespace pyfast
