// Standalone tests for the block codecs, fp16/bf16 conversion and the CPU matmul kernel.
//   test_quant_kernels            run all tests (exit code 0 = pass)
//   test_quant_kernels codec T    read f32 values from stdin, write quantize_row_ref(T) bytes to
//                                 stdout (T = Q4_0|Q4_1|Q8_0|Q8_1|F16|BF16; used to cross-check
//                                 against gguf.quants on large random data)
//   test_quant_kernels decode T   the inverse: bytes of type T on stdin -> f32 on stdout
//   test_quant_kernels sweep      only the activation quantizer and SIMD-vs-scalar sweep checks
//                                 (quick; used by tests/ops/test_neon_cross.py under qemu)
//
// Matmul checks, for every weight dtype and every ISA this machine has:
//   * scalar reference vs a double-precision evaluation of the same quantized math;
//   * SIMD vs scalar: bit-identical for quantized weights (all ISAs) and for float weights with
//     avx512 / neon (same 16-lane order); avx2 float within tolerance;
//   * a sweep of shapes (M = 1..17 and larger, odd N, K with unaligned tails for float weights),
//     every SIMD variant (avx2 with / without AVX-VNNI, neon with / without dotprod) bit-identical
//     to scalar (quantized; float with 16 lanes); the activation quantizer on edge data (inf, NaN,
//     huge, tiny) for neon; matmul_id (the MoE driver) on neon vs scalar;
//   * batch invariance: row m computed with M = 1, inside sub-batches at other offsets, and with
//     2, 3, 4 threads is bit-identical to the full single-thread result;
//   * strided / 4-D activations equal the contiguous 2-D result.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu/quant/quant.h"
#include "pyfast/cpu.h"
#include "pyfast/threadpool.h"

using namespace pyfast;

static int g_fail = 0, g_checks = 0;
#define CHECK(cond, ...)                                            \
  do {                                                              \
    ++g_checks;                                                     \
    if (!(cond)) {                                                  \
      if (++g_fail <= 30) {                                         \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__);            \
        std::printf(__VA_ARGS__);                                   \
        std::printf("\n");                                          \
      }                                                             \
    }                                                               \
  } while (0)

static const char* tname(DType t) { return dtype_name(t); }

static size_t row_bytes(DType t, int64_t n) { return dtype_row_size(t, n); }

