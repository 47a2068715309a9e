// Reference row codecs (bit-compatible with ggml / gguf.quants) and row_to_f32 / row_from_f32.
#include "cpu/quant/quant.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace pyfast {

namespace {

inline uint16_t h(float f) { return fp32_to_fp16(f); }
inline float f(uint16_t v) { return fp16_to_fp32(v); }
inline uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

[[noreturn]] void unsupported(const char* what, DType t) {
  throw std::invalid_argument(std::string("[") + what + "] unsupported dtype id " + std::to_string((int)t));
}

void check_blocks(const char* what, int64_t n) {
  if (n % QK != 0) throw std::invalid_argument(std::string("[") + what + "] n must be a multiple of 32");
}

// Q4 code for x*id + bias truncated toward zero and clamped to [0, 15] (gguf: trunc, clip).
inline uint8_t q4_code(float v) {
  const float t = std::trunc(v);
  if (!(t > 0.0f)) return 0;  // also NaN
  return t >= 15.0f ? 15 : (uint8_t)t;
}

void quantize_q8_0(const float* x, block_q8_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = h(d);
    for (int j = 0; j < QK; ++j) y[i].qs[j] = (int8_t)std::round(x[j] * id);
  }
}

void quantize_q8_1(const float* x, block_q8_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      y[i].qs[j] = (int8_t)std::round(x[j] * id);
      sum += y[i].qs[j];
    }
    y[i].d = h(d);
    y[i].s = h((float)sum * d);
  }
}

void quantize_q4_0(const float* x, block_q4_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f, max = 0.0f;  // the element of largest magnitude (first one on ties)
    for (int j = 0; j < QK; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = h(d);
    for (int j = 0; j < QK / 2; ++j) {
      const uint8_t a = q4_code(x[j] * id + 8.5f);
      const uint8_t b = q4_code(x[j + QK / 2] * id + 8.5f);
      y[i].qs[j] = (uint8_t)(a | (b << 4));
    }
  }
}

void quantize_q4_1(const float* x, block_q4_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = h(d);
    y[i].m = h(min);
    for (int j = 0; j < QK / 2; ++j) {
      const uint8_t a = q4_code((x[j] - min) * id + 0.5f);
      const uint8_t b = q4_code((x[j + QK / 2] - min) * id + 0.5f);
      y[i].qs[j] = (uint8_t)(a | (b << 4));
    }
  }
}

// Q5 code: truncation toward zero clamped to [0, 31] (gguf: trunc, clip).
inline uint8_t q5_code(float v) {
  const float t = std::trunc(v);
  if (!(t > 0.0f)) return 0;  // also NaN
  return t >= 31.0f ? 31 : (uint8_t)t;
}

// Pack 32 five-bit codes: nibbles like Q4_0, bit 4 of element j into bit j of qh (little endian).
void pack_q5(const uint8_t* q, uint8_t* qh, uint8_t* qs) {
  uint32_t h = 0;
  for (int j = 0; j < QK; ++j) h |= (uint32_t)((q[j] >> 4) & 1) << j;
  for (int j = 0; j < QK / 2; ++j) qs[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + QK / 2] & 0x0F) << 4));
  std::memcpy(qh, &h, 4);
}

void unpack_q5(const uint8_t* qh, const uint8_t* qs, uint8_t* q) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int j = 0; j < QK / 2; ++j) {
    q[j] = (uint8_t)((qs[j] & 0x0F) | (((h >> j) & 1) << 4));
    q[j + QK / 2] = (uint8_t)((qs[j] >> 4) | (((h >> (j + QK / 2)) & 1) << 4));
  }
}

void quantize_q5_0(const float* x, block_q5_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f, max = 0.0f;  // the element of largest magnitude (first one on ties)
    for (int j = 0; j < QK; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -16.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = h(d);
    uint8_t q[QK];
    for (int j = 0; j < QK; ++j) q[j] = q5_code(x[j] * id + 16.5f);
    pack_q5(q, y[i].qh, y[i].qs);
  }
}

void quantize_q5_1(const float* x, block_q5_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / 31.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = h(d);
    y[i].m = h(min);
    uint8_t q[QK];
    for (int j = 0; j < QK; ++j) q[j] = q5_code((x[j] - min) * id + 0.5f);
    pack_q5(q, y[i].qh, y[i].qs);
  }
}

