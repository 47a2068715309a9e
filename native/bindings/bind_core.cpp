// dtypes, CPU features and ISA selection, host buffers, thread pools, row codecs.
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "bindings/bindings.h"
#include "pyfast/cpu.h"
#include "cpu/kernels/vexp.h"
#include "pyfast/threadpool.h"
#include "pyfast/backend.h"

namespace py = pybind11;
using namespace pyfast;

namespace pyfast_py {

// KV-cache bookkeeping for n consecutive positions pos0.. of sequence seq (KVCache.prepare for
// that case): a pair already stored keeps its cell, the others take the lowest free cells
// (cell[t]); then the n mask rows over the first n_kv cells (row t at mk + t * n_kv) and the cells'
// position order. Returns n_kv, or -1 when the cache is full (then nothing is written).
static int64_t kv_prepare(int32_t* cp, int32_t* cs, int64_t n_ctx, int64_t used_top, int32_t seq, int32_t pos0, int64_t n,
                          int64_t pad, float* mk, int32_t* od, int32_t* cell) {
  for (int64_t t = 0; t < n; ++t) cell[t] = -1;
  for (int64_t j = 0; j < used_top; ++j)
    if (cs[j] == seq && cp[j] >= pos0 && cp[j] - pos0 < n && cell[cp[j] - pos0] < 0) cell[cp[j] - pos0] = (int32_t)j;
  int64_t top = used_top, j = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (cell[t] >= 0) continue;
    while (j < n_ctx && cp[j] >= 0) ++j;
    if (j >= n_ctx) return -1;
    cell[t] = (int32_t)j++;
  }
  for (int64_t t = 0; t < n; ++t) {
    cp[cell[t]] = pos0 + (int32_t)t;
    cs[cell[t]] = seq;
    top = std::max(top, (int64_t)cell[t] + 1);
  }
  const int64_t n_kv = std::min(n_ctx, (top + pad - 1) / pad * pad);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    float* row = mk + t * n_kv;
    const int32_t p = pos0 + (int32_t)t;
    for (int64_t c = 0; c < n_kv; ++c) row[c] = (cs[c] == seq && cp[c] >= 0 && cp[c] <= p) ? 0.0f : ninf;
  }
  for (int64_t c = 0; c < n_kv; ++c) od[c] = (int32_t)c;
  std::stable_sort(od, od + n_kv, [cp](int32_t a, int32_t b) { return cp[a] < cp[b]; });
  return n_kv;
}