static bool isa_ok(CpuIsa isa) {
  try {
    const CpuIsa prev = cpu_isa();
    set_cpu_isa(isa);
    set_cpu_isa(prev);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

// ------------------------------------------------------------------------------ fp16 / bf16

#if defined(__x86_64__)
__attribute__((target("f16c"))) static float hw_h2f(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) static uint16_t hw_f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#endif

static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static void test_fp16() {
  // Known values.
  CHECK(fp32_to_fp16(1.0f) == 0x3C00, "1.0");
  CHECK(fp32_to_fp16(-2.0f) == 0xC000, "-2.0");
  CHECK(fp32_to_fp16(65504.0f) == 0x7BFF, "max");
  CHECK(fp32_to_fp16(65520.0f) == 0x7C00, "65520 -> inf");
  CHECK(fp32_to_fp16(65519.996f) == 0x7BFF, "65519.99 -> max");
  CHECK(fp32_to_fp16(from_bits(0x33800000)) == 0x0001, "2^-24 smallest subnormal");
  CHECK(fp32_to_fp16(from_bits(0x33000000)) == 0x0000, "2^-25 ties to even zero");
  CHECK(fp32_to_fp16(from_bits(0x33000001)) == 0x0001, "just above 2^-25");
  CHECK(fp32_to_fp16(-0.0f) == 0x8000, "-0");
  CHECK(fp32_to_fp16(INFINITY) == 0x7C00 && fp32_to_fp16(-INFINITY) == 0xFC00, "inf");
  CHECK((fp32_to_fp16(NAN) & 0x7C00) == 0x7C00 && (fp32_to_fp16(NAN) & 0x3FF) != 0, "nan");
  CHECK(fp16_to_fp32(0x0001) == std::ldexp(1.0f, -24), "h 0x0001");
  CHECK(fp16_to_fp32(0x03FF) == std::ldexp(1023.0f, -24), "h 0x03FF");
  CHECK(std::isnan(fp16_to_fp32(0x7C01)) && std::isinf(fp16_to_fp32(0x7C00)), "h nan/inf");
  // Round trip of every half.
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32((uint16_t)h);
    if (std::isnan(f)) continue;
    if (fp32_to_fp16(f) != h) ++bad;
  }
  CHECK(bad == 0, "fp16 round trip: %d mismatches", bad);
#if defined(__x86_64__)
  if (cpu_features().f16c) {
    int bad1 = 0, bad2 = 0;
    for (uint32_t h = 0; h < 65536; ++h)
      if (bits(fp16_to_fp32((uint16_t)h)) != bits(hw_h2f((uint16_t)h))) ++bad1;
    CHECK(bad1 == 0, "fp16_to_fp32 vs F16C: %d mismatches", bad1);
    std::mt19937 rng(7);
    for (int i = 0; i < (1 << 23); ++i) {
      uint32_t u = rng();
      if (i & 1) u = (u & 0x8FFFFFFFu) | 0x30000000u;  // concentrate on the fp16 exponent range
      const float f = from_bits(u);
      if (fp32_to_fp16(f) != hw_f2h(f)) ++bad2;
    }
    for (uint32_t u = 0x33000000u - 64; u < 0x38800000u + 64; u += 97) {  // subnormal range
      if (fp32_to_fp16(from_bits(u)) != hw_f2h(from_bits(u))) ++bad2;
    }
    CHECK(bad2 == 0, "fp32_to_fp16 vs F16C: %d mismatches", bad2);
  }
#endif
  // bf16: round to nearest even.
  CHECK(fp32_to_bf16(1.0f) == 0x3F80, "bf16 1");
  CHECK(fp32_to_bf16(from_bits(0x3F808000)) == 0x3F80, "bf16 tie to even (down)");
  CHECK(fp32_to_bf16(from_bits(0x3F818000)) == 0x3F82, "bf16 tie to even (up)");
  CHECK(fp32_to_bf16(from_bits(0x3F808001)) == 0x3F81, "bf16 above tie");
  CHECK(fp32_to_bf16(from_bits(0x00018000)) == 0x0002, "bf16 subnormal kept");
  CHECK(fp32_to_bf16(INFINITY) == 0x7F80, "bf16 inf");
  CHECK(fp32_to_bf16(from_bits(0x7F7FFFFF)) == 0x7F80, "bf16 max float rounds to inf");
  CHECK((fp32_to_bf16(NAN) & 0x7FC0) == 0x7FC0, "bf16 nan quiet");
  CHECK((fp32_to_bf16(from_bits(0x7F800001)) & 0x7F) != 0 || (fp32_to_bf16(from_bits(0x7F800001)) & 0x40),
        "bf16 snan stays nan");
}

// ------------------------------------------------------------------------------ codecs

// Golden bytes from gguf.quants.quantize (gguf 0.19, ggml's reference) for golden_input().
static std::vector<float> golden_input() {
  std::vector<float> x(160, 0.0f);
  for (int j = 0; j < 32; ++j) x[j] = (float)(j - 15) + 0.5f;  // ties for roundf
  x[31] = 127.0f;
  for (int j = 0; j < 32; ++j) {
    x[32 + j] = (float)((j * 37) % 101 - 50) / 16.0f;
    x[64 + j] = (float)((j * 53) % 97 - 48) / 8.0f * (j % 3 ? 1.0f : -1.0f);
  }
  x[96 + 5] = -3.0f;  // Q4_0: first of two equal magnitudes wins
  x[96 + 7] = 3.0f;
  for (int j = 128; j < 160; ++j) x[j] = 1.25f;  // Q4_1: d = 0
  return x;
}
static const uint8_t kGoldQ8_0[170] = {0x00,0x3c,0xf1,0xf2,0xf3,0xf4,0xf5,0xf6,0xf7,0xf8,0xf9,0xfa,0xfb,0xfc,0xfd,0xfe,0xff,0x01,0x02,0x03,0x04,0x05,0x06,0x07,0x08,0x09,0x0a,0x0b,0x0c,0x0d,0x0e,0x0f,0x10,0x7f,0x4d,0x26,0x81,0xdf,0x3d,0x9a,0xf8,0x56,0xb4,0x12,0x70,0xcd,0x2b,0x89,0xe7,0x45,0xa2,0x00,0x5e,0xbb,0x19,0x77,0xd5,0x33,0x90,0xee,0x4c,0xaa,0x08,0x66,0xc3,0x21,0x7f,0xdc,0x0c,0x2a,0x7f,0x0d,0x99,0xdb,0xb1,0x3d,0x38,0x55,0xe0,0x94,0xf8,0x84,0xf0,0x9b,0x28,0x4d,0x40,0xcb,0xa9,0xe3,0x6f,0x05,0x86,0x13,0x62,0x2a,0xb6,0xbe,0xce,0x5a,0x1a,0x72,0x0c,0x26,0x00,0x00,0x00,0x00,0x00,0x81,0x00,0x7f,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x0a,0x21,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f,0x7f};
static const uint8_t kGoldQ4_0[90] = {0xf0,0xcb,0x89,0x89,0x89,0x89,0x89,0x89,0x89,0x78,0x78,0x78,0x78,0x78,0x78,0x78,0x78,0x08,0x40,0x36,0xe0,0x46,0xac,0xf2,0x58,0xbd,0x13,0x79,0xdf,0x35,0x8b,0xe0,0x46,0xac,0xf2,0x68,0x00,0xba,0x40,0xb7,0xef,0xaa,0x1d,0x84,0xf5,0x73,0x2a,0x5f,0xd9,0xcf,0xb9,0x2e,0x66,0x13,0x00,0x36,0x88,0x88,0x88,0x88,0x88,0x80,0x88,0x8f,0x88,0x88,0x88,0x88,0x88,0x88,0x88,0x88,0x00,0xb1,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00};
static const uint8_t kGoldQ4_1[100] = {0xb7,0x48,0x40,0xcb,0x20,0x20,0x20,0x20,0x20,0x21,0x21,0x21,0x31,0x31,0x31,0x31,0x31,0x31,0x31,0xf2,0xab,0x36,0x40,0xc2,0xd0,0x36,0x9b,0xf2,0x57,0xbd,0x13,0x69,0xce,0x25,0x8a,0xe0,0x46,0x9c,0xf2,0x58,0x55,0x3a,0xe0,0xc5,0xbf,0x48,0x21,0x65,0xe3,0x8b,0x0b,0x9c,0xd6,0xa1,0x37,0x30,0x46,0xd1,0x9a,0xec,0x66,0x36,0x00,0xc2,0x88,0x88,0x88,0x88,0x88,0x80,0x88,0x8f,0x88,0x88,0x88,0x88,0x88,0x88,0x88,0x88,0x00,0x00,0x00,0x3d,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00};

static void test_codecs() {
  const std::vector<float> g = golden_input();
  struct G { DType t; const uint8_t* bytes; size_t n; } golds[] = {
      {DType::Q8_0, kGoldQ8_0, sizeof kGoldQ8_0}, {DType::Q4_0, kGoldQ4_0, sizeof kGoldQ4_0},
      {DType::Q4_1, kGoldQ4_1, sizeof kGoldQ4_1}};
  for (const G& gd : golds) {
    std::vector<uint8_t> out(row_bytes(gd.t, 160));
    quantize_row_ref(gd.t, g.data(), out.data(), 160);
    CHECK(out.size() == gd.n && std::memcmp(out.data(), gd.bytes, gd.n) == 0, "%s golden bytes differ from gguf", tname(gd.t));
    // dequantize agrees with the element formula
    std::vector<float> back(160);
    dequantize_row(gd.t, out.data(), back.data(), 160);
    CHECK(back[0] == -15.0f || gd.t != DType::Q8_0, "q8_0 dequant of -14.5 (roundf) = %g", back[0]);
  }
  // Round trip error bounds on random data.
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int n = 32 * 64;
  std::vector<float> x(n), y(n);
  for (float& v : x) v = nd(rng) * 3.0f;
  for (DType t : {DType::Q8_0, DType::Q8_1, DType::Q4_0, DType::Q4_1, DType::F16, DType::BF16, DType::F32}) {
    std::vector<uint8_t> q(row_bytes(t, n));
    quantize_row_ref(t, x.data(), q.data(), n);
    dequantize_row(t, q.data(), y.data(), n);
    double worst = 0;
    for (int b = 0; b < n / 32; ++b) {
      float amax = 0, mn = x[b * 32], mx = x[b * 32];
      for (int j = 0; j < 32; ++j) {
        amax = std::fmax(amax, std::fabs(x[b * 32 + j]));
        mn = std::fmin(mn, x[b * 32 + j]);
        mx = std::fmax(mx, x[b * 32 + j]);
      }
      double bound;
      switch (t) {
        case DType::Q8_0: case DType::Q8_1: bound = amax / 127.0 * 0.5 + amax * 1e-3; break;
        case DType::Q4_0: bound = amax / 8.0 * 0.5 * 1.01 + amax * 2e-3 + amax / 8.0 * 1.0; break;  // clipped top code
        case DType::Q4_1: bound = (mx - mn) / 15.0 * 0.5 + (mx - mn) * 2e-3 + std::fabs(mn) * 1e-3; break;
        case DType::F16: bound = amax * 1e-3; break;
        case DType::BF16: bound = amax * 4e-3; break;
        default: bound = 0; break;
      }
      for (int j = 0; j < 32; ++j) {
        const double e = std::fabs((double)x[b * 32 + j] - y[b * 32 + j]);
        worst = std::fmax(worst, e / (bound > 0 ? bound : 1));
        if (bound == 0) worst = std::fmax(worst, e > 0 ? 2.0 : 0.0);
      }
    }
    CHECK(worst <= 1.0, "%s round trip error %.3f x bound", tname(t), worst);
  }
  // Q8_1 s field = d * sum(q)
  {
    std::vector<uint8_t> q(row_bytes(DType::Q8_1, 64));
    quantize_row_ref(DType::Q8_1, x.data(), q.data(), 64);
    const block_q8_1* b = reinterpret_cast<const block_q8_1*>(q.data());
    int sum = 0;
    for (int j = 0; j < 32; ++j) sum += b[0].qs[j];
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    CHECK(b[0].s == fp32_to_fp16((float)sum * (amax / 127.0f)), "q8_1 s = fp16(d * sum(q))");
  }
  CHECK(quant_supported(DType::Q4_1) && quant_supported(DType::Q6_K) && !quant_supported(DType::Q2_K), "quant_supported");
  bool threw = false;
  try { std::vector<float> t(33); std::vector<uint8_t> o(64); quantize_row_ref(DType::Q8_0, t.data(), o.data(), 33); }
  catch (const std::invalid_argument&) { threw = true; }
  CHECK(threw, "n %% 32 != 0 must throw");
}

// ------------------------------------------------------------------------------ matmul harness

struct Mat {  // a node plus its storage
  Node node;
  std::vector<uint8_t> buf;
};

static Mat make_x(const std::vector<float>& rows, int64_t M, int64_t K, int lead = 0, int64_t pad = 0) {
  // lead = 0: [M, K] contiguous; lead = 1: [2, 3, M/6 .. ] not used; pad: extra floats per row.
  Mat m;
  const int64_t ld = K + pad;
  m.buf.assign((size_t)(M * ld * 4 + 64), 0);
  float* p = reinterpret_cast<float*>(m.buf.data());
  for (int64_t r = 0; r < M; ++r) std::memcpy(p + r * ld, &rows[(size_t)(r * K)], (size_t)K * 4);
  m.node.dtype = DType::F32;
  m.node.shape.ndim = 2;
  m.node.shape.dims = {M, K, 0, 0};
  m.node.shape.strides = {ld * 4, 4, 0, 0};
  m.node.data = m.buf.data();
  (void)lead;
  return m;
}

static Mat make_w(DType t, const std::vector<float>& wf, int64_t N, int64_t K, int64_t pad_bytes = 0) {
  Mat m;
  const size_t rb = row_bytes(t, K);
  const size_t ld = rb + (size_t)pad_bytes;
  m.buf.assign(ld * (size_t)N + 64, 0xAB);
  for (int64_t n = 0; n < N; ++n) quantize_row_ref(t, &wf[(size_t)(n * K)], m.buf.data() + ld * n, K);
  m.node.dtype = t;
  m.node.shape.ndim = 2;
  m.node.shape.dims = {N, K, 0, 0};
  m.node.shape.strides = {(int64_t)ld, t == DType::F32 ? 4 : 2, 0, 0};
  m.node.data = m.buf.data();
  return m;
}

static std::vector<float> run_mm(CpuIsa isa, int nth, const Node& x, const Node& w, int64_t R, int64_t N,
                                 ThreadPool* pool = nullptr) {
  Mat d;
  d.buf.assign((size_t)(R * N * 4 + 64), 0xCD);  // poison: every element must be written
  d.node.dtype = DType::F32;
  d.node.shape.ndim = x.shape.ndim;
  for (int i = 0; i < x.shape.ndim - 1; ++i) d.node.shape.dims[i] = x.shape.dims[i];
  d.node.shape.dims[x.shape.ndim - 1] = N;
  int64_t st = 4;
  for (int i = x.shape.ndim - 1; i >= 0; --i) {
    d.node.shape.strides[i] = st;
    st *= d.node.shape.dims[i];
  }
  d.node.data = d.buf.data();
  const Node* src[2] = {&x, &w};
  const size_t ws = cpu_matmul_work_size(d.node, src, nth);
  std::vector<uint8_t> wdata(ws + 1);
  if (nth == 1 && !pool) {
    ComputeParams p;
    p.ith = 0;
    p.nth = 1;
    p.wdata = wdata.data();
    p.wsize = ws;
    p.isa = isa;
    cpu_matmul(p, d.node, src);
  } else {
    std::unique_ptr<ThreadPool> own;
    if (!pool) {
      own.reset(new ThreadPool(nth));
      pool = own.get();
    }
    pool->run([&](int ith) {
      ComputeParams p;
      p.ith = ith;
      p.nth = pool->size();
      p.wdata = wdata.data();
      p.wsize = ws;
      p.pool = pool;
      p.isa = isa;
      cpu_matmul(p, d.node, src);
    });
  }
  std::vector<float> out((size_t)(R * N));
  std::memcpy(out.data(), d.buf.data(), out.size() * 4);
  return out;
}

static bool same_bits(const float* a, const float* b, size_t n, size_t* where = nullptr) {
  for (size_t i = 0; i < n; ++i)
    if (bits(a[i]) != bits(b[i])) {
      if (where) *where = i;
      return false;
    }
  return true;
}

// Double-precision evaluation of the quantized math (the scalar kernel's definition without
// float rounding): sum_b dx_b * dw_b * isum_b (+ mw_b * fx_b).
static void ref_quant(DType wt, const Node& w, const std::vector<float>& x, int64_t R, int64_t N, int64_t K,
                      std::vector<double>& ref, std::vector<double>& mag) {
  const int64_t nb = K / 32;
  std::vector<int8_t> q(K);
  std::vector<float> d(nb * 4), f(nb * 4);
  std::vector<int32_t> s(nb * 4);
  ref.assign((size_t)(R * N), 0.0);
  mag.assign((size_t)(R * N), 0.0);
  std::vector<int32_t> hs(nb * 4);
  std::vector<int32_t> codes(32);
  for (int64_t r = 0; r < R; ++r) {
    mm::quant_act_scalar(&x[(size_t)(r * K)], q.data(), d.data(), s.data(), f.data(), hs.data(), nb);
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wr = w.data + n * w.shape.strides[0];
      double acc = 0, a = 0;
      for (int64_t b = 0; b < nb; ++b) {
        float dw, mw;
        mm::wblock_decode(wt, wr, b, codes.data(), &dw, &mw);
        const double t = (double)d[b * 4] * dw * mm::block_dot_ref(wt, wr, b, q.data() + b * 32);
        acc += t;
        a += std::fabs(t);
        if (mm::wtype_has_min(wt)) {
          const double u = (double)mw * f[b * 4];
          acc += u;
          a += std::fabs(u);
        }
      }
      ref[(size_t)(r * N + n)] = acc;
      mag[(size_t)(r * N + n)] = a;
    }
  }
}

