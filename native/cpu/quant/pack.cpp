// The packed ("x16") weight layout of quant.h: 16 rows per chunk, each block's fields (kPackFmt)
// stored unit by unit for the 16 rows together. Packing only moves bytes.
#include <cstring>
#include <vector>

#include "cpu/quant/quant.h"
#include "pyfast/dtype.h"

namespace pyfast {

bool packable(DType t) { return kPackFmt(t).bs != 0; }

namespace {

// One unit (2 or 4 bytes) with a fixed-size copy (a variable-size memcpy per unit is a call).
inline void copy_unit(uint8_t* d, const uint8_t* s, int unit) {
  if (unit == 4) std::memcpy(d, s, 4);
  else std::memcpy(d, s, 2);
}

}  // namespace

void pack_x16(DType t, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K) {
  const PackFmt F = kPackFmt(t);
  const int64_t nb = K / dtype_block_size(t), rb = nb * F.bs;
  for (int64_t c = 0; c < N / 16; ++c) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = dst + c * 16 * rb + b * 16 * F.bs;
      for (int r = 0; r < 16; ++r) {
        const uint8_t* in = src + (c * 16 + r) * rb + b * F.bs;
        for (int i = 0; i < F.n_fields; ++i) {
          const PackField& f = F.f[i];
          for (int u = 0; u < f.bytes / f.unit; ++u)
            copy_unit(out + f.at + u * f.step() + r * f.unit, in + f.off + u * f.unit, f.unit);
        }
      }
    }
  }
}

void unpack_x16(DType t, const uint8_t* chunk, int64_t K, int r0, int nr, uint8_t* dst) {
  const PackFmt F = kPackFmt(t);
  const int64_t nb = K / dtype_block_size(t), rb = nb * F.bs;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* in = chunk + b * 16 * F.bs;
    for (int i = 0; i < nr; ++i) {
      const int r = r0 + i;
      uint8_t* o = dst + i * rb + b * F.bs;
      for (int k = 0; k < F.n_fields; ++k) {
        const PackField& f = F.f[k];
        for (int u = 0; u < f.bytes / f.unit; ++u)
          copy_unit(o + f.off + u * f.unit, in + f.at + u * f.step() + r * f.unit, f.unit);
      }
    }
  }
}

namespace mm {

void qgemm_run(CpuIsa isa, const QJob& j, int64_t K) {
  auto gemm = isa == CpuIsa::avx512 ? qgemm_avx512 : isa == CpuIsa::avx2 ? qgemm_avx2 : isa == CpuIsa::neon ? qgemm_neon : qgemm_scalar;
  if (!j.packed || isa == CpuIsa::avx512) return gemm(j);
  thread_local std::vector<uint8_t> rows;
  rows.resize((size_t)(kChunkN * j.w_stride));
  unpack_x16(j.wt, j.w + j.n0 * j.w_stride, K, 0, (int)(j.n1 - j.n0), rows.data());
  QJob u = j;
  u.packed = false;
  // row n of u at rows + (n - n0) * stride (only rows n0 .. n1-1 are read)
  u.w = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(rows.data()) - (uintptr_t)(j.n0 * j.w_stride));
  gemm(u);
}

}  // namespace mm

}  // namespace pyfast
