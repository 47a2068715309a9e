// K-quant codecs (Q4_K, Q5_K, Q6_K): dequantization bit-identical to gguf.quants, and
// quantizers that search each sub-block's scale for the least (weighted) squared error. Also the
// searched 32-block quantizers (Q4_0, Q4_1, Q5_0, Q5_1) the whole-tensor quantizer uses.
//
// How the quantizers work (super-block of 256 values):
//  1. Each sub-block gets a real-valued fit. Q4_K / Q5_K (32 values, codes 0..nmax) fit
//     x ~ a * L - m with a >= 0, m >= 0 (m is stored unsigned): for a grid of inverse scales
//     around nmax / (max - min) the codes L = round(iscale * (x - min)) are formed and (a, m) solved
//     by weighted least squares for those codes (m clamped at 0); the best candidate is then
//     polished by alternating "codes from (a, m)" and "(a, m) from codes" while the error drops.
//     Q6_K (16 values, codes -32..31) fits x ~ a * L the same way with a one-parameter fit.
//  2. The sub-block scales (and mins) are quantized against one fp16 super-block scale
//     (Q4_K / Q5_K: 6-bit unsigned, d = max / 63; Q6_K: int8, d = max / -128 so that the largest
//     magnitude lands on -128, the end of int8 with the most room).
//  3. The codes are re-rounded for the quantized scales; then the fp16 super-block scale(s) are
//     refitted by least squares over the whole super-block (codes and 6/8-bit scales fixed), kept
//     only when the super-block error drops.
// Weights: the fit minimizes sum w_i (x_i - y_i)^2 with w_i = rms(sub-block) + |x_i| (Q4_K / Q5_K)
// or x_i^2 + eps (Q6_K), which favours the large-magnitude weights; step 3 uses plain squared error.
// The 32-block types fit each block the same way (symmetric for Q4_0 / Q5_0, affine with a free
// min for Q4_1 / Q5_1), then refit the fp16 scale (and min) for the chosen codes.
// Everything is plain float arithmetic in a fixed order: the bytes are deterministic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/quant/quant.h"

namespace pyfast {

namespace {

inline float f16(uint16_t v) { return fp16_to_fp32(v); }
inline uint16_t h16(float v) { return fp32_to_fp16(v); }

// Round to nearest (ties to even) for |v| < 2^22; larger values are clamped first (the callers
// clamp the result to a small code range anyway).
inline int rnd(float v) {
  v = v < -4.0e6f ? -4.0e6f : v > 4.0e6f ? 4.0e6f : v;
  float t = v + 12582912.0f;  // 1.5 * 2^23: the sum's low mantissa bits are the rounded integer
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007FFFFF) - 0x00400000;
}

inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

// ------------------------------------------------------------------------------ sub-block fits

// Weighted least squares x ~ a * L + b (with b <= 0 when nonpos); returns the weighted squared
// error.
float ls_affine(const float* x, const float* w, const uint8_t* L, int n, float& a, float& b, bool nonpos = true) {
  float sw = 0, sl = 0, sl2 = 0, sx = 0, slx = 0;
  for (int i = 0; i < n; ++i) {
    const float l = (float)L[i];
    sw += w[i];
    sl += w[i] * l;
    sl2 += w[i] * l * l;
    sx += w[i] * x[i];
    slx += w[i] * l * x[i];
  }
  const float D = sw * sl2 - sl * sl;
  if (D > 0.0f) {
    a = (sw * slx - sl * sx) / D;
    b = (sl2 * sx - sl * slx) / D;
  } else {
    a = 0.0f;
    b = sw > 0.0f ? sx / sw : 0.0f;
  }
  if (nonpos && b > 0.0f) {
    b = 0.0f;
    a = sl2 > 0.0f ? slx / sl2 : 0.0f;
  }
  if (a < 0.0f) a = 0.0f;
  float err = 0;
  for (int i = 0; i < n; ++i) {
    const float e = a * (float)L[i] + b - x[i];
    err += w[i] * e * e;
  }
  return err;
}

inline void codes_affine(const float* x, int n, int nmax, float a, float b, uint8_t* L) {
  const float ia = a > 0.0f ? 1.0f / a : 0.0f;
  for (int i = 0; i < n; ++i) L[i] = (uint8_t)clampi(rnd((x[i] - b) * ia), 0, nmax);
}

// x ~ a * L - m, L in [0, nmax]: returns a >= 0 and sets m (>= 0 when nonpos, i.e. the offset
// -m is never positive, as Q4_K / Q5_K store m unsigned).
float fit_affine(const float* x, const float* w, int n, int nmax, float rmin, float rdelta, int nstep, float& m,
                 bool nonpos = true) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  if (nonpos) lo = std::min(lo, 0.0f);
  if (!(hi > lo)) {  // all values equal and <= 0 (or NaN)
    m = std::isfinite(lo) ? -lo : 0.0f;
    return 0.0f;
  }
  uint8_t L[32], T[32];
  // Baseline: the plain min..max mapping.
  float a = (hi - lo) / (float)nmax, b = lo;
  codes_affine(x, n, nmax, a, b, L);
  float best = 0;
  for (int i = 0; i < n; ++i) {
    const float e = a * (float)L[i] + b - x[i];
    best += w[i] * e * e;
  }
  for (int k = 0; k <= nstep; ++k) {
    const float is = (rmin + rdelta * (float)k + (float)nmax) / (hi - lo);
    for (int i = 0; i < n; ++i) T[i] = (uint8_t)clampi(rnd(is * (x[i] - lo)), 0, nmax);
    float ta, tb;
    const float err = ls_affine(x, w, T, n, ta, tb, nonpos);
    if (err < best) {
      best = err;
      a = ta;
      b = tb;
    }
  }
  // Polish: codes from (a, b), then (a, b) from the codes, while the error drops.
  for (int it = 0; it < 3 && a > 0.0f; ++it) {
    codes_affine(x, n, nmax, a, b, T);
    float ta, tb;
    const float err = ls_affine(x, w, T, n, ta, tb, nonpos);
    if (!(err < best)) break;
    best = err;
    a = ta;
    b = tb;
  }
  m = -b;
  return a;
}