bool is_k(DType t) { return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K; }

}  // namespace

bool quant_supported(DType t) {
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16:
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0: case DType::Q8_1:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      return true;
    default:
      return false;
  }
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, src, (size_t)n * 4);
      return;
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(s[i]);
      return;
    }
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(s[i]);
      return;
    }
    default: break;
  }
  if (is_k(t)) return dequantize_row_k(t, src, dst, n);
  check_blocks("dequantize_row", n);
  const int64_t nb = n / QK;
  switch (t) {
    case DType::Q4_0: {
      const block_q4_0* b = static_cast<const block_q4_0*>(src);
      for (int64_t i = 0; i < nb; ++i, dst += QK) {
        const float d = f(b[i].d);
        for (int j = 0; j < QK / 2; ++j) {
          dst[j] = d * (float)((b[i].qs[j] & 0x0F) - 8);
          dst[j + QK / 2] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
      }
      return;
    }
    case DType::Q4_1: {
      const block_q4_1* b = static_cast<const block_q4_1*>(src);
      for (int64_t i = 0; i < nb; ++i, dst += QK) {
        const float d = f(b[i].d), m = f(b[i].m);
        for (int j = 0; j < QK / 2; ++j) {
          dst[j] = d * (float)(b[i].qs[j] & 0x0F) + m;
          dst[j + QK / 2] = d * (float)(b[i].qs[j] >> 4) + m;
        }
      }
      return;
    }
    case DType::Q5_0: {
      const block_q5_0* b = static_cast<const block_q5_0*>(src);
      uint8_t q[QK];
      for (int64_t i = 0; i < nb; ++i, dst += QK) {
        const float d = f(b[i].d);
        unpack_q5(b[i].qh, b[i].qs, q);
        for (int j = 0; j < QK; ++j) dst[j] = d * (float)(q[j] - 16);
      }
      return;
    }
    case DType::Q5_1: {
      const block_q5_1* b = static_cast<const block_q5_1*>(src);
      uint8_t q[QK];
      for (int64_t i = 0; i < nb; ++i, dst += QK) {
        const float d = f(b[i].d), m = f(b[i].m);
        unpack_q5(b[i].qh, b[i].qs, q);
        for (int j = 0; j < QK; ++j) dst[j] = d * (float)q[j] + m;
      }
      return;
    }
    case DType::Q8_0: {
      const block_q8_0* b = static_cast<const block_q8_0*>(src);
      for (int64_t i = 0; i < nb; ++i, dst += QK) {
        const float d = f(b[i].d);
        for (int j = 0; j < QK; ++j) dst[j] = d * (float)b[i].qs[j];
      }
      return;
    }
    case DType::Q8_1: {
      const block_q8_1* b = static_cast<const block_q8_1*>(src);
      for (int64_t i = 0; i < nb; ++i, dst += QK) {
        const float d = f(b[i].d);
        for (int j = 0; j < QK; ++j) dst[j] = d * (float)b[i].qs[j];
      }
      return;
    }
    default: unsupported("dequantize_row", t);
  }
}

void quantize_row_ref(DType t, const float* src, void* dst, int64_t n) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, src, (size_t)n * 4);
      return;
    case DType::F16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = fp32_to_fp16(src[i]);
      return;
    }
    case DType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = fp32_to_bf16(src[i]);
      return;
    }
    default: break;
  }
  if (is_k(t)) return quantize_row_k(t, src, dst, n);
  check_blocks("quantize_row_ref", n);
  const int64_t nb = n / QK;
  switch (t) {
    case DType::Q4_0: quantize_q4_0(src, static_cast<block_q4_0*>(dst), nb); return;
    case DType::Q4_1: quantize_q4_1(src, static_cast<block_q4_1*>(dst), nb); return;
    case DType::Q5_0: quantize_q5_0(src, static_cast<block_q5_0*>(dst), nb); return;
    case DType::Q5_1: quantize_q5_1(src, static_cast<block_q5_1*>(dst), nb); return;
    case DType::Q8_0: quantize_q8_0(src, static_cast<block_q8_0*>(dst), nb); return;
    case DType::Q8_1: quantize_q8_1(src, static_cast<block_q8_1*>(dst), nb); return;
    default: unsupported("quantize_row_ref", t);
  }
}