// Host memory owned by Python objects (KV caches, recurrent states): zeroed, 64-byte aligned.
// Large buffers come from an anonymous mapping, whose pages the kernel zero-fills on first touch:
// a KV cache sized for a long context costs resident memory only for the cells actually written.
// huge_pages (model weights read into memory): ask the kernel for transparent huge pages, so that
// streaming the weights every decode does not walk the page tables every 4 KiB (on a 2-core Xeon
// VM a 1-row SmolLM2 decode took 17% less time with its weights in 2 MiB pages than mapped from
// the file).
struct HostBuffer {
  static constexpr size_t kMapThreshold = size_t(1) << 20;
  explicit HostBuffer(size_t n, bool huge_pages = false, bool advise = true) : nbytes(n) {
    const size_t alloc = n ? n : 64;
#if defined(__unix__) || defined(__APPLE__)
    if (alloc >= kMapThreshold) {
      // huge_pages: the start on a 2 MiB boundary, so that every whole 2 MiB of the buffer can be
      // one huge page (the kernel aligns only some anonymous mappings)
      const size_t H = huge_pages ? size_t(2) << 20 : 0;
      map_len = alloc + H;
      void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      map_base = p;
      data = static_cast<uint8_t*>(p);
      if (H) data += (H - reinterpret_cast<uintptr_t>(p) % H) % H;
      mapped = true;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      if (huge_pages && advise) madvise(data, alloc, MADV_HUGEPAGE);  // advice only: without THP, 4 KiB pages
#else
      (void)huge_pages;
#endif
      return;
    }
#endif
    (void)huge_pages;
    (void)advise;
    void* p = nullptr;
    if (posix_memalign(&p, 64, alloc) != 0) throw std::bad_alloc();
    std::memset(p, 0, alloc);
    data = static_cast<uint8_t*>(p);
  }
  ~HostBuffer() {
    if (device) device->unbind_host(data);
#if defined(__unix__) || defined(__APPLE__)
    if (mapped) {
      munmap(map_base, map_len);
      return;
    }
#endif
    std::free(data);
  }
  void zero() {
#if defined(__linux__)
    // Dropping the pages zero-fills them on next touch and returns the memory.
    if (mapped && madvise(data, nbytes, MADV_DONTNEED) == 0) return;
#endif
    std::memset(data, 0, nbytes);
  }
  // On a device: the device copy (authoritative; graphs read and write it) of these bytes.
  void attach(std::shared_ptr<Backend> dev) {
    dbuf = dev->alloc(nbytes);
    dev->bind_host(data, nbytes, dbuf);
    device = std::move(dev);
  }
  // Buffer.collapse (see its docstring): the 4 KiB pages of [off, off + n)'s whole 2 MiB pages
  // replaced by huge pages holding the same bytes. Collapsing the pages in place (MADV_COLLAPSE)
  // copies into each new huge page with the range unmapped, and on a VM whose host has to back
  // that page first, a decoding thread that reaches the range waits for it (decode 2-5x slower
  // for seconds); here the new pages are faulted in before anything is unmapped.
  bool collapse(size_t off, size_t n, const py::object& lock) {
#if defined(__linux__) && defined(MADV_HUGEPAGE) && defined(MREMAP_FIXED)
    const uintptr_t H = uintptr_t(2) << 20, lo = (reinterpret_cast<uintptr_t>(data) + off + H - 1) & ~(H - 1);
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + off + n) & ~(H - 1);
    if (!mapped || hi <= lo || !thp_available()) return false;
    const size_t len = hi - lo;
    uint8_t* m = nullptr;
    uint8_t* q = nullptr;
    {
      py::gil_scoped_release rel;
      void* v = mmap(nullptr, len + H, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (v == MAP_FAILED) return false;
      m = static_cast<uint8_t*>(v);
      q = reinterpret_cast<uint8_t*>(((uintptr_t)m + H - 1) & ~(H - 1));
      if (q > m) munmap(m, q - m);  // keep [q, q + len): whole huge pages
      if (m + len + H > q + len) munmap(q + len, m + len + H - (q + len));
      madvise(q, len, MADV_HUGEPAGE);
      if (madvise(q, len, 23 /* MADV_POPULATE_WRITE, Linux 5.14 */) != 0)
        for (size_t i = 0; i < len; i += 4096) q[i] = 0;
    }
    const bool locked = !lock.is_none();
    if (locked) {
      try {
        lock.attr("acquire")();
      } catch (...) {
        munmap(q, len);
        throw;
      }
    }
    bool ok;
    {
      py::gil_scoped_release rel;
      std::memcpy(q, reinterpret_cast<void*>(lo), len);
      ok = mremap(q, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(lo)) != MAP_FAILED;
      if (!ok) munmap(q, len);
    }
    if (locked) lock.attr("release")();
    return ok;
#else
    (void)off;
    (void)n;
    (void)lock;
    return false;
#endif
  }
  // Whether the kernel can give transparent huge pages to a region advised for them.
  static bool thp_available() {
    static const bool yes = [] {
      FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
      if (!f) return false;
      char buf[128] = {0};
      const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
      std::fclose(f);
      buf[got] = 0;
      return std::strstr(buf, "[never]") == nullptr;
    }();
    return yes;
  }
  void check_range(size_t off, size_t& n, const char* what) const {
    if (n == (size_t)-1) n = off <= nbytes ? nbytes - off : 0;
    if (off > nbytes || n > nbytes - off) throw std::out_of_range(std::string("Buffer.") + what + ": range out of bounds");
  }
  uint8_t* data = nullptr;
  size_t nbytes = 0;
  bool mapped = false;
  void* map_base = nullptr;  // the mapping (data may start up to 2 MiB into it)
  size_t map_len = 0;
  std::shared_ptr<Backend> device;
  std::shared_ptr<DeviceBuffer> dbuf;
};