// x ~ a * L, L in [-nmax, nmax - 1]; returns a (signed).
float fit_sym(const float* x, const float* w, int n, int nmax, int nstep, float step) {
  float amax = 0.0f, vmax = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      vmax = x[i];
    }
  }
  if (!(amax > 1e-30f)) return 0.0f;
  float best_num = -1.0f, best_den = 1.0f, a = -vmax / (float)nmax;
  for (int k = -nstep; k <= nstep; ++k) {
    const float is = -((float)nmax + step * (float)k) / vmax;
    float slx = 0, sl2 = 0;
    for (int i = 0; i < n; ++i) {
      const float l = (float)clampi(rnd(is * x[i]), -nmax, nmax - 1);
      slx += w[i] * l * x[i];
      sl2 += w[i] * l * l;
    }
    // error = sum w x^2 - slx^2 / sl2: maximize slx^2 / sl2
    if (sl2 > 0.0f && slx * slx * best_den > best_num * sl2) {
      best_num = slx * slx;
      best_den = sl2;
      a = slx / sl2;
    }
  }
  for (int it = 0; it < 2 && a != 0.0f; ++it) {
    const float ia = 1.0f / a;
    float slx = 0, sl2 = 0;
    for (int i = 0; i < n; ++i) {
      const float l = (float)clampi(rnd(x[i] * ia), -nmax, nmax - 1);
      slx += w[i] * l * x[i];
      sl2 += w[i] * l * l;
    }
    if (!(sl2 > 0.0f && slx * slx * best_den > best_num * sl2)) break;
    best_num = slx * slx;
    best_den = sl2;
    a = slx / sl2;
  }
  return a;
}

// ------------------------------------------------------------------------------ Q4_K / Q5_K

