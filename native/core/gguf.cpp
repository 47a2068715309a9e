// GGUF reader. Layout (all little-endian):
//   magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
//   n_kv x (string key, u32 value type, value)
//   n_tensors x (string name, u32 n_dims, u64 ne[n_dims] innermost first, u32 type, u64 offset)
//   padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
// where a string is u64 length + bytes and an array is u32 element type + u64 count + elements.
#include "pyfast/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <limits>

namespace pyfast {

static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE float sizes");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

// ---------------------------------------------------------------------------------------------
// Value types

const char* gguf_value_type_name(GGUFValueType t) {
  switch (t) {
    case GGUFValueType::UINT8: return "uint8";
    case GGUFValueType::INT8: return "int8";
    case GGUFValueType::UINT16: return "uint16";
    case GGUFValueType::INT16: return "int16";
    case GGUFValueType::UINT32: return "uint32";
    case GGUFValueType::INT32: return "int32";
    case GGUFValueType::FLOAT32: return "float32";
    case GGUFValueType::BOOL: return "bool";
    case GGUFValueType::STRING: return "string";
    case GGUFValueType::ARRAY: return "array";
    case GGUFValueType::UINT64: return "uint64";
    case GGUFValueType::INT64: return "int64";
    case GGUFValueType::FLOAT64: return "float64";
  }
  return "?";
}

size_t gguf_value_type_size(GGUFValueType t) {
  switch (t) {
    case GGUFValueType::UINT8:
    case GGUFValueType::INT8:
    case GGUFValueType::BOOL: return 1;
    case GGUFValueType::UINT16:
    case GGUFValueType::INT16: return 2;
    case GGUFValueType::UINT32:
    case GGUFValueType::INT32:
    case GGUFValueType::FLOAT32: return 4;
    case GGUFValueType::UINT64:
    case GGUFValueType::INT64:
    case GGUFValueType::FLOAT64: return 8;
    case GGUFValueType::STRING:
    case GGUFValueType::ARRAY: return 0;
  }
  return 0;
}

static bool known_value_type(uint32_t t) { return t <= (uint32_t)GGUFValueType::FLOAT64; }

static bool is_integer_type(GGUFValueType t) {
  switch (t) {
    case GGUFValueType::UINT8:
    case GGUFValueType::INT8:
    case GGUFValueType::UINT16:
    case GGUFValueType::INT16:
    case GGUFValueType::UINT32:
    case GGUFValueType::INT32:
    case GGUFValueType::UINT64:
    case GGUFValueType::INT64: return true;
    default: return false;
  }
}

[[noreturn]] static void type_mismatch(GGUFValueType have, const char* want) {
  throw std::invalid_argument(std::string("GGUF value is ") + gguf_value_type_name(have) +
                              ", not " + want);
}

bool GGUFValue::is_integer() const { return is_integer_type(type); }

int64_t GGUFValue::as_int() const {
  switch (type) {
    case GGUFValueType::UINT8: return (uint8_t)bits;
    case GGUFValueType::INT8: return (int8_t)(uint8_t)bits;
    case GGUFValueType::UINT16: return (uint16_t)bits;
    case GGUFValueType::INT16: return (int16_t)(uint16_t)bits;
    case GGUFValueType::UINT32: return (uint32_t)bits;
    case GGUFValueType::INT32: return (int32_t)(uint32_t)bits;
    case GGUFValueType::INT64: return (int64_t)bits;
    case GGUFValueType::UINT64:
      if (bits > (uint64_t)std::numeric_limits<int64_t>::max())
        throw std::invalid_argument("GGUF uint64 value " + std::to_string(bits) +
                                    " does not fit in int64");
      return (int64_t)bits;
    default: type_mismatch(type, "an integer");
  }
}

uint64_t GGUFValue::as_uint() const {
  if (type == GGUFValueType::UINT64) return bits;
  int64_t v = as_int();
  if (v < 0) throw std::invalid_argument("GGUF value " + std::to_string(v) + " is negative");
  return (uint64_t)v;
}

double GGUFValue::as_float() const {
  if (type == GGUFValueType::FLOAT32) {
    float f;
    uint32_t b = (uint32_t)bits;
    std::memcpy(&f, &b, 4);
    return f;
  }
  if (type == GGUFValueType::FLOAT64) {
    double d;
    std::memcpy(&d, &bits, 8);
    return d;
  }
  if (type == GGUFValueType::UINT64) return (double)bits;
  if (is_integer_type(type)) return (double)as_int();
  type_mismatch(type, "a number");
}

bool GGUFValue::as_bool() const {
  if (type != GGUFValueType::BOOL) type_mismatch(type, "bool");
  return bits != 0;
}

std::string_view GGUFValue::as_string() const {
  if (type != GGUFValueType::STRING) type_mismatch(type, "string");
  return str;
}

GGUFValue GGUFValue::scalar_at(size_t i) const {
  if (!is_array()) type_mismatch(type, "an array");
  if (i >= count) throw std::out_of_range("GGUF array index " + std::to_string(i) + " out of range");
  size_t sz = gguf_value_type_size(elem_type);
  if (sz == 0) type_mismatch(elem_type, "a fixed-size array element");
  GGUFValue v;
  v.type = elem_type;
  std::memcpy(&v.bits, data + i * sz, sz);
  return v;
}

int64_t GGUFValue::int_at(size_t i) const { return scalar_at(i).as_int(); }
double GGUFValue::float_at(size_t i) const { return scalar_at(i).as_float(); }

std::string_view GGUFValue::string_at(size_t i) const {
  if (!is_array() || elem_type != GGUFValueType::STRING) type_mismatch(type, "an array of strings");
  if (i >= count) throw std::out_of_range("GGUF array index " + std::to_string(i) + " out of range");
  return strings[i];
}

// ---------------------------------------------------------------------------------------------
// Parser

namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr int kMaxDims = 4;
constexpr int kMaxArrayDepth = 16;  // nesting of arrays in arrays; bounds the recursion
// Smallest possible encodings, used to bound counts by the bytes left before allocating.
constexpr uint64_t kMinKV = 8 + 4 + 1;             // empty key, type, 1-byte value
constexpr uint64_t kMinTensorInfo = 8 + 4 + 4 + 8;  // empty name, n_dims=0, type, offset
constexpr uint64_t kMinArray = 4 + 8;               // element type + count

class Parser {
 public:
  Parser(const std::string& path, const uint8_t* base, uint64_t size)
      : path_(path), base_(base), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  [[noreturn]] void fail(const std::string& msg) const { throw GGUFError(path_ + ": " + msg); }

