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

}  // namespace

bool quant_supported(DType t) {
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16:
    case DType::Q4_0: case DType::Q4_1: case DType::Q8_0: case DType::Q8_1:
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
  check_blocks("quantize_row_ref", n);
  const int64_t nb = n / QK;
  switch (t) {
    case DType::Q4_0: quantize_q4_0(src, static_cast<block_q4_0*>(dst), nb); return;
    case DType::Q4_1: quantize_q4_1(src, static_cast<block_q4_1*>(dst), nb); return;
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
  if (!quant_supported(t)) unsupported("row_from_f32", t);
  quantize_row_ref(t, src, dst, n);
}

namespace mm {

int32_t block_dot_ref(DType wt, const uint8_t* wb, const int8_t* q) {
  int32_t s = 0;
  switch (wt) {
    case DType::Q4_0: {
      const uint8_t* qs = wb + 2;
      for (int j = 0; j < QK / 2; ++j)
        s += ((qs[j] & 0x0F) - 8) * q[j] + ((qs[j] >> 4) - 8) * q[j + QK / 2];
      break;
    }
    case DType::Q4_1: {
      const uint8_t* qs = wb + 4;
      for (int j = 0; j < QK / 2; ++j) s += (qs[j] & 0x0F) * q[j] + (qs[j] >> 4) * q[j + QK / 2];
      break;
    }
    case DType::Q8_0: {
      const int8_t* qs = reinterpret_cast<const int8_t*>(wb + 2);
      for (int j = 0; j < QK; ++j) s += qs[j] * q[j];
      break;
    }
    default: break;
  }
  return s;
}

}  // namespace mm

}  // namespace pyfast