void kscale_set(uint8_t* s, const uint8_t* sc, const uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    s[j + 8] = (uint8_t)((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
  }
}

// Codes of a super-block for fp16 scales d, dmin and 6-bit sc, m; returns the squared error.
float k_codes(const float* x, int nmax, float d, float dmin, const uint8_t* sc, const uint8_t* m, uint8_t* L) {
  float err = 0;
  for (int j = 0; j < 8; ++j) {
    const float dl = d * (float)sc[j], ml = dmin * (float)m[j];
    const float idl = dl > 0.0f ? 1.0f / dl : 0.0f;
    for (int i = 0; i < 32; ++i) {
      const float v = x[32 * j + i];
      const int q = clampi(rnd((v + ml) * idl), 0, nmax);
      L[32 * j + i] = (uint8_t)q;
      const float e = dl * (float)q - ml - v;
      err += e * e;
    }
  }
  return err;
}

// One Q4_K / Q5_K super-block: fills d, dmin, the packed scales and the codes L[256].
void quantize_super_affine(const float* x, int nmax, uint16_t& d_out, uint16_t& dmin_out, uint8_t* scales,
                           uint8_t* L) {
  float a[8], mn[8], w[32];
  const float rmin = nmax == 15 ? -1.0f : -0.5f;
  const int nstep = nmax == 15 ? 20 : 15;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float s2 = 0;
    for (int i = 0; i < 32; ++i) s2 += xs[i] * xs[i];
    const float av = std::sqrt(s2 / 32.0f);
    for (int i = 0; i < 32; ++i) w[i] = av + std::fabs(xs[i]);
    a[j] = fit_affine(xs, w, 32, nmax, rmin, 0.1f, nstep, mn[j]);
  }
  float amax = 0, mmax = 0;
  for (int j = 0; j < 8; ++j) {
    amax = std::max(amax, a[j]);
    mmax = std::max(mmax, mn[j]);
  }
  uint8_t sc[8], m[8];
  const float ia = amax > 0.0f ? 63.0f / amax : 0.0f;
  const float im = mmax > 0.0f ? 63.0f / mmax : 0.0f;
  for (int j = 0; j < 8; ++j) {
    sc[j] = (uint8_t)clampi(rnd(ia * a[j]), 0, 63);
    m[j] = (uint8_t)clampi(rnd(im * mn[j]), 0, 63);
  }
  uint16_t dh = h16(amax / 63.0f), mh = h16(mmax / 63.0f);
  float err = k_codes(x, nmax, f16(dh), f16(mh), sc, m, L);
  // Refit d and dmin over the super-block for the fixed codes and 6-bit scales:
  // x ~ d * (sc_j L) - dmin * m_j.
  uint8_t T[QK_K];
  for (int it = 0; it < 2; ++it) {
    float s11 = 0, s12 = 0, s22 = 0, b1 = 0, b2 = 0;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) {
        const float u = (float)sc[j] * (float)L[32 * j + i], v = -(float)m[j], xv = x[32 * j + i];
        s11 += u * u;
        s12 += u * v;
        s22 += v * v;
        b1 += u * xv;
        b2 += v * xv;
      }
    const float D = s11 * s22 - s12 * s12;
    float nd, nm;
    if (D > 0.0f) {
      nd = (b1 * s22 - b2 * s12) / D;
      nm = (s11 * b2 - s12 * b1) / D;
    } else if (s11 > 0.0f) {
      nd = b1 / s11;
      nm = f16(mh);
    } else {
      break;
    }
    if (!(nd >= 0.0f) || !(nm >= 0.0f)) break;
    const uint16_t ndh = h16(nd), nmh = h16(nm);
    if (ndh == dh && nmh == mh) break;
    const float e2 = k_codes(x, nmax, f16(ndh), f16(nmh), sc, m, T);
    if (!(e2 < err)) break;
    err = e2;
    dh = ndh;
    mh = nmh;
    std::memcpy(L, T, QK_K);
  }
  d_out = dh;
  dmin_out = mh;
  kscale_set(scales, sc, m);
}

void quantize_q4_K(const float* x, block_q4_K* y, int64_t nb) {
  uint8_t L[QK_K];
  for (int64_t i = 0; i < nb; ++i, x += QK_K) {
    quantize_super_affine(x, 15, y[i].d, y[i].dmin, y[i].scales, L);
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) y[i].qs[32 * p + l] = (uint8_t)(L[64 * p + l] | (L[64 * p + 32 + l] << 4));
  }
}

