// Scalar fp16 / bf16 conversions (declared in pyfast/cpu.h). Exact IEEE semantics:
// round-to-nearest-even, subnormals kept (no flush to zero), Inf kept, NaN kept as a quiet NaN
// with its sign and top payload bits (the same results as the F16C instructions).
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pyfast/cpu.h"

namespace pyfast {

namespace {
inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) {  // Inf / NaN (NaN quieted, payload kept)
    return u2f(sign | 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0u));
  }
  if (exp != 0) return u2f(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return u2f(sign);
  // Subnormal: value = man * 2^-24; normalise (exact in fp32).
  int e = -1;
  do {
    ++e;
    man <<= 1;
  } while ((man & 0x400u) == 0);
  // value = m * 2^-24 with m < 2^10; after s = e + 1 shifts man is in [2^10, 2^11), so
  // value = (man / 2^10) * 2^(-14 - s).
  const uint32_t s = (uint32_t)e + 1;
  return u2f(sign | ((127u - 14u - s) << 23) | ((man & 0x3FFu) << 13));
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) {  // Inf / NaN
    if (a == 0x7F800000u) return (uint16_t)(sign | 0x7C00u);
    return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // quiet NaN, top payload bits
  }
  if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520 -> Inf
  if (a >= 0x38800000u) {  // normal in fp16 (>= 2^-14)
    // Rebias exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even;
    // a carry out of the mantissa correctly bumps the exponent.
    const uint32_t r = a - 0x38000000u;  // exponent - 112
    const uint32_t lsb = (r >> 13) & 1u;
    return (uint16_t)(sign | ((r + 0xFFFu + lsb) >> 13));
  }
  if (a < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero (2^-25 ties to even 0)
  // Subnormal result: value = a * 2^-24 units; mantissa with implicit bit, shifted.
  const uint32_t exp = a >> 23;                 // 102 .. 112
  const uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exp;            // 14 .. 24: man >> shift = value / 2^-24
  const uint32_t q = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  uint32_t res = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return (uint16_t)(sign | res);  // res == 0x400 rolls into the smallest normal: correct
}

uint16_t fp32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// A row of fp32_to_fp16: F16C where the ISA has it (vcvtps2ph with round-to-nearest-even gives
// the same bits, subnormals and NaN payloads included), else the scalar conversion.
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) static void f32_to_f16_row_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}
#endif

void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n) {
#if defined(__x86_64__)
  if (cpu_isa() == CpuIsa::avx2 || cpu_isa() == CpuIsa::avx512) return f32_to_f16_row_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

}  // namespace pyfast
