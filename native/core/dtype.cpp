// Element-type table. Ids are GGUF's ggml_type values; sizes are the GGUF block layouts.
#include "pyfast/dtype.h"

#include <stdexcept>
#include <string>

namespace pyfast {

namespace {

struct Entry {
  int32_t id;
  DTypeInfo info;
};

// name, elements per block, bytes per block, the executor computes with it
constexpr Entry kTable[] = {
    {(int32_t)DType::F32, {"F32", 1, 4, true}},
    {(int32_t)DType::F16, {"F16", 1, 2, true}},
    {(int32_t)DType::Q4_0, {"Q4_0", 32, 18, true}},
    {(int32_t)DType::Q4_1, {"Q4_1", 32, 20, true}},
    {(int32_t)DType::Q5_0, {"Q5_0", 32, 22, true}},
    {(int32_t)DType::Q5_1, {"Q5_1", 32, 24, true}},
    {(int32_t)DType::Q8_0, {"Q8_0", 32, 34, true}},
    {(int32_t)DType::Q8_1, {"Q8_1", 32, 36, false}},
    {(int32_t)DType::Q2_K, {"Q2_K", 256, 84, false}},
    {(int32_t)DType::Q3_K, {"Q3_K", 256, 110, false}},
    {(int32_t)DType::Q4_K, {"Q4_K", 256, 144, true}},
    {(int32_t)DType::Q5_K, {"Q5_K", 256, 176, true}},
    {(int32_t)DType::Q6_K, {"Q6_K", 256, 210, true}},
    {(int32_t)DType::Q8_K, {"Q8_K", 256, 292, false}},
    {(int32_t)DType::I8, {"I8", 1, 1, false}},
    {(int32_t)DType::I16, {"I16", 1, 2, false}},
    {(int32_t)DType::I32, {"I32", 1, 4, true}},
    {(int32_t)DType::I64, {"I64", 1, 8, false}},
    {(int32_t)DType::F64, {"F64", 1, 8, false}},
    {(int32_t)DType::BF16, {"BF16", 1, 2, true}},
};

constexpr int32_t kMaxId = 64;

// Dense lookup by id, built once.
struct Index {
  const DTypeInfo* by_id[kMaxId] = {};
  Index() {
    for (const Entry& e : kTable) by_id[e.id] = &e.info;
  }
};

const Index& index() {
  static const Index idx;
  return idx;
}

}  // namespace

const DTypeInfo* dtype_info_raw(int32_t id) {
  if (id < 0 || id >= kMaxId) return nullptr;
  return index().by_id[id];
}

const DTypeInfo& dtype_info(DType t) {
  const DTypeInfo* info = dtype_info_raw((int32_t)t);
  if (!info) throw std::invalid_argument("unknown dtype id " + std::to_string((int32_t)t));
  return *info;
}

}  // namespace pyfast