void quantize_q5_K(const float* x, block_q5_K* y, int64_t nb) {
  uint8_t L[QK_K];
  for (int64_t i = 0; i < nb; ++i, x += QK_K) {
    quantize_super_affine(x, 31, y[i].d, y[i].dmin, y[i].scales, L);
    std::memset(y[i].qh, 0, sizeof(y[i].qh));
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l)
        y[i].qs[32 * p + l] = (uint8_t)((L[64 * p + l] & 0x0F) | ((L[64 * p + 32 + l] & 0x0F) << 4));
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) y[i].qh[l] |= (uint8_t)(((L[32 * j + l] >> 4) & 1) << j);
  }
}

// ------------------------------------------------------------------------------ Q6_K

float q6_codes(const float* x, float d, const int8_t* sc, int8_t* L) {
  float err = 0;
  for (int j = 0; j < 16; ++j) {
    const float dl = d * (float)sc[j];
    const float idl = dl != 0.0f ? 1.0f / dl : 0.0f;
    for (int i = 0; i < 16; ++i) {
      const float v = x[16 * j + i];
      const int q = clampi(rnd(v * idl), -32, 31);
      L[16 * j + i] = (int8_t)q;
      const float e = dl * (float)q - v;
      err += e * e;
    }
  }
  return err;
}

void quantize_q6_K(const float* x, block_q6_K* y, int64_t nb) {
  int8_t L[QK_K], T[QK_K];
  for (int64_t ib = 0; ib < nb; ++ib, x += QK_K) {
    float a[16], w[16];
    float smax = 0.0f, samax = 0.0f;
    for (int j = 0; j < 16; ++j) {
      const float* xs = x + 16 * j;
      for (int i = 0; i < 16; ++i) w[i] = xs[i] * xs[i] + 1e-30f;
      a[j] = fit_sym(xs, w, 16, 32, 9, 0.1f);
      if (std::fabs(a[j]) > samax) {
        samax = std::fabs(a[j]);
        smax = a[j];
      }
    }
    block_q6_K& b = y[ib];
    int8_t sc[16];
    if (!(samax > 0.0f)) {
      std::memset(&b, 0, sizeof(b));
      continue;
    }
    const float is = -128.0f / smax;
    for (int j = 0; j < 16; ++j) sc[j] = (int8_t)clampi(rnd(is * a[j]), -128, 127);
    uint16_t dh = h16(1.0f / is);
    float err = q6_codes(x, f16(dh), sc, L);
    for (int it = 0; it < 2; ++it) {  // refit d for the fixed codes and int8 scales
      float num = 0, den = 0;
      for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 16; ++i) {
          const float u = (float)sc[j] * (float)L[16 * j + i];
          num += u * x[16 * j + i];
          den += u * u;
        }
      if (!(den > 0.0f)) break;
      const uint16_t ndh = h16(num / den);
      if (ndh == dh) break;
      const float e2 = q6_codes(x, f16(ndh), sc, T);
      if (!(e2 < err)) break;
      err = e2;
      dh = ndh;
      std::memcpy(L, T, QK_K);
    }
    b.d = dh;
    std::memcpy(b.scales, sc, 16);
    for (int h = 0; h < 2; ++h) {
      const int8_t* Lh = L + 128 * h;
      for (int l = 0; l < 64; ++l) {
        const int q0 = Lh[l] + 32, q1 = Lh[64 + l] + 32;
        b.ql[64 * h + l] = (uint8_t)((q0 & 0x0F) | ((q1 & 0x0F) << 4));
      }
      for (int l = 0; l < 32; ++l) {
        uint8_t v = 0;
        for (int t = 0; t < 4; ++t) v |= (uint8_t)((((Lh[32 * t + l] + 32) >> 4) & 3) << (2 * t));
        b.qh[32 * h + l] = v;
      }
    }
  }
}

// ------------------------------------------------------------------------------ 32-block fits

