// Element types. The numeric values are GGUF's (ggml_type) so tensor types read from a file
// map onto DType directly.
#pragma once
#include <cstddef>
#include <cstdint>

namespace pyfast {

enum class DType : int32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  BF16 = 30,
};

struct DTypeInfo {
  const char* name;
  int64_t block_size;  // elements per block (1 for plain types)
  size_t type_size;    // bytes per block
  bool supported;      // the executor can compute with it
};

// Info for a raw GGUF type id; returns nullptr for an id pyfast does not know.
const DTypeInfo* dtype_info_raw(int32_t id);
const DTypeInfo& dtype_info(DType t);

inline int64_t dtype_block_size(DType t) { return dtype_info(t).block_size; }
inline size_t dtype_type_size(DType t) { return dtype_info(t).type_size; }
inline const char* dtype_name(DType t) { return dtype_info(t).name; }
inline bool dtype_is_quantized(DType t) { return dtype_info(t).block_size > 1; }
// Bytes taken by a contiguous row of n elements (n must be a multiple of the block size).
inline size_t dtype_row_size(DType t, int64_t n) {
  const DTypeInfo& i = dtype_info(t);
  return (size_t)(n / i.block_size) * i.type_size;
}

}  // namespace pyfast