// How many tokens ending at index a equal those ending at index b (at most m; the prompt-lookup
// searches below compare against the sequence end, b = L - 1).
static int64_t common_suffix(const int32_t* t, int64_t a, int64_t b, int64_t m) {
  int64_t k = 0;
  while (k < m && t[a - k] == t[b - k]) ++k;
  return k;
}

static CpuIsa isa_from_str(const std::string& s) {
  if (s == "scalar") return CpuIsa::scalar;
  if (s == "avx2") return CpuIsa::avx2;
  if (s == "avx512") return CpuIsa::avx512;
  if (s == "neon") return CpuIsa::neon;
  if (s == "auto" || s == "best") return cpu_best_isa();
  throw std::invalid_argument("unknown CPU ISA '" + s + "' (scalar, avx2, avx512, neon, auto)");
}

void bind_core(py::module_& m) {
  py::enum_<DType>(m, "DType", "Element types (values are GGUF's type ids)")
      .value("F32", DType::F32).value("F16", DType::F16).value("BF16", DType::BF16)
      .value("I32", DType::I32).value("Q8_0", DType::Q8_0).value("Q4_0", DType::Q4_0)
      .value("Q4_1", DType::Q4_1).value("Q5_0", DType::Q5_0).value("Q5_1", DType::Q5_1)
      .value("Q8_1", DType::Q8_1).value("Q2_K", DType::Q2_K).value("Q3_K", DType::Q3_K)
      .value("Q4_K", DType::Q4_K).value("Q5_K", DType::Q5_K).value("Q6_K", DType::Q6_K)
      .value("Q8_K", DType::Q8_K).value("I8", DType::I8).value("I16", DType::I16)
      .value("I64", DType::I64).value("F64", DType::F64);

  m.def("dtype_block_size", [](DType t) { return dtype_block_size(t); }, "Elements per block (1 for plain types).");
  m.def("dtype_type_size", [](DType t) { return dtype_type_size(t); }, "Bytes per block.");
  m.def("dtype_row_size", [](DType t, int64_t n) { return dtype_row_size(t, n); }, "Bytes of a row of n elements.");

  m.def("kv_prepare_one", [](py::array_t<int32_t, py::array::c_style> cell_pos, py::array_t<int32_t, py::array::c_style> cell_seq,
                             int64_t used_top, int32_t seq, int32_t pos, int64_t pad,
                             py::array_t<float, py::array::c_style> mask, py::array_t<int32_t, py::array::c_style> order) -> py::tuple {
    const int64_t n_ctx = cell_pos.shape(0);
    if (cell_seq.shape(0) != n_ctx || mask.shape(0) < n_ctx || order.shape(0) < n_ctx || pad < 1 || used_top < 0 ||
        used_top > n_ctx || pos < 0)
      throw std::invalid_argument("kv_prepare_one: inconsistent arguments");
    int32_t cell = -1;
    const int64_t n_kv = kv_prepare(cell_pos.mutable_data(), cell_seq.mutable_data(), n_ctx, used_top, seq, pos, 1, pad,
                                    mask.mutable_data(), order.mutable_data(), &cell);
    if (n_kv < 0) return py::make_tuple((int64_t)-1, (int64_t)0);
    return py::make_tuple((int64_t)cell, n_kv);
  }, py::arg("cell_pos"), py::arg("cell_seq"), py::arg("used_top"), py::arg("seq"), py::arg("pos"), py::arg("pad"),
     py::arg("mask"), py::arg("order"),
     "KV-cache bookkeeping for one token (the generation step): claims the cell for (seq, pos), writes the "
     "attention mask row and the position order of the first n_kv cells; returns (cell, n_kv), cell -1 when full.");
  m.def("kv_prepare_run", [](py::array_t<int32_t, py::array::c_style> cell_pos, py::array_t<int32_t, py::array::c_style> cell_seq,
                             int64_t used_top, int32_t seq, int32_t pos0, int64_t n, int64_t pad,
                             py::array_t<float, py::array::c_style> mask, py::array_t<int32_t, py::array::c_style> order,
                             py::array_t<int32_t, py::array::c_style> idx) -> int64_t {
    const int64_t n_ctx = cell_pos.shape(0);
    if (cell_seq.shape(0) != n_ctx || n < 1 || mask.size() < n * n_ctx || order.shape(0) < n_ctx || idx.shape(0) < n ||
        pad < 1 || used_top < 0 || used_top > n_ctx || pos0 < 0)
      throw std::invalid_argument("kv_prepare_run: inconsistent arguments");
    return kv_prepare(cell_pos.mutable_data(), cell_seq.mutable_data(), n_ctx, used_top, seq, pos0, n, pad,
                      mask.mutable_data(), order.mutable_data(), idx.mutable_data());
  }, py::arg("cell_pos"), py::arg("cell_seq"), py::arg("used_top"), py::arg("seq"), py::arg("pos0"), py::arg("n"),
     py::arg("pad"), py::arg("mask"), py::arg("order"), py::arg("idx"),
     "kv_prepare_one for n consecutive positions pos0.. of one sequence (a verify batch): claims the cells "
     "(written to idx), writes the n mask rows (row t at mask[t * n_kv:]) and the cell order; returns n_kv, "
     "or -1 when the cache is full (then nothing is written).");
  m.def("kv_truncate", [](py::array_t<int32_t, py::array::c_style> cell_pos, py::array_t<int32_t, py::array::c_style> cell_seq,
                          int64_t used_top, int32_t seq, int32_t p) -> int64_t {
    const int64_t n_ctx = cell_pos.shape(0);
    if (cell_seq.shape(0) != n_ctx || used_top < 0 || used_top > n_ctx)
      throw std::invalid_argument("kv_truncate: inconsistent arguments");
    int32_t* cp = cell_pos.mutable_data();
    int32_t* cs = cell_seq.mutable_data();
    for (int64_t c = 0; c < used_top; ++c)
      if (cs[c] == seq && cp[c] >= p) cp[c] = cs[c] = -1;
    while (used_top > 0 && cp[used_top - 1] < 0) --used_top;
    return used_top;
  }, py::arg("cell_pos"), py::arg("cell_seq"), py::arg("used_top"), py::arg("seq"), py::arg("p"),
     "Frees the cells of sequence seq at positions >= p (below used_top); returns the new used_top (one past "
     "the highest used cell).");
  m.def("ngram_last_match", [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> h, int64_t n) -> int64_t {
    // The end j (n-1 <= j <= L-2) of the most recent earlier occurrence of the last n tokens, or -1.
    if (h.ndim() != 1) throw std::invalid_argument("ngram_last_match: tokens must be 1-D");
    if (n < 1) throw std::invalid_argument("ngram_last_match: n must be >= 1");
    const int64_t L = h.shape(0);
    const int32_t* t = h.data();
    if (L < n + 1) return -1;
    for (int64_t j = L - 2; j >= n - 1; --j)
      if (common_suffix(t, j, L - 1, n) == n) return j;
    return -1;
  }, py::arg("tokens"), py::arg("n"),
     "Prompt lookup: the index j (n-1 <= j <= len-2) where the most recent earlier occurrence of the last n "
     "tokens ends, or -1.");
  m.def("ngram_best_match", [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> h, int64_t n,
                                int64_t cap, int64_t limit) -> py::tuple {
    // ngram-simple's source choice (pyfast/spec/ngram.py, _find_best_match): among the earlier
    // occurrences of the last n tokens, the most recent one of those whose common suffix with the
    // sequence, counted up to cap, is longest. Returns (end j, common suffix length up to limit),
    // or (-1, 0). The backward scan stops at the first occurrence that reaches cap.
    if (h.ndim() != 1) throw std::invalid_argument("ngram_best_match: tokens must be 1-D");
    if (n < 1 || cap < n || limit < cap)
      throw std::invalid_argument("ngram_best_match: need 1 <= n <= cap <= limit");
    const int64_t L = h.shape(0);
    const int32_t* t = h.data();
    int64_t best = -1, best_key = -1, best_len = 0;
    for (int64_t j = L - 2; j >= n - 1 && best_key < cap; --j) {
      if (common_suffix(t, j, L - 1, n) != n) continue;
      const int64_t len = common_suffix(t, j, L - 1, std::min(limit, j + 1));
      const int64_t key = std::min(len, cap);
      if (key > best_key) best = j, best_key = key, best_len = len;
    }
    return py::make_tuple(best, best_len);
  }, py::arg("tokens"), py::arg("n"), py::arg("cap"), py::arg("limit"),
     "Prompt lookup: the end of the most recent earlier occurrence of the last n tokens among those with the "
     "longest common suffix (counted up to cap), and that suffix's length (up to limit); (-1, 0) if none.");
  m.def("ngram_match_length", [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> h, int64_t j,
                                  int64_t limit) -> int64_t {
    // How many tokens ending at j equal the tokens ending at the sequence end (at most limit, j + 1).
    if (h.ndim() != 1) throw std::invalid_argument("ngram_match_length: tokens must be 1-D");
    const int64_t L = h.shape(0);
    if (j < 0 || j >= L) throw std::invalid_argument("ngram_match_length: j out of range");
    return common_suffix(h.data(), j, L - 1, std::min(limit, j + 1));
  }, py::arg("tokens"), py::arg("j"), py::arg("limit"),
     "Prompt lookup: the length of the common suffix of tokens[:j+1] and tokens (at most limit).");
  m.def("ngram_local_match", [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> h, int64_t n,
                                int64_t n_local, int64_t expect) -> int64_t {
    // ngram-simple's re-sync search (pyfast/spec/ngram.py, NgramSimple._local_match): for key
    // lengths m = n-1 .. n_local, the end e nearest to `expect` (within min(8, 2^m), the lower e
    // on a tie) of an occurrence of the last m tokens; returns e + 1, or -1.
    if (h.ndim() != 1) throw std::invalid_argument("ngram_local_match: tokens must be 1-D");
    const int64_t L = h.shape(0);
    const int32_t* t = h.data();
    for (int64_t m = n - 1; m >= std::max<int64_t>(n_local, 1); --m) {
      const int64_t w = std::min<int64_t>(8, (int64_t)1 << std::min<int64_t>(m, 4));
      const int64_t e0 = std::max(m - 1, expect - w), e1 = std::min(L - 2, expect + w);
      int64_t best = -1;
      for (int64_t e = e0; e <= e1; ++e) {
        if (e - m + 1 >= 0 && common_suffix(t, e, L - 1, m) == m &&
            (best < 0 || std::llabs(e - expect) < std::llabs(best - expect)))
          best = e;
      }
      if (best >= 0) return best + 1;
    }
    return -1;
  }, py::arg("tokens"), py::arg("n"), py::arg("n_local"), py::arg("expect"),
     "ngram-simple's re-sync search near an expected source position (see NgramSimple._local_match).");
  m.def("exp_f32", [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
    const int64_t n = x.size();
    py::array_t<float> out(n);
    const float* px = x.data();
    float* po = out.mutable_data();
    exp_f32_array(px, po, n, cpu_isa());
    return out;
  }, py::arg("x"), "The kernels' exp (vexp.h) of a float32 array, in the current ISA's form (for tests).");
  m.def("topk_row", [](py::array_t<float, py::array::c_style | py::array::forcecast> x, int64_t k) {
    if (x.ndim() != 1) throw std::invalid_argument("topk_row: x must be 1-D");
    if (k < 1) throw std::invalid_argument("topk_row: k must be >= 1");
    const int64_t n = x.shape(0);
    py::array_t<int32_t> out(std::min(k, n));
    const float* px = x.data();
    int32_t* po = out.mutable_data();
    {
      py::gil_scoped_release rel;
      cpu_topk_row(px, n, k, po);
    }
    return out;
  }, py::arg("x"), py::arg("k"),
     "Indices of the k largest values of a float32 row, largest first (ties: lower index first; NaN as -inf).");
  m.def("sample_candidates", [](py::array_t<float, py::array::c_style | py::array::forcecast> x, int64_t k,
                                double top_p, double min_p, double temperature) {
    if (x.ndim() != 1) throw std::invalid_argument("sample_candidates: x must be 1-D");
    const int64_t n = x.shape(0);
    if (!(k > 0 && k < n)) throw std::invalid_argument("sample_candidates: k must be in [1, n)");
    py::array_t<int32_t> ids(k);
    py::array_t<double> probs(k);
    const int64_t kept = cpu_sample_candidates(x.data(), n, k, top_p, min_p, temperature, ids.mutable_data(),
                                               probs.mutable_data());
    return py::make_tuple(ids[py::slice(0, kept, 1)], probs[py::slice(0, kept, 1)]);
  }, py::arg("x"), py::arg("k"), py::arg("top_p"), py::arg("min_p"), py::arg("temperature"),
     "The sampler chain after penalties: top-k -> min-p -> top-p -> temperature -> softmax. Returns (ids int32, "
     "probs float64) of the kept tokens, most likely first.");
  m.def("sample_row", [](py::array_t<float, py::array::c_style | py::array::forcecast> x, int64_t k, double top_p,
                         double min_p, double temperature, double u) {
    if (x.ndim() != 1) throw std::invalid_argument("sample_row: x must be 1-D");
    const int64_t n = x.shape(0);
    if (!(k > 0 && k < n)) throw std::invalid_argument("sample_row: k must be in [1, n)");
    int32_t ids_s[256];
    double probs_s[256];
    std::vector<int32_t> ids_v;
    std::vector<double> probs_v;
    int32_t* ids = ids_s;
    double* probs = probs_s;
    if (k > 256) {
      ids_v.resize((size_t)k);
      probs_v.resize((size_t)k);
      ids = ids_v.data();
      probs = probs_v.data();
    }
    const int64_t kept = cpu_sample_candidates(x.data(), n, k, top_p, min_p, temperature, ids, probs);
    return (int64_t)ids[cpu_sample_draw(probs, kept, u)];
  }, py::arg("x"), py::arg("k"), py::arg("top_p"), py::arg("min_p"), py::arg("temperature"), py::arg("u"),
     "sample_candidates, then the token that u in [0, 1) draws from them (the generation step's one call).");
  m.def("read_bandwidth", [](size_t nbytes, int n_threads, int reps) {
    std::shared_ptr<ThreadPool> pool;
    if (n_threads > 1) pool = std::make_shared<ThreadPool>(n_threads);
    py::gil_scoped_release rel;
    return cpu_read_bandwidth(nbytes, pool.get(), reps);
  }, py::arg("nbytes") = size_t(512) << 20, py::arg("n_threads") = 1, py::arg("reps") = 3,
     "Measured memory read bandwidth in bytes/s (best of reps passes over nbytes).");
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw; d["avx512vl"] = f.avx512vl; d["avx512vnni"] = f.avx512vnni;
    d["avx512bf16"] = f.avx512bf16; d["avxvnni"] = f.avxvnni; d["neon"] = f.neon; d["dotprod"] = f.dotprod;
    return d;
  }, "Which SIMD extensions this CPU has.");
  m.def("cpu_isa", [] { return std::string(cpu_isa_name(cpu_isa())); }, "The SIMD path kernels use now.");
  m.def("cpu_best_isa", [] { return std::string(cpu_isa_name(cpu_best_isa())); }, "The best SIMD path this CPU supports.");
  m.def("set_cpu_isa", [](const std::string& s) { set_cpu_isa(isa_from_str(s)); }, py::arg("isa"),
        "Select the kernels' SIMD path: 'scalar' (reference mode), 'avx2', 'avx512', 'neon' or 'auto'.");

  py::class_<HostBuffer, std::shared_ptr<HostBuffer>>(m, "Buffer", py::buffer_protocol(),
                                                     "Zeroed, 64-byte aligned host memory (KV caches, states, weights read into memory).")
      .def(py::init([](size_t n, bool huge, std::shared_ptr<Backend> dev, bool advise) {
        auto b = std::make_shared<HostBuffer>(n, huge, advise);
        if (dev) b->attach(std::move(dev));
        return b;
      }), py::arg("nbytes"), py::arg("huge_pages") = false, py::arg("device") = nullptr, py::arg("advise") = true,
         "device: also keep a copy in that device's memory, which graphs on the device read and write "
         "(the host bytes are then a mirror: to_host / to_device copy explicitly). huge_pages: start on a "
         "2 MiB boundary and (advise) ask for transparent huge pages at the first touch; advise=False "
         "leaves the pages 4 KiB until collapse().")
      .def_readonly("nbytes", &HostBuffer::nbytes)
      .def_property_readonly("device", [](const HostBuffer& b) -> py::object {
        return b.device ? py::str(b.device->info().name) : py::object(py::none());
      })
      .def("zero", [](HostBuffer& b) {
        b.zero();
        if (b.dbuf) b.dbuf->zero(0, b.nbytes);
      }, "Zero the bytes (and the device copy).")
      .def("collapse", [](HostBuffer& b, size_t off, size_t n, py::object lock) {
        b.check_range(off, n, "collapse");
        return b.collapse(off, n, lock);
      }, py::arg("offset") = 0, py::arg("nbytes") = (size_t)-1, py::arg("lock") = py::none(),
         "Move the whole 2 MiB pages inside the range into transparent huge pages, same bytes at the "
         "same addresses: fresh huge pages are faulted in first (the slow part, nothing held), then, "
         "holding `lock` (a threading.Lock, or None), the bytes are copied and the pages moved over the "
         "old ones (mremap). Readers may read the range meanwhile; writers must hold `lock`. False where "
         "the kernel has no transparent huge pages or declined (the bytes are then unchanged).")
      .def("to_host", [](HostBuffer& b, size_t off, size_t n) {
        b.check_range(off, n, "to_host");
        if (b.dbuf) {
          py::gil_scoped_release rel;
          b.dbuf->read(off, b.data + off, n);
        }
      }, py::arg("offset") = 0, py::arg("nbytes") = (size_t)-1, "Copy the device copy's bytes into host memory (no-op on the CPU).")
      .def("to_device", [](HostBuffer& b, size_t off, size_t n) {
        b.check_range(off, n, "to_device");
        if (b.dbuf) {
          py::gil_scoped_release rel;
          b.dbuf->write(off, b.data + off, n);
        }
      }, py::arg("offset") = 0, py::arg("nbytes") = (size_t)-1, "Copy host bytes to the device copy (no-op on the CPU).")
      .def("copy_from", [](HostBuffer& b, const HostBuffer& o, size_t dst_off, size_t src_off, size_t n) {
        if (dst_off + n > b.nbytes || src_off + n > o.nbytes) throw std::out_of_range("Buffer.copy_from: range out of bounds");
        if (o.dbuf) o.dbuf->read(src_off, o.data + src_off, n);
        std::memmove(b.data + dst_off, o.data + src_off, n);
        if (b.dbuf) b.dbuf->write(dst_off, b.data + dst_off, n);
      }, py::arg("other"), py::arg("dst_offset"), py::arg("src_offset"), py::arg("nbytes"))
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1, {(py::ssize_t)b.nbytes}, {1});
      });

  py::class_<ThreadPool, std::shared_ptr<ThreadPool>>(m, "ThreadPool", "Persistent worker threads for plans.")
      .def(py::init<int>(), py::arg("n_threads"))
      .def_property_readonly("n_threads", &ThreadPool::size);

  m.def("row_to_f32", [](DType t, py::buffer src, int64_t n) {
    py::buffer_info bi = src.request();
    const size_t need = dtype_row_size(t, n);
    if (n % dtype_block_size(t) != 0) throw std::invalid_argument("n must be a multiple of the block size");
    if ((size_t)(bi.size * bi.itemsize) < need) throw std::invalid_argument("source buffer too small");
    py::array_t<float> out(n);
    row_to_f32(t, bi.ptr, out.mutable_data(), n);
    return out;
  }, py::arg("dtype"), py::arg("src"), py::arg("n"), "Decode n elements of type dtype to float32 (reference codec).");
  m.def("row_from_f32", [](DType t, py::array_t<float, py::array::c_style | py::array::forcecast> src) {
    const int64_t n = (int64_t)src.size();
    if (n % dtype_block_size(t) != 0) throw std::invalid_argument("length must be a multiple of the block size");
    py::array_t<uint8_t> out((py::ssize_t)dtype_row_size(t, n));
    row_from_f32(t, src.data(), out.mutable_data(), n);
    return out;
  }, py::arg("dtype"), py::arg("src"), "Encode float32 values as dtype (reference quantizers); returns bytes as uint8.");
}

}  // namespace pyfast_py