  // What is being read, for error messages ("metadata key #3 'general.name'").
  void set_context(std::string ctx) { ctx_ = std::move(ctx); }

  void need(uint64_t n, const char* what) const {
    if (n <= left()) return;
    fail("truncated file: " + std::string(what) + where() + " at offset " +
         std::to_string(pos_) + " needs " + std::to_string(n) + " bytes, but the file ends at " +
         std::to_string(size_));
  }

  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string_view read_string(const char* what) {
    uint64_t n = read<uint64_t>(what);
    if (n > left())
      fail("truncated file or bad length: " + std::string(what) + where() + " has length " +
           std::to_string(n) + " at offset " + std::to_string(pos_ - 8) + ", but only " +
           std::to_string(left()) + " bytes are left in the file (size " + std::to_string(size_) +
           ")");
    std::string_view s((const char*)base_ + pos_, (size_t)n);
    pos_ += n;
    return s;
  }

  void read_value(GGUFValue& v, GGUFValueType t, int depth) {
    v.type = t;
    size_t sz = gguf_value_type_size(t);
    if (sz) {
      need(sz, "a value");
      std::memcpy(&v.bits, base_ + pos_, sz);
      pos_ += sz;
      return;
    }
    if (t == GGUFValueType::STRING) {
      v.str = read_string("a string value");
      return;
    }
    // ARRAY
    uint32_t et = read<uint32_t>("the element type of an array");
    if (!known_value_type(et)) fail("unknown array element type " + std::to_string(et) + where());
    uint64_t n = read<uint64_t>("the length of an array");
    v.elem_type = (GGUFValueType)et;
    v.count = n;
    size_t esz = gguf_value_type_size(v.elem_type);
    uint64_t min_elem = esz ? esz : (v.elem_type == GGUFValueType::STRING ? 8 : kMinArray);
    if (n > left() / min_elem)
      fail("truncated file or bad length: array of " + std::to_string(n) + " " +
           gguf_value_type_name(v.elem_type) + " elements" + where() + " at offset " +
           std::to_string(pos_ - 12) + " needs at least " + mul_str(n, min_elem) +
           " bytes, but only " + std::to_string(left()) + " are left in the file (size " +
           std::to_string(size_) + ")");
    if (esz) {
      v.data = base_ + pos_;
      pos_ += n * esz;
    } else if (v.elem_type == GGUFValueType::STRING) {
      v.strings.resize((size_t)n);
      for (uint64_t i = 0; i < n; i++) v.strings[i] = read_string("an array string");
    } else {
      if (depth >= kMaxArrayDepth)
        fail("arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " levels" + where());
      v.items.resize((size_t)n);
      for (uint64_t i = 0; i < n; i++) read_value(v.items[i], GGUFValueType::ARRAY, depth + 1);
    }
  }

 private:
  std::string where() const { return ctx_.empty() ? std::string() : " (" + ctx_ + ")"; }
  static std::string mul_str(uint64_t a, uint64_t b) {
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) return "more than 2^64";
    return std::to_string(r);
  }