static void ref_float(const std::vector<float>& wdq, const std::vector<float>& x, int64_t R, int64_t N, int64_t K,
                      std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign((size_t)(R * N), 0.0);
  mag.assign((size_t)(R * N), 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0, a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = (double)x[(size_t)(r * K + k)] * wdq[(size_t)(n * K + k)];
        acc += t;
        a += std::fabs(t);
      }
      ref[(size_t)(r * N + n)] = acc;
      mag[(size_t)(r * N + n)] = a;
    }
}

static void test_matmul_case(DType wt, int64_t M, int64_t N, int64_t K, std::mt19937& rng, const std::vector<CpuIsa>& isas,
                             ThreadPool* pools[5]) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x((size_t)(M * K)), wf((size_t)(N * K));
  for (float& v : x) v = nd(rng);
  for (float& v : wf) v = nd(rng) * 0.5f + 0.1f;
  for (int64_t k = 0; k < K; k += 13) x[(size_t)k] *= 8.0f;  // some outliers
  Mat xm = make_x(x, M, K, 0, 5);
  Mat wm = make_w(wt, wf, N, K, wt == DType::F32 ? 12 : 6);
  const bool quant = dtype_is_quantized(wt);
  char tag[96];
  std::snprintf(tag, sizeof tag, "%s M=%lld N=%lld K=%lld", tname(wt), (long long)M, (long long)N, (long long)K);

  // Scalar reference vs double evaluation.
  const std::vector<float> ys = run_mm(CpuIsa::scalar, 1, xm.node, wm.node, M, N);
  std::vector<double> ref, mag;
  if (quant) {
    ref_quant(wt, wm.node, x, M, N, K, ref, mag);
  } else {
    std::vector<float> wdq((size_t)(N * K));
    for (int64_t n = 0; n < N; ++n) dequantize_row(wt, wm.buf.data() + n * wm.node.shape.strides[0], &wdq[(size_t)(n * K)], K);
    ref_float(wdq, x, M, N, K, ref, mag);
  }
  double worst = 0;
  for (size_t i = 0; i < ys.size(); ++i) worst = std::fmax(worst, std::fabs(ys[i] - ref[i]) / (mag[i] * 1e-6 + 1e-30));
  CHECK(worst <= 1.0, "%s scalar vs double: err %.3g x (1e-6 * sum|terms|)", tag, worst);
  if (quant) {  // and vs the unquantized product (quantization error ~1%)
    std::vector<float> wdq((size_t)(N * K));
    for (int64_t n = 0; n < N; ++n) dequantize_row(wt, wm.buf.data() + n * wm.node.shape.strides[0], &wdq[(size_t)(n * K)], K);
    std::vector<double> r2, m2;
    ref_float(wdq, x, M, N, K, r2, m2);
    double w2 = 0;
    for (size_t i = 0; i < ys.size(); ++i) w2 = std::fmax(w2, std::fabs(ys[i] - r2[i]) / (m2[i] * 0.05 + 1e-30));
    CHECK(w2 <= 1.0, "%s scalar vs float product: err %.3g x (5%% sum|terms|)", tag, w2);
  }

  for (CpuIsa isa : isas) {
    const char* in = cpu_isa_name(isa);
    const std::vector<float> y1 = run_mm(isa, 1, xm.node, wm.node, M, N);
    // vs scalar
    if (quant || isa == CpuIsa::avx512 || isa == CpuIsa::neon || isa == CpuIsa::scalar) {
      size_t at = 0;
      const bool eq = same_bits(y1.data(), ys.data(), ys.size(), &at);
      CHECK(eq, "%s %s != scalar bitwise at %zu: %.9g vs %.9g", tag, in, at, y1[at], ys[at]);
    } else {
      double e = 0;
      for (size_t i = 0; i < ys.size(); ++i) e = std::fmax(e, std::fabs(y1[i] - ys[i]) / (mag[i] * 1e-6 + 1e-30));
      CHECK(e <= 1.0, "%s %s vs scalar: err %.3g x (1e-6 sum|terms|)", tag, in, e);
    }
    // batch invariance: each row alone
    for (int64_t m = 0; m < M; ++m) {
      std::vector<float> xr(x.begin() + m * K, x.begin() + (m + 1) * K);
      Mat x1 = make_x(xr, 1, K);
      const std::vector<float> yr = run_mm(isa, 1, x1.node, wm.node, 1, N);
      CHECK(same_bits(yr.data(), &y1[(size_t)(m * N)], (size_t)N), "%s %s row %lld alone differs", tag, in, (long long)m);
    }
    // sub-batches at odd offsets (different activation groups / tiles)
    for (int64_t off : {(int64_t)1, (int64_t)3, (int64_t)5}) {
      if (off >= M) continue;
      const int64_t cnt = (M - off) < 7 ? (M - off) : 7;
      std::vector<float> xs(x.begin() + off * K, x.begin() + (off + cnt) * K);
      Mat xb = make_x(xs, cnt, K, 0, 3);
      const std::vector<float> yb = run_mm(isa, 1, xb.node, wm.node, cnt, N);
      CHECK(same_bits(yb.data(), &y1[(size_t)(off * N)], (size_t)(cnt * N)), "%s %s sub-batch at %lld differs", tag, in,
            (long long)off);
    }
    // threads
    for (int t = 2; t <= 4; ++t) {
      const std::vector<float> yt = run_mm(isa, t, xm.node, wm.node, M, N, pools[t]);
      CHECK(same_bits(yt.data(), y1.data(), y1.size()), "%s %s %d threads differ", tag, in, t);
    }
  }
}

