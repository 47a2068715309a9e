// Shared by the SIMD matmul kernels: weight-type traits and the per-chunk tables of block
// scales (see quant.h for the arithmetic they feed).
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu/quant/quant.h"

namespace pyfast {
namespace mm {

template <DType WT>
constexpr bool kIsK = WT == DType::Q4_K || WT == DType::Q5_K || WT == DType::Q6_K;
template <DType WT>
constexpr bool kHasMin = WT == DType::Q4_1 || WT == DType::Q5_1 || WT == DType::Q4_K || WT == DType::Q5_K;
// Bytes of a K-quant super-block.
template <DType WT>
constexpr int kSuperBytes = WT == DType::Q4_K ? 144 : WT == DType::Q5_K ? 176 : WT == DType::Q6_K ? 210 : 0;
// log2 of the code offset the kernels subtract as offset * sx (unsigned codes): Q4_0 8, Q5_0 16.
// (Q8_0 with u8-biased codes subtracts 128 * sx; Q6_K's offset 32 is handled per half-block.)
template <DType WT>
constexpr int kOffsetShift = WT == DType::Q4_0 ? 3 : WT == DType::Q5_0 ? 4 : 0;

// Tables for a chunk of 16 weight rows of a K-quant, [b][16] (row r of block b at b * 16 + r):
// dw (float scale) and mw (float min, Q4_K / Q5_K), or for Q6_K the int8 sub-scales of the
// block's two halves widened to int32 (slo, shi). Values exactly as wblock_decode gives them.
template <DType WT>
inline void fill_ktables(const uint8_t* const* rows, int64_t nb, float* dw, float* mw, int32_t* slo, int32_t* shi) {
  constexpr int SB = kSuperBytes<WT>;
  for (int r = 0; r < 16; ++r) {
    for (int64_t B = 0; B < nb / 8; ++B) {
      const uint8_t* sb = rows[r] + B * SB;
      uint16_t hv[2];
      if constexpr (WT == DType::Q6_K) {
        std::memcpy(hv, sb + 208, 2);
        const float d = fp16_to_fp32(hv[0]);
        const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
        for (int j = 0; j < 8; ++j) {
          const int64_t i = (B * 8 + j) * 16 + r;
          dw[i] = d;
          slo[i] = sc[2 * j];
          shi[i] = sc[2 * j + 1];
        }
      } else {
        std::memcpy(hv, sb, 4);
        const float d = fp16_to_fp32(hv[0]), dmin = fp16_to_fp32(hv[1]);
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          kscale_get(sb + 4, j, sc, m);
          const int64_t i = (B * 8 + j) * 16 + r;
          dw[i] = d * (float)sc;
          mw[i] = -(dmin * (float)m);
        }
      }
    }
  }
}

}  // namespace mm
}  // namespace pyfast