  const std::string& path_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::string ctx_;
};

bool valid_utf8(std::string_view s) {
  const uint8_t* p = (const uint8_t*)s.data();
  size_t n = s.size(), i = 0;
  while (i < n) {
    uint8_t c = p[i];
    int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (!len || i + len > n) return false;
    for (int k = 1; k < len; k++)
      if ((p[i + k] & 0xc0) != 0x80) return false;
    i += len;
  }
  return true;
}

std::string escape_bytes(const uint8_t* p, size_t n);

// A name from the file, quoted for an error message: escaped when it is not printable UTF-8
// (the message becomes a Python str), shortened when long.
std::string quote(std::string_view s) {
  constexpr size_t kMax = 120;
  std::string_view head = s.substr(0, kMax);
  bool plain = valid_utf8(head);
  for (char c : head) plain = plain && (uint8_t)c >= 0x20 && c != 0x7f;
  std::string r = plain ? std::string(head) : escape_bytes((const uint8_t*)head.data(), head.size());
  if (s.size() > kMax) r += "...";
  return "'" + r + "'";
}

std::string escape_bytes(const uint8_t* p, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string r;
  for (size_t i = 0; i < n; i++) {
    uint8_t c = p[i];
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      r += (char)c;
    } else {
      r += "\\x";
      r += hex[c >> 4];
      r += hex[c & 15];
    }
  }
  return r;
}

std::string u128_str(unsigned __int128 v) {
  if (v >> 64) return std::to_string((uint64_t)(v >> 64)) + " * 2^64 + " + std::to_string((uint64_t)v);
  return std::to_string((uint64_t)v);
}