void row_to_f32(DType t, const void* src, float* dst, int64_t n) {
  if (!quant_supported(t)) unsupported("row_to_f32", t);
  dequantize_row(t, src, dst, n);
}

void row_from_f32(DType t, const float* src, void* dst, int64_t n) {
  if (t == DType::F16) return fp32_to_fp16_row(src, static_cast<uint16_t*>(dst), n);  // KV cache rows
  if (!quant_supported(t)) unsupported("row_from_f32", t);
  quantize_row_ref(t, src, dst, n);
}

namespace mm {

void wblock_decode(DType wt, const uint8_t* row, int64_t b, int32_t* c, float* dw, float* mw) {
  *mw = 0.0f;
  switch (wt) {
    case DType::Q4_0: case DType::Q4_1: {
      const uint8_t* wb = row + b * wblock_bytes(wt);
      const uint8_t* qs = wb + (wt == DType::Q4_1 ? 4 : 2);
      const int off = wt == DType::Q4_0 ? 8 : 0;
      for (int j = 0; j < QK / 2; ++j) {
        c[j] = (qs[j] & 0x0F) - off;
        c[j + QK / 2] = (qs[j] >> 4) - off;
      }
      *dw = f(ld16(wb));
      if (wt == DType::Q4_1) *mw = f(ld16(wb + 2));
      return;
    }
    case DType::Q5_0: case DType::Q5_1: {
      const uint8_t* wb = row + b * wblock_bytes(wt);
      const int hoff = wt == DType::Q5_1 ? 4 : 2;
      uint8_t q[QK];
      unpack_q5(wb + hoff, wb + hoff + 4, q);
      const int off = wt == DType::Q5_0 ? 16 : 0;
      for (int j = 0; j < QK; ++j) c[j] = q[j] - off;
      *dw = f(ld16(wb));
      if (wt == DType::Q5_1) *mw = f(ld16(wb + 2));
      return;
    }
    case DType::Q8_0: {
      const uint8_t* wb = row + b * 34;
      for (int j = 0; j < QK; ++j) c[j] = (int8_t)wb[2 + j];
      *dw = f(ld16(wb));
      return;
    }
    case DType::Q4_K: case DType::Q5_K: {
      const int bytes = wt == DType::Q4_K ? 144 : 176;
      const uint8_t* sb = row + (b >> 3) * bytes;
      const int j = (int)(b & 7);
      int sc, m;
      kscale_get(sb + 4, j, sc, m);
      const uint8_t* qs = sb + (wt == DType::Q4_K ? 16 : 48) + 32 * (j >> 1);
      const int sh = 4 * (j & 1);
      for (int l = 0; l < QK; ++l) c[l] = (qs[l] >> sh) & 0x0F;
      if (wt == DType::Q5_K)
        for (int l = 0; l < QK; ++l) c[l] |= ((sb[16 + l] >> j) & 1) << 4;
      *dw = f(ld16(sb)) * (float)sc;
      *mw = -(f(ld16(sb + 2)) * (float)m);
      return;
    }
    case DType::Q6_K: {
      const uint8_t* sb = row + (b >> 3) * 210;
      const int j = (int)(b & 7);
      const uint8_t* ql = sb + 64 * (j >> 2) + 32 * (j & 1);
      const uint8_t* qh = sb + 128 + 32 * (j >> 2);
      const int sl = 4 * ((j >> 1) & 1), shh = 2 * (j & 3);
      const int8_t* scales = reinterpret_cast<const int8_t*>(sb + 192);
      for (int l = 0; l < QK; ++l) {
        const int q = ((ql[l] >> sl) & 0x0F) | (((qh[l] >> shh) & 3) << 4);
        c[l] = scales[2 * j + (l >> 4)] * (q - 32);
      }
      *dw = f(ld16(sb + 208));
      return;
    }
    default:
      unsupported("wblock_decode", wt);
  }
}

int32_t block_dot_ref(DType wt, const uint8_t* row, int64_t b, const int8_t* q) {
  int32_t c[QK];
  float dw, mw;
  wblock_decode(wt, row, b, c, &dw, &mw);
  int32_t s = 0;
  for (int j = 0; j < QK; ++j) s += c[j] * q[j];
  return s;
}

}  // namespace mm

}  // namespace pyfast
