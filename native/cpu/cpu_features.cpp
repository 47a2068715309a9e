// CPU feature detection and the run-time ISA selection kernels dispatch on (pyfast/cpu.h).
//
// An ISA is "available" when the CPU and the OS support everything its kernels use:
//   avx2   : AVX2 + FMA + F16C (+ OS-enabled YMM state)
//   avx512 : the avx2 set + AVX-512 F/BW/VL/VNNI (+ OS-enabled ZMM state). AVX-512 CPUs without
//            VNNI (Skylake-X) use the avx2 path.
//   neon   : any aarch64 CPU (the quantized matmul also uses the dotprod extension, sdot, when
//            present: HWCAP_ASIMDDP on Linux, hw.optional.arm.FEAT_DotProd on macOS).
// The default ISA is the best available one; the environment variable PYFAST_CPU_ISA
// (scalar|avx2|avx512|neon|auto) overrides it when the process starts (an unknown or unavailable
// value prints a warning and keeps the default).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "pyfast/cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define PYFAST_X86 1
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)  // asm/hwcap.h (Linux >= 4.15); older headers lack the name
#endif
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace pyfast {

namespace {

#ifdef PYFAST_X86
uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef PYFAST_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  const bool avx = (c >> 28) & 1;
  const bool fma = (c >> 12) & 1;
  const bool f16c = (c >> 29) & 1;
  uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  const bool ymm_os = (xcr0 & 0x6) == 0x6;            // SSE + AVX state
  const bool zmm_os = ymm_os && (xcr0 & 0xE0) == 0xE0;  // opmask + ZMM_Hi256 + Hi16_ZMM
  if (!(avx && ymm_os)) return f;
  f.fma = fma;
  f.f16c = f16c;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = (b >> 5) & 1;
    if (zmm_os) {
      f.avx512f = (b >> 16) & 1;
      f.avx512bw = (b >> 30) & 1;
      f.avx512vl = (b >> 31) & 1;
      f.avx512vnni = (c >> 11) & 1;
    }
    unsigned a1, b1, c1, d1;
    __cpuid_count(7, 1, a1, b1, c1, d1);
    f.avxvnni = (a1 >> 4) & 1;
    if (zmm_os) f.avx512bf16 = (a1 >> 5) & 1;
  }
#elif defined(__aarch64__)
  f.neon = true;
#if defined(__linux__)
  f.dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
  int dp = 0;
  size_t len = sizeof dp;
  if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &dp, &len, nullptr, 0) == 0) f.dotprod = dp != 0;
#elif defined(__ARM_FEATURE_DOTPROD)
  f.dotprod = true;
#endif
#endif
  return f;
}

bool available(CpuIsa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case CpuIsa::scalar: return true;
    case CpuIsa::avx2: return f.avx2 && f.fma && f.f16c;
    case CpuIsa::avx512:
      return f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni;
    case CpuIsa::neon: return f.neon;
  }
  return false;
}

CpuIsa initial_isa() {
  const CpuIsa best = cpu_best_isa();
  const char* env = std::getenv("PYFAST_CPU_ISA");
  if (!env || !*env) return best;
  const std::string s(env);
  CpuIsa want;
  if (s == "scalar") want = CpuIsa::scalar;
  else if (s == "avx2") want = CpuIsa::avx2;
  else if (s == "avx512") want = CpuIsa::avx512;
  else if (s == "neon") want = CpuIsa::neon;
  else if (s == "auto" || s == "best") return best;
  else {
    std::fprintf(stderr, "pyfast: ignoring PYFAST_CPU_ISA=%s (expected scalar|avx2|avx512|neon|auto)\n", env);
    return best;
  }
  if (!available(want)) {
    std::fprintf(stderr, "pyfast: PYFAST_CPU_ISA=%s is not supported by this CPU; using %s\n", env,
                 cpu_isa_name(best));
    return best;
  }
  return want;
}

std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{(int)initial_isa()};
  return slot;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

CpuIsa cpu_best_isa() {
  if (available(CpuIsa::avx512)) return CpuIsa::avx512;
  if (available(CpuIsa::avx2)) return CpuIsa::avx2;
  if (available(CpuIsa::neon)) return CpuIsa::neon;
  return CpuIsa::scalar;
}

CpuIsa cpu_isa() { return (CpuIsa)isa_slot().load(std::memory_order_relaxed); }

void set_cpu_isa(CpuIsa isa) {
  const int v = (int)isa;
  if (v < 0 || v > (int)CpuIsa::neon)
    throw std::invalid_argument("[set_cpu_isa] unknown ISA id " + std::to_string(v));
  if (!available(isa))
    throw std::invalid_argument(std::string("[set_cpu_isa] ISA '") + cpu_isa_name(isa) +
                                "' is not supported by this CPU (best: " + cpu_isa_name(cpu_best_isa()) + ")");
  isa_slot().store(v, std::memory_order_relaxed);
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::scalar: return "scalar";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::neon: return "neon";
  }
  return "unknown";
}

}  // namespace pyfast