uint32_t byteswap32(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// GGUFFile

GGUFFile::GGUFFile(const std::string& path) : path_(path) {
  // stat first so that a FIFO or device is rejected before open() could block on it.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw GGUFOpenError(path, errno, std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw GGUFOpenError(path, EISDIR, std::strerror(EISDIR));
  if (!S_ISREG(st.st_mode)) throw GGUFOpenError(path, EINVAL, "not a regular file");

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw GGUFOpenError(path, errno, std::strerror(errno));
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    int err = errno;
    ::close(fd);
    throw GGUFOpenError(path, err ? err : EINVAL, "not a regular file");
  }
  size_ = (uint64_t)st.st_size;
  if (size_ == 0) {
    ::close(fd);
    throw GGUFError(path + ": empty file (0 bytes), not a GGUF file");
  }
  void* p = ::mmap(nullptr, (size_t)size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (p == MAP_FAILED) throw GGUFOpenError(path, err, std::string("mmap failed: ") + std::strerror(err));
  base_ = (const uint8_t*)p;
  try {
    parse();
  } catch (...) {
    ::munmap((void*)base_, (size_t)size_);
    base_ = nullptr;
    throw;
  }
}

GGUFFile::~GGUFFile() {
  stop_prefetch();
  if (base_) ::munmap((void*)base_, (size_t)size_);
}

void GGUFFile::prefetch(std::vector<std::pair<uint64_t, uint64_t>> ranges) const {
  std::lock_guard<std::mutex> lk(prefetch_mu_);
  if (prefetch_thread_.joinable() || !base_ || size_ <= data_offset_) return;
  if (ranges.empty()) ranges.emplace_back(data_offset_, size_ - data_offset_);
  prefetch_thread_ = std::thread([this, ranges] {
    const size_t page = 4096;
    const size_t step = size_t(4) << 20;  // in 4 MiB pieces so a stop request is seen quickly
    for (const auto& [off, len] : ranges) {
      if (off >= size_) continue;
      const uintptr_t start = ((uintptr_t)(base_ + off)) & ~(uintptr_t)(page - 1);
      const uintptr_t end = (uintptr_t)(base_ + off + std::min<uint64_t>(len, size_ - off));
      for (uintptr_t a = start; a < end && !prefetch_stop_.load(std::memory_order_relaxed); a += step) {
        const size_t n = std::min<size_t>(step, end - a);
#if defined(MADV_POPULATE_READ)
        if (::madvise((void*)a, n, MADV_POPULATE_READ) == 0) continue;
#endif
        volatile uint8_t sink = 0;  // older kernels: touch one byte per page
        for (uintptr_t b = a; b < a + n; b += page) sink = sink + *(const volatile uint8_t*)b;
        (void)sink;
      }
    }
  });
}

void GGUFFile::stop_prefetch() const {
  std::lock_guard<std::mutex> lk(prefetch_mu_);
  if (prefetch_thread_.joinable()) {
    prefetch_stop_ = true;
    prefetch_thread_.join();
  }
}

const GGUFValue* GGUFFile::find(std::string_view key) const {
  auto it = metadata_index_.find(key);
  return it == metadata_index_.end() ? nullptr : &metadata_[it->second].second;
}

const GGUFTensorInfo* GGUFFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

void GGUFFile::parse() {
  Parser in(path_, base_, size_);

  // --- header
  const size_t n_magic = size_ < 4 ? (size_t)size_ : 4;
  if (std::memcmp(base_, kMagic, n_magic) != 0)
    in.fail("not a GGUF file (magic '" + escape_bytes(base_, n_magic) + "', expected 'GGUF')");
  in.read<uint32_t>("the magic");
  version_ = in.read<uint32_t>("the version");
  if (version_ != 2 && version_ != 3) {
    uint32_t swapped = byteswap32(version_);
    if (swapped == 2 || swapped == 3)
      in.fail("big-endian GGUF files are not supported (version field " + std::to_string(version_) +
              ")");
    in.fail("unsupported GGUF version " + std::to_string(version_) + " (supported: 2, 3)");
  }
  uint64_t n_tensors = in.read<uint64_t>("the tensor count");
  uint64_t n_kv = in.read<uint64_t>("the metadata count");
  // Counts are bounded by the bytes left before anything is allocated (the tensor count again
  // once the metadata has been read, so that a cut inside the metadata is reported there).
  if (n_kv > in.left() / kMinKV)
    in.fail("header claims " + std::to_string(n_kv) + " metadata pairs, which cannot fit in the " +
            std::to_string(in.left()) + " bytes left in the file (truncated or corrupt)");

  // --- metadata
  metadata_.resize((size_t)n_kv);
  std::vector<std::string_view> keys((size_t)n_kv);  // point into the mapping: stable
  metadata_index_.reserve((size_t)n_kv);
  for (uint64_t i = 0; i < n_kv; i++) {
    in.set_context("metadata pair #" + std::to_string(i));
    std::string_view key = in.read_string("the key");
    in.set_context("metadata " + quote(key));
    uint32_t t = in.read<uint32_t>("the value type");
    if (!known_value_type(t)) in.fail("metadata " + quote(key) + " has unknown value type " + std::to_string(t));
    in.read_value(metadata_[i].second, (GGUFValueType)t, 0);
    metadata_[i].first = std::string(key);
    if (!metadata_index_.emplace(key, (size_t)i).second)
      in.fail("duplicate metadata key " + quote(key));
  }

  if (const GGUFValue* a = find("general.alignment")) {
    if (!a->is_integer())
      in.fail(std::string("general.alignment has type ") + gguf_value_type_name(a->type) +
              ", expected an integer");
    const bool huge = a->type == GGUFValueType::UINT64 && a->bits > (uint64_t)INT64_MAX;
    const int64_t v = huge ? -1 : a->as_int();
    if (v <= 0 || (v & (v - 1)) != 0 || v > (int64_t)1 << 30)
      in.fail("general.alignment " + (huge ? std::to_string(a->bits) : std::to_string(v)) +
              " is not a power of two in [1, 2^30]");
    alignment_ = (uint64_t)v;
  }

  // --- tensor index
  if (n_tensors > in.left() / kMinTensorInfo)
    in.fail("header claims " + std::to_string(n_tensors) + " tensors, whose index cannot fit in the " +
            std::to_string(in.left()) + " bytes left in the file (truncated or corrupt)");
  tensors_.resize((size_t)n_tensors);
  std::vector<uint64_t> rel_offsets((size_t)n_tensors);
  tensor_index_.reserve((size_t)n_tensors);
  for (uint64_t i = 0; i < n_tensors; i++) {
    GGUFTensorInfo& t = tensors_[i];
    in.set_context("tensor info #" + std::to_string(i));
    std::string_view name = in.read_string("the tensor name");
    t.name = std::string(name);
    const std::string tn = "tensor " + quote(name);
    in.set_context(tn);
    uint32_t n_dims = in.read<uint32_t>("the number of dimensions");
    if (n_dims > (uint32_t)kMaxDims)
      in.fail(tn + " has " + std::to_string(n_dims) + " dimensions (at most " +
              std::to_string(kMaxDims) + " are supported)");
    int64_t ne[kMaxDims];
    for (uint32_t d = 0; d < n_dims; d++) {
      uint64_t v = in.read<uint64_t>("a dimension");
      if (v == 0 || v > (uint64_t)INT64_MAX)
        in.fail(tn + " has invalid dimension " + std::to_string((int64_t)v) + " (ne[" +
                std::to_string(d) + "])");
      ne[d] = (int64_t)v;
    }
    t.type = (int32_t)in.read<uint32_t>("the tensor type");
    rel_offsets[i] = in.read<uint64_t>("the data offset");

    t.dtype = dtype_info_raw(t.type);
    if (!t.dtype)
      in.fail(tn + " has unknown ggml type id " + std::to_string((uint32_t)t.type));
    int64_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++)
      if (__builtin_mul_overflow(n, ne[d], &n))
        in.fail(tn + ": element count overflows (dimensions too large)");
    t.n_elements = n;
    const int64_t inner = n_dims ? ne[0] : 1;
    if (inner % t.dtype->block_size != 0)
      in.fail(tn + " (" + t.dtype->name + "): innermost dimension " + std::to_string(inner) +
              " is not a multiple of the block size " + std::to_string(t.dtype->block_size));
    uint64_t nbytes;
    if (__builtin_mul_overflow((uint64_t)(n / t.dtype->block_size), (uint64_t)t.dtype->type_size, &nbytes))
      in.fail(tn + ": byte size overflows (dimensions too large)");
    t.nbytes = nbytes;
    t.shape.assign(n_dims, 0);
    for (uint32_t d = 0; d < n_dims; d++) t.shape[n_dims - 1 - d] = ne[d];  // flip to numpy order

    auto ins = tensor_index_.emplace(name, (size_t)i);
    if (!ins.second)
      in.fail("duplicate tensor name " + quote(name) + " (tensors #" + std::to_string(ins.first->second) +
              " and #" + std::to_string(i) + ")");
  }
  in.set_context("");

  // --- data section
  uint64_t end = in.pos();
  data_offset_ = (end + alignment_ - 1) / alignment_ * alignment_;
  for (uint64_t i = 0; i < n_tensors; i++) {
    GGUFTensorInfo& t = tensors_[i];
    uint64_t rel = rel_offsets[i];
    if (rel % alignment_ != 0)
      in.fail("tensor " + quote(t.name) + " data offset " + std::to_string(rel) +
              " is not a multiple of the alignment " + std::to_string(alignment_));
    // 128-bit so that absurd offsets cannot wrap around
    const unsigned __int128 abs_off = (unsigned __int128)data_offset_ + rel;
    if (abs_off + t.nbytes > size_)
      in.fail("tensor " + quote(t.name) + " data (offset " + u128_str(abs_off) + ", " +
              std::to_string(t.nbytes) + " bytes) runs past the end of the file (size " +
              std::to_string(size_) + ")");
    t.offset = (uint64_t)abs_off;
  }
}

}  // namespace pyfast