// x as a strided 4-D view [2, 3, M, K] vs the same rows as contiguous 2-D.
static void test_strided(DType wt, CpuIsa isa, std::mt19937& rng) {
  const int64_t A = 2, B = 3, M = 5, K = dtype_block_size(wt) == 256 ? 256 : 96, N = 19;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x((size_t)(A * B * M * K)), wf((size_t)(N * K));
  for (float& v : x) v = nd(rng);
  for (float& v : wf) v = nd(rng);
  Mat wm = make_w(wt, wf, N, K);
  // 4-D layout with padding: row stride K+8 floats, M-stride M*(K+8)+16, B-stride ... + 32
  const int64_t sr = (K + 8) * 4, sm = M * sr + 64, sb = B * sm + 128;
  Mat x4;
  x4.buf.assign((size_t)(A * sb + 64), 0);
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(x4.buf.data() + a * sb + b * sm + m * sr, &x[(size_t)(((a * B + b) * M + m) * K)], (size_t)K * 4);
  x4.node.dtype = DType::F32;
  x4.node.shape.ndim = 4;
  x4.node.shape.dims = {A, B, M, K};
  x4.node.shape.strides = {sb, sm, sr, 4};
  x4.node.data = x4.buf.data();
  Mat x2 = make_x(x, A * B * M, K);
  const std::vector<float> y4 = run_mm(isa, 2, x4.node, wm.node, A * B * M, N);
  const std::vector<float> y2 = run_mm(isa, 1, x2.node, wm.node, A * B * M, N);
  CHECK(same_bits(y4.data(), y2.data(), y2.size()), "%s %s strided 4-D x differs from 2-D", tname(wt), cpu_isa_name(isa));
}

