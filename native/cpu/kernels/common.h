// Helpers shared by the CPU kernels: row iteration over strided shapes and broadcasting.
#pragma once
#include <cstdint>

#include "pyfast/cpu.h"
#include "pyfast/tensor.h"

namespace pyfast {

// Number of rows (all dims but the innermost).
inline int64_t n_rows(const Shape& s) { return s.numel() / s.dims[s.ndim - 1]; }

// Byte offset of row r (row-major over the outer dims) in a strided shape.
inline int64_t row_offset(const Shape& s, int64_t r) {
  int64_t off = 0;
  for (int d = s.ndim - 2; d >= 0; --d) {
    const int64_t i = r % s.dims[d];
    r /= s.dims[d];
    off += i * s.strides[d];
  }
  return off;
}

// Byte offset in b (broadcast to a's shape, right-aligned) of a's row r.
inline int64_t bcast_row_offset(const Shape& a, const Shape& b, int64_t r) {
  int64_t off = 0;
  for (int d = a.ndim - 2; d >= 0; --d) {
    const int64_t i = r % a.dims[d];
    r /= a.dims[d];
    const int bd = d - (a.ndim - b.ndim);
    if (bd >= 0 && b.dims[bd] != 1) off += i * b.strides[bd];
  }
  return off;
}

inline int64_t inner_stride(const Shape& s) { return s.strides[s.ndim - 1]; }

}  // namespace pyfast