// Q4_0 / Q5_0 (x = d * (q - nmax)) and Q4_1 / Q5_1 (x = d * q + m) with a searched scale: the
// whole-tensor quantizer uses these (the gguf-exact reference ones serve cpy / set_rows).
void set_q5_bits(uint8_t* qh, uint8_t* qs, const uint8_t* q) {
  uint32_t h = 0;
  for (int j = 0; j < 32; ++j) h |= (uint32_t)((q[j] >> 4) & 1) << j;
  for (int j = 0; j < 16; ++j) qs[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
  std::memcpy(qh, &h, 4);
}

void block_weights(const float* x, float* w) {
  float s2 = 0;
  for (int i = 0; i < 32; ++i) s2 += x[i] * x[i];
  const float av = std::sqrt(s2 / 32.0f);
  for (int i = 0; i < 32; ++i) w[i] = av + std::fabs(x[i]);
}

// Symmetric block: codes q in [0, 2 nmax - 1]; returns the fp16 d.
uint16_t fit_block_sym(const float* x, int nmax, uint8_t* q) {
  float w[32];
  block_weights(x, w);
  const float a = fit_sym(x, w, 32, nmax, 4, 0.2f * (float)nmax / 16.0f);
  auto codes = [&](uint16_t dh, uint8_t* out) {
    const float d = f16(dh), id = d != 0.0f ? 1.0f / d : 0.0f;
    float err = 0;
    for (int i = 0; i < 32; ++i) {
      const int l = clampi(rnd(x[i] * id), -nmax, nmax - 1);
      out[i] = (uint8_t)(l + nmax);
      const float e = d * (float)l - x[i];
      err += e * e;
    }
    return err;
  };
  uint16_t dh = h16(a);
  float err = codes(dh, q);
  uint8_t T[32];
  for (int it = 0; it < 2; ++it) {  // refit d for the codes of the rounded scale
    float num = 0, den = 0;
    for (int i = 0; i < 32; ++i) {
      const float l = (float)((int)q[i] - nmax);
      num += l * x[i];
      den += l * l;
    }
    if (!(den > 0.0f)) break;
    const uint16_t nh = h16(num / den);
    if (nh == dh) break;
    const float e2 = codes(nh, T);
    if (!(e2 < err)) break;
    err = e2;
    dh = nh;
    std::memcpy(q, T, 32);
  }
  return dh;
}

// Affine block: codes q in [0, nmax]; sets fp16 d and m.
void fit_block_affine(const float* x, int nmax, uint8_t* q, uint16_t& dh, uint16_t& mh) {
  float w[32], m;
  block_weights(x, w);
  const float a = fit_affine(x, w, 32, nmax, -0.5f, 0.2f, nmax == 15 ? 5 : 3, m, false);
  auto codes = [&](uint16_t dv, uint16_t mv, uint8_t* out) {
    const float d = f16(dv), mm = f16(mv), id = d > 0.0f ? 1.0f / d : 0.0f;
    float err = 0;
    for (int i = 0; i < 32; ++i) {
      const int l = clampi(rnd((x[i] - mm) * id), 0, nmax);
      out[i] = (uint8_t)l;
      const float e = d * (float)l + mm - x[i];
      err += e * e;
    }
    return err;
  };
  dh = h16(a);
  mh = h16(-m);
  float err = codes(dh, mh, q);
  uint8_t T[32];
  const float ones[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  for (int it = 0; it < 2; ++it) {  // refit (d, m) for the codes of the rounded scales
    float na, nb;
    ls_affine(x, ones, q, 32, na, nb, false);
    const uint16_t ndh = h16(na), nmh = h16(nb);
    if (ndh == dh && nmh == mh) break;
    const float e2 = codes(ndh, nmh, T);
    if (!(e2 < err)) break;
    err = e2;
    dh = ndh;
    mh = nmh;
    std::memcpy(q, T, 32);
  }
}

void quantize_fit32(DType t, const float* x, uint8_t* y, int64_t nb) {
  uint8_t q[32];
  for (int64_t i = 0; i < nb; ++i, x += 32) {
    switch (t) {
      case DType::Q4_0: {
        const uint16_t dh = fit_block_sym(x, 8, q);
        std::memcpy(y, &dh, 2);
        for (int j = 0; j < 16; ++j) y[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
        y += 18;
        break;
      }
      case DType::Q5_0: {
        const uint16_t dh = fit_block_sym(x, 16, q);
        std::memcpy(y, &dh, 2);
        set_q5_bits(y + 2, y + 6, q);
        y += 22;
        break;
      }
      case DType::Q4_1: {
        uint16_t dh, mh;
        fit_block_affine(x, 15, q, dh, mh);
        std::memcpy(y, &dh, 2);
        std::memcpy(y + 2, &mh, 2);
        for (int j = 0; j < 16; ++j) y[4 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
        y += 20;
        break;
      }
      default: {  // Q5_1
        uint16_t dh, mh;
        fit_block_affine(x, 31, q, dh, mh);
        std::memcpy(y, &dh, 2);
        std::memcpy(y + 2, &mh, 2);
        set_q5_bits(y + 4, y + 8, q);
        y += 24;
        break;
      }
    }
  }
}

void check_k(const char* what, int64_t n) {
  if (n % QK_K != 0) throw std::invalid_argument(std::string("[") + what + "] n must be a multiple of 256");
}

}  // namespace

void dequantize_row_k(DType t, const void* src, float* dst, int64_t n) {
  check_k("dequantize_row", n);
  const int64_t nb = n / QK_K;
  switch (t) {
    case DType::Q4_K: case DType::Q5_K: {
      const bool five = t == DType::Q5_K;
      const size_t bytes = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
      for (int64_t i = 0; i < nb; ++i, dst += QK_K) {
        const uint8_t* sb = static_cast<const uint8_t*>(src) + i * bytes;
        uint16_t dv, mv;
        std::memcpy(&dv, sb, 2);
        std::memcpy(&mv, sb + 2, 2);
        const float d = f16(dv), dmin = f16(mv);
        const uint8_t* qs = sb + (five ? 48 : 16);
        const uint8_t* qh = sb + 16;
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          kscale_get(sb + 4, j, sc, m);
          const float dl = d * (float)sc, ml = dmin * (float)m;
          const uint8_t* q = qs + 32 * (j >> 1);
          const int sh = 4 * (j & 1);
          for (int l = 0; l < 32; ++l) {
            int v = (q[l] >> sh) & 0x0F;
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            dst[32 * j + l] = dl * (float)v - ml;
          }
        }
      }
      return;
    }
    case DType::Q6_K: {
      const block_q6_K* b = static_cast<const block_q6_K*>(src);
      for (int64_t i = 0; i < nb; ++i, dst += QK_K) {
        const float d = f16(b[i].d);
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 32; ++l) {
            const uint8_t ql0 = b[i].ql[64 * h + l], ql1 = b[i].ql[64 * h + 32 + l], qh = b[i].qh[32 * h + l];
            const int q[4] = {(ql0 & 0x0F) | ((qh & 3) << 4), (ql1 & 0x0F) | (((qh >> 2) & 3) << 4),
                              (ql0 >> 4) | (((qh >> 4) & 3) << 4), (ql1 >> 4) | (((qh >> 6) & 3) << 4)};
            for (int t2 = 0; t2 < 4; ++t2) {
              const int e = 128 * h + 32 * t2 + l;
              dst[e] = (d * (float)b[i].scales[e / 16]) * (float)(q[t2] - 32);
            }
          }
      }
      return;
    }
    default:
      throw std::invalid_argument("[dequantize_row] not a K-quant dtype id " + std::to_string((int)t));
  }
}

void quantize_row_fit(DType t, const float* src, void* dst, int64_t n) {
  switch (t) {
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
      if (n % 32 != 0) throw std::invalid_argument("[quantize_row] n must be a multiple of 32");
      quantize_fit32(t, src, static_cast<uint8_t*>(dst), n / 32);
      return;
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      quantize_row_k(t, src, dst, n);
      return;
    default:
      quantize_row_ref(t, src, dst, n);
  }
}

void quantize_row_k(DType t, const float* src, void* dst, int64_t n) {
  check_k("quantize_row", n);
  const int64_t nb = n / QK_K;
  switch (t) {
    case DType::Q4_K: quantize_q4_K(src, static_cast<block_q4_K*>(dst), nb); return;
    case DType::Q5_K: quantize_q5_K(src, static_cast<block_q5_K*>(dst), nb); return;
    case DType::Q6_K: quantize_q6_K(src, static_cast<block_q6_K*>(dst), nb); return;
    default:
      throw std::invalid_argument("[quantize_row] not a K-quant dtype id " + std::to_string((int)t));
  }
}

}  // namespace pyfast