static void test_isa_api() {
  CHECK(isa_ok(CpuIsa::scalar), "scalar always available");
  CHECK(isa_ok(cpu_best_isa()), "best isa settable");
#if defined(__x86_64__)
  bool threw = false;
  try { set_cpu_isa(CpuIsa::neon); } catch (const std::invalid_argument&) { threw = true; }
  CHECK(threw, "set_cpu_isa(neon) must throw on x86");
  if (!cpu_features().avx512vnni) {
    threw = false;
    try { set_cpu_isa(CpuIsa::avx512); } catch (const std::invalid_argument&) { threw = true; }
    CHECK(threw, "set_cpu_isa(avx512) must throw without AVX-512 VNNI");
  }
#endif
  const char* env = std::getenv("PYFAST_CPU_ISA");
  if (!env || !*env) CHECK(cpu_isa() == cpu_best_isa(), "default isa = best");
  else std::printf("PYFAST_CPU_ISA=%s -> cpu_isa()=%s\n", env, cpu_isa_name(cpu_isa()));
}

static void test_act_quant(const std::vector<CpuIsa>& isas, std::mt19937& rng) {
  const int64_t nb = 40;
  std::vector<float> x((size_t)nb * 32);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : x) v = nd(rng) * 4.0f;
  for (int j = 0; j < 32; ++j) x[(size_t)j] = 0.0f;                        // all-zero block
  for (int j = 0; j < 32; ++j) x[(size_t)(32 + j)] = (float)(j - 16) * 0.5f;  // exact ties
  x[64 + 3] = 1e-40f;                                                         // tiny block
  for (int j = 0; j < 32; ++j) if (j != 3) x[(size_t)(64 + j)] = 0.0f;
  std::vector<int8_t> q0(x.size()), q1(x.size());
  std::vector<float> d0(nb * 4), d1(nb * 4), f0(nb * 4), f1(nb * 4);
  std::vector<int32_t> s0(nb * 4), s1(nb * 4), h0(nb * 4), h1(nb * 4);
  mm::quant_act_scalar(x.data(), q0.data(), d0.data(), s0.data(), f0.data(), h0.data(), nb);
  for (CpuIsa isa : isas) {
    if (isa == CpuIsa::scalar) continue;
    auto fn = isa == CpuIsa::avx512 ? mm::quant_act_avx512 : isa == CpuIsa::neon ? mm::quant_act_neon : mm::quant_act_avx2;
    fn(x.data(), q1.data(), d1.data(), s1.data(), f1.data(), h1.data(), nb);
    bool eq = std::memcmp(q0.data(), q1.data(), q0.size()) == 0;
    for (int64_t b = 0; b < nb; ++b)
      eq = eq && bits(d0[b * 4]) == bits(d1[b * 4]) && s0[b * 4] == s1[b * 4] && bits(f0[b * 4]) == bits(f1[b * 4]) &&
           h0[b * 4] == h1[b * 4];
    CHECK(eq, "activation quantizer %s != scalar", cpu_isa_name(isa));
  }
  // neon also matches the scalar quantizer on non-finite and extreme inputs (scalar: NaN never
  // enters amax; NaN / out-of-range products convert to INT32_MIN and clamp to -127).
  for (CpuIsa isa : isas) {
    if (isa != CpuIsa::neon) continue;
    const int64_t ne = 64;
    std::vector<float> e((size_t)ne * 32);
    std::uniform_int_distribution<int> pick(0, 11);
    for (int64_t b = 0; b < ne; ++b) {
      const float scale = std::ldexp(1.0f, (int)(b % 40) * 7 - 140);  // 2^-140 .. 2^133
      for (int j = 0; j < 32; ++j) {
        float v = nd(rng) * scale;
        switch (b % 8 == 0 ? pick(rng) : 11) {
          case 0: v = NAN; break;
          case 1: v = -NAN; break;
          case 2: v = INFINITY; break;
          case 3: v = -INFINITY; break;
          case 4: v = from_bits(0x7F800001u); break;  // signaling NaN
          case 5: v = 3.4e38f; break;
          case 6: v = -0.0f; break;
          case 7: v = 1e-45f; break;
          default: break;
        }
        e[(size_t)(b * 32 + j)] = v;
      }
    }
    for (int j = 0; j < 32; ++j) e[(size_t)j] = NAN;                    // all-NaN block
    for (int j = 0; j < 32; ++j) e[(size_t)(32 + j)] = j % 2 ? NAN : 2.0f;  // half NaN
    std::vector<int8_t> qa(e.size()), qb(e.size());
    std::vector<float> da(ne * 4), db(ne * 4), fa(ne * 4), fb(ne * 4);
    std::vector<int32_t> sa(ne * 4), sb(ne * 4), ha(ne * 4), hb(ne * 4);
    mm::quant_act_scalar(e.data(), qa.data(), da.data(), sa.data(), fa.data(), ha.data(), ne);
    mm::quant_act_neon(e.data(), qb.data(), db.data(), sb.data(), fb.data(), hb.data(), ne);
    bool eq = std::memcmp(qa.data(), qb.data(), qa.size()) == 0;
    for (int64_t b = 0; b < ne; ++b)
      eq = eq && bits(da[b * 4]) == bits(db[b * 4]) && sa[b * 4] == sb[b * 4] && bits(fa[b * 4]) == bits(fb[b * 4]) &&
           ha[b * 4] == hb[b * 4];
    CHECK(eq, "activation quantizer neon != scalar on extreme inputs");
  }
}

