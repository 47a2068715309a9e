// GGUF reader: mmaps a file read-only and parses its header, metadata and tensor index.
//
// Nothing is copied out of the file: string values and tensor data are views into the mapping,
// which lives as long as the GGUFFile (hold it in a shared_ptr and let views share it).
// Tensor shapes are given outermost-first (numpy order); GGUF stores them innermost-first and
// this reader is the one place that order is flipped.
//
// Every malformed file raises GGUFError (message starts with the path); the parser bounds every
// count and length by the bytes left in the file before allocating anything.
#pragma once
#include <cstddef>
#include <cstdint>
#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pyfast/dtype.h"

namespace pyfast {

// A malformed or unsupported GGUF file.
class GGUFError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The file could not be opened or mapped (missing, permissions, not a regular file).
class GGUFOpenError : public std::runtime_error {
 public:
  GGUFOpenError(const std::string& path, int err, const std::string& msg)
      : std::runtime_error(path + ": " + msg), path_(path), errno_(err) {}
  const std::string& path() const { return path_; }
  int error_number() const { return errno_; }  // errno, or 0 when not a system error

 private:
  std::string path_;
  int errno_;
};

// GGUF metadata value types (the numbers are the file format's).
enum class GGUFValueType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};

// "uint8", ..., "float64"; "?" for an id outside the enum.
const char* gguf_value_type_name(GGUFValueType t);
// Bytes of one element of a fixed-size type; 0 for STRING and ARRAY (and unknown ids).
size_t gguf_value_type_size(GGUFValueType t);

// One metadata value. Scalars keep their raw bits; strings and scalar arrays point into the
// mapping (valid while the owning GGUFFile lives).
struct GGUFValue {
  GGUFValueType type = GGUFValueType::UINT8;

  // Scalars: the value's little-endian bits, zero-extended to 64 bits.
  uint64_t bits = 0;
  // STRING
  std::string_view str;

  // ARRAY
  GGUFValueType elem_type = GGUFValueType::UINT8;
  uint64_t count = 0;                       // number of elements
  const uint8_t* data = nullptr;            // fixed-size elements: count * size raw bytes
  std::vector<std::string_view> strings;    // STRING elements
  std::vector<GGUFValue> items;             // ARRAY elements (nested arrays)

  bool is_array() const { return type == GGUFValueType::ARRAY; }
  bool is_string() const { return type == GGUFValueType::STRING; }
  bool is_integer() const;  // any of the 8 integer types
  bool is_float() const { return type == GGUFValueType::FLOAT32 || type == GGUFValueType::FLOAT64; }

  // Scalar accessors; they throw std::invalid_argument on a type mismatch or out-of-range value.
  int64_t as_int() const;        // integer types (UINT64 above INT64_MAX throws)
  uint64_t as_uint() const;      // non-negative integers
  double as_float() const;       // float or integer types
  bool as_bool() const;          // BOOL
  std::string_view as_string() const;  // STRING

  // Array element accessors (same rules as the scalar ones, applied to element i).
  size_t size() const { return is_array() ? (size_t)count : 0; }
  int64_t int_at(size_t i) const;
  double float_at(size_t i) const;
  std::string_view string_at(size_t i) const;
  // Element i of a fixed-size array as a scalar GGUFValue.
  GGUFValue scalar_at(size_t i) const;
};

struct GGUFTensorInfo {
  std::string name;
  int32_t type = 0;              // raw ggml type id (== DType value)
  const DTypeInfo* dtype = nullptr;
  std::vector<int64_t> shape;    // outermost first (numpy order)
  int64_t n_elements = 0;
  uint64_t offset = 0;           // absolute file offset of the data
  uint64_t nbytes = 0;
};

class GGUFFile {
 public:
  // Opens, maps and parses `path`. Throws GGUFOpenError / GGUFError.
  explicit GGUFFile(const std::string& path);
  ~GGUFFile();
  GGUFFile(const GGUFFile&) = delete;
  GGUFFile& operator=(const GGUFFile&) = delete;

  static std::shared_ptr<GGUFFile> open(const std::string& path) {
    return std::make_shared<GGUFFile>(path);
  }

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the tensor data section
  uint64_t file_size() const { return size_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GGUFValue>>& metadata() const { return metadata_; }
  const GGUFValue* find(std::string_view key) const;  // nullptr when absent

  // Tensors in file order.
  const std::vector<GGUFTensorInfo>& tensors() const { return tensors_; }
  const GGUFTensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent

  // The whole mapping, and a tensor's bytes within it.
  const uint8_t* base() const { return base_; }
  const uint8_t* tensor_data(const GGUFTensorInfo& t) const { return base_ + t.offset; }

  // Maps the tensor data into this process's page tables on a background thread (what the first
  // decode would otherwise do one page fault at a time), so it overlaps the caller's other
  // start-up work. Idempotent; the destructor stops and joins the thread. `ranges` (absolute file
  // offset, bytes): only these (clamped to the file); empty: the whole tensor data section.
  void prefetch(std::vector<std::pair<uint64_t, uint64_t>> ranges = {}) const;

 private:
  void parse();
  void stop_prefetch() const;

  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GGUFValue>> metadata_;
  std::unordered_map<std::string_view, size_t> metadata_index_;
  std::vector<GGUFTensorInfo> tensors_;
  std::unordered_map<std::string_view, size_t> tensor_index_;
  mutable std::mutex prefetch_mu_;
  mutable std::thread prefetch_thread_;
  mutable std::atomic<bool> prefetch_stop_{false};
};

}  // namespace pyfast