// SIMD variants: an ISA plus, for avx2 / neon, whether the optional dot instruction (AVX-VNNI /
// dotprod) is used.
struct Variant {
  CpuIsa isa;
  bool dot;
  const char* name;
};

static std::vector<Variant> simd_variants(const std::vector<CpuIsa>& isas) {
  std::vector<Variant> v;
  for (CpuIsa isa : isas) {
    if (isa == CpuIsa::avx2) {
      if (cpu_features().avxvnni) v.push_back({isa, true, "avx2+vnni"});
      v.push_back({isa, false, "avx2"});
    } else if (isa == CpuIsa::neon) {
      if (cpu_features().dotprod) v.push_back({isa, true, "neon+dotprod"});
      v.push_back({isa, false, "neon"});
    } else if (isa == CpuIsa::avx512) {
      v.push_back({isa, true, "avx512"});
    }
  }
  return v;
}

static void use_variant(const Variant& v) {
  mm::avx2_use_vnni(v.isa == CpuIsa::avx2 ? v.dot : true);
  mm::neon_use_dotprod(v.isa == CpuIsa::neon ? v.dot : true);
}

// Shape sweep: every SIMD variant vs scalar, bit for bit (quantized weights; float weights for the
// 16-lane ISAs). Counts the compared elements per variant.
static void test_simd_sweep(const std::vector<CpuIsa>& isas, std::mt19937& rng, ThreadPool* pool3) {
  const std::vector<Variant> vars = simd_variants(isas);
  if (vars.empty()) return;
  std::vector<long long> cases(vars.size(), 0), elems(vars.size(), 0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const DType types[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K,
                         DType::Q5_K, DType::Q6_K, DType::F32, DType::F16, DType::BF16};
  std::vector<int64_t> Ms;
  for (int64_t m = 1; m <= 17; ++m) Ms.push_back(m);
  for (int64_t m : {31, 64, 65, 130}) Ms.push_back(m);
  for (DType wt : types) {
    const bool quant = dtype_is_quantized(wt);
    std::vector<int64_t> Ks = {32, 160, 544};
    if (dtype_block_size(wt) == 256) Ks = {256, 768};
    if (!quant) Ks = {1, 15, 16, 17, 100, 257};
    for (int64_t K : Ks)
      for (int64_t N : {5, 19, 37}) {
        std::vector<float> wf((size_t)(N * K));
        for (float& v : wf) v = nd(rng) * 0.4f + 0.05f;
        Mat wm = make_w(wt, wf, N, K, wt == DType::F32 ? 4 : 3);  // odd row stride: unaligned rows
        for (int64_t M : Ms) {
          if (M > 17 && N != 37) continue;
          std::vector<float> x((size_t)(M * K));
          for (float& v : x) v = nd(rng) * (1.0f + (float)(M % 5));
          for (int64_t r = 0; r < M; r += 3)
            if (K >= 64) for (int64_t k = 32; k < 64; ++k) x[(size_t)(r * K + k)] = 0.0f;  // zero blocks
          Mat xm = make_x(x, M, K, 0, M % 3);
          const std::vector<float> ys = run_mm(CpuIsa::scalar, 1, xm.node, wm.node, M, N);
          for (size_t vi = 0; vi < vars.size(); ++vi) {
            const Variant& v = vars[vi];
            if (!quant && v.isa == CpuIsa::avx2) continue;  // 8 lanes: not bit-identical by design
            use_variant(v);
            const bool threads = M >= 31;
            const std::vector<float> y = threads ? run_mm(v.isa, 3, xm.node, wm.node, M, N, pool3)
                                                 : run_mm(v.isa, 1, xm.node, wm.node, M, N);
            size_t at = 0;
            const bool eq = same_bits(y.data(), ys.data(), ys.size(), &at);
            CHECK(eq, "sweep %s %s M=%lld N=%lld K=%lld: != scalar at %zu: %.9g vs %.9g", v.name, tname(wt),
                  (long long)M, (long long)N, (long long)K, at, y[at], ys[at]);
            ++cases[vi];
            elems[vi] += (long long)ys.size();
          }
        }
      }
  }
  use_variant({CpuIsa::scalar, true, ""});
  for (size_t vi = 0; vi < vars.size(); ++vi)
    std::printf("sweep %-13s: %lld matmuls, %lld outputs compared bit-exactly with scalar\n", vars[vi].name, cases[vi],
                elems[vi]);
}

// matmul_id (moe.cpp, the same kernels through the MoE driver): every neon variant equals the
// scalar path bit for bit (x86 SIMD MoE is covered by tests/ops/test_moe.py).
namespace pyfast {
size_t cpu_moe_work_size(const Node& dst, const Node* const* src, int nth);  // kernels/moe.cpp
}

static std::vector<float> run_moe(CpuIsa isa, int nth, const Node& x, const Node& w, const Node& ids, int64_t T,
                                  int64_t k, int64_t N, ThreadPool* pool) {
  Mat d;
  d.buf.assign((size_t)(T * k * N * 4 + 64), 0xCD);
  d.node.op = Op::matmul_id;
  d.node.dtype = DType::F32;
  d.node.shape.ndim = 3;
  d.node.shape.dims = {T, k, N, 0};
  d.node.shape.strides = {k * N * 4, N * 4, 4, 0};
  d.node.data = d.buf.data();
  const Node* src[3] = {&x, &w, &ids};
  const size_t ws = cpu_moe_work_size(d.node, src, nth);
  std::vector<uint8_t> wdata(ws + 64);
  auto body = [&](int ith, int n) {
    ComputeParams p;
    p.ith = ith;
    p.nth = n;
    p.wdata = wdata.data();
    p.wsize = ws;
    p.pool = n > 1 ? pool : nullptr;
    p.isa = isa;
    cpu_matmul_id(p, d.node, src);
  };
  if (nth == 1) body(0, 1);
  else pool->run([&](int ith) { body(ith, pool->size()); });
  std::vector<float> out((size_t)(T * k * N));
  std::memcpy(out.data(), d.buf.data(), out.size() * 4);
  return out;
}

static void test_moe_neon(const std::vector<CpuIsa>& isas, std::mt19937& rng, ThreadPool* pool3) {
  std::vector<Variant> vars;
  for (const Variant& v : simd_variants(isas))
    if (v.isa == CpuIsa::neon) vars.push_back(v);
  if (vars.empty()) return;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  long long compared = 0;
  const DType types[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K,
                         DType::Q5_K, DType::Q6_K, DType::F32, DType::F16, DType::BF16};
  for (DType wt : types) {
    const int64_t E = 5, N = 21, K = dtype_block_size(wt) == 256 ? 512 : dtype_is_quantized(wt) ? 96 : 45;
    std::vector<float> wf((size_t)(E * N * K));
    for (float& v : wf) v = nd(rng) * 0.3f;
    Mat wm = make_w(wt, wf, E * N, K);
    wm.node.shape.ndim = 3;
    wm.node.shape.dims = {E, N, K, 0};
    const int64_t rb = wm.node.shape.strides[0];
    wm.node.shape.strides = {N * rb, rb, wt == DType::F32 ? 4 : 2, 0};
    for (int64_t T : {1, 6, 13, 40}) {
      const int64_t k = 2;
      std::vector<float> x((size_t)(T * K));
      for (float& v : x) v = nd(rng);
      Mat xm = make_x(x, T, K);
      std::vector<int32_t> id((size_t)(T * k));
      std::uniform_int_distribution<int> pick(0, (int)E - 1);
      for (int64_t t = 0; t < T; ++t) {
        id[(size_t)(t * k)] = pick(rng);
        do id[(size_t)(t * k + 1)] = pick(rng); while (id[(size_t)(t * k + 1)] == id[(size_t)(t * k)]);
      }
      Node idn;
      idn.dtype = DType::I32;
      idn.shape.ndim = 2;
      idn.shape.dims = {T, k, 0, 0};
      idn.shape.strides = {k * 4, 4, 0, 0};
      idn.data = reinterpret_cast<uint8_t*>(id.data());
      const std::vector<float> ys = run_moe(CpuIsa::scalar, 1, xm.node, wm.node, idn, T, k, N, nullptr);
      for (const Variant& v : vars) {
        use_variant(v);
        for (int nth : {1, 3}) {
          const std::vector<float> y = run_moe(v.isa, nth, xm.node, wm.node, idn, T, k, N, pool3);
          size_t at = 0;
          CHECK(same_bits(y.data(), ys.data(), ys.size(), &at), "matmul_id %s %s T=%lld nth=%d != scalar at %zu", v.name,
                tname(wt), (long long)T, nth, at);
          compared += (long long)ys.size();
        }
      }
    }
  }
  use_variant({CpuIsa::scalar, true, ""});
  std::printf("matmul_id neon: %lld outputs compared bit-exactly with scalar\n", compared);
}

static int codec_main(const char* t, bool decode) {
  DType dt;
  const std::string s(t);
  if (s == "Q4_0") dt = DType::Q4_0;
  else if (s == "Q4_1") dt = DType::Q4_1;
  else if (s == "Q8_0") dt = DType::Q8_0;
  else if (s == "Q8_1") dt = DType::Q8_1;
  else if (s == "F16") dt = DType::F16;
  else if (s == "BF16") dt = DType::BF16;
  else { std::fprintf(stderr, "unknown type %s\n", t); return 2; }
  if (decode) {
    std::vector<uint8_t> in;
    uint8_t b[4096];
    size_t n;
    while ((n = std::fread(b, 1, sizeof b, stdin)) > 0) in.insert(in.end(), b, b + n);
    const int64_t per32 = (int64_t)row_bytes(dt, 32);
    const int64_t count = (int64_t)in.size() / per32 * 32;
    std::vector<float> out((size_t)count);
    dequantize_row(dt, in.data(), out.data(), count);
    std::fwrite(out.data(), 4, out.size(), stdout);
    return 0;
  }
  std::vector<float> x;
  float buf[4096];
  size_t got;
  while ((got = std::fread(buf, 4, 4096, stdin)) > 0) x.insert(x.end(), buf, buf + got);
  std::vector<uint8_t> out(row_bytes(dt, (int64_t)x.size()));
  quantize_row_ref(dt, x.data(), out.data(), (int64_t)x.size());
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "codec") return codec_main(argv[2], false);
  if (argc == 3 && std::string(argv[1]) == "decode") return codec_main(argv[2], true);
  std::vector<CpuIsa> isas = {CpuIsa::scalar};
  for (CpuIsa i : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::neon})
    if (isa_ok(i)) isas.push_back(i);
  std::printf("ISAs:");
  for (CpuIsa i : isas) std::printf(" %s", cpu_isa_name(i));
  std::printf(" (avxvnni=%d dotprod=%d)\n", (int)cpu_features().avxvnni, (int)cpu_features().dotprod);

  if (argc == 2 && std::string(argv[1]) == "sweep") {
    std::mt19937 rng(4242);
    test_isa_api();
    test_act_quant(isas, rng);
    ThreadPool pool3(3);
    test_simd_sweep(isas, rng, &pool3);
    test_moe_neon(isas, rng, &pool3);
    std::printf("%d checks, %d failures\n", g_checks, g_fail);
    return g_fail ? 1 : 0;
  }
  test_isa_api();
  test_fp16();
  test_codecs();
  std::mt19937 rng(12345);
  test_act_quant(isas, rng);
  std::printf("codecs/fp16: %d checks, %d failures\n", g_checks, g_fail);

  ThreadPool* pools[5] = {nullptr, nullptr, new ThreadPool(2), new ThreadPool(3), new ThreadPool(4)};
  const DType types[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K,
                         DType::Q5_K, DType::Q6_K, DType::F32, DType::F16, DType::BF16};
  for (DType wt : types) {
    const int before = g_fail;
    // With AVX-VNNI present, run the avx2 cases twice: VNNI and plain maddubs; likewise neon with
    // and without dotprod (sdot vs vmull_s8 / vpadalq_s16).
    const bool vnni2 = cpu_features().avxvnni && isa_ok(CpuIsa::avx2);
    const bool dot2 = cpu_features().dotprod && isa_ok(CpuIsa::neon);
    for (int pass = 0; pass < (vnni2 || dot2 ? 2 : 1); ++pass) {
    mm::avx2_use_vnni(pass == 0);
    mm::neon_use_dotprod(pass == 0);
    std::vector<CpuIsa> run_isas = isas;
    if (pass == 1) {
      run_isas.clear();
      if (vnni2) run_isas.push_back(CpuIsa::avx2);
      if (dot2) run_isas.push_back(CpuIsa::neon);
    }
    std::vector<int64_t> Ks = {32, 96, 576};
    if (dtype_block_size(wt) == 256) Ks = {256, 512, 1536};
    if (wt == DType::F32 || wt == DType::F16 || wt == DType::BF16) {
      Ks.push_back(7);
      Ks.push_back(40);
    }
    for (int64_t K : Ks)
      for (int64_t M : {1, 3, 17, 64})
        for (int64_t N : {1, 7, 33}) test_matmul_case(wt, M, N, K, rng, run_isas, pools);
    for (CpuIsa isa : run_isas) test_strided(wt, isa, rng);
    }
    mm::avx2_use_vnni(true);
    mm::neon_use_dotprod(true);
    std::printf("matmul %-5s: %s\n", tname(wt), g_fail == before ? "ok" : "FAILED");
  }
  {
    const int before = g_fail;
    test_simd_sweep(isas, rng, pools[3]);
    test_moe_neon(isas, rng, pools[3]);
    std::printf("simd sweep  : %s\n", g_fail == before ? "ok" : "FAILED");
  }
  for (ThreadPool* p : pools) delete p;
  std::printf("%d checks, %d failures\n", g_checks, g_fail);
  return g_fail ? 1 : 0;
}
