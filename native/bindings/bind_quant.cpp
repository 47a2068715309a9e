// Whole-tensor quantization and dequantization (pyfast quantize, tests).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "cpu/quant/quant.h"
#include "pyfast/cpu.h"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace py = pybind11;
using namespace pyfast;

namespace pyfast_py {

// Bytes of a [nrows, ncols] weight of t that pack_x16 / unpack_x16 accept (the buffer must hold
// exactly that many); a clear error otherwise.
static size_t x16_bytes(const char* what, DType t, const py::buffer_info& bi, int64_t nrows, int64_t ncols) {
  if (!packable(t)) throw std::invalid_argument(std::string("[") + what + "] unsupported dtype " + dtype_name(t));
  if (nrows <= 0 || nrows % 16 != 0 || ncols <= 0 || ncols % dtype_block_size(t) != 0)
    throw std::invalid_argument(std::string("[") + what + "] needs rows a multiple of 16 and whole blocks, got " +
                                std::to_string(nrows) + " x " + std::to_string(ncols));
  const size_t n = dtype_row_size(t, ncols) * (size_t)nrows;
  if ((size_t)(bi.size * bi.itemsize) != n)
    throw std::invalid_argument(std::string("[") + what + "] buffer size does not match the shape");
  return n;
}

// Chunks [c0, c1) of cb bytes from p, each rewritten in place into the x16 layout (its packed
// bytes take its own rows' place; rows: a chunk-sized scratch).
static void pack_chunks(DType t, uint8_t* p, size_t cb, int64_t ncols, int64_t c0, int64_t c1, std::vector<uint8_t>& rows) {
  rows.resize(cb);
  for (int64_t c = c0; c < c1; ++c) {
    std::memcpy(rows.data(), p + c * cb, cb);
    pack_x16(t, rows.data(), p + c * cb, 16, ncols);
  }
}

void bind_quant(py::module_& m) {
  m.def(
      "quantize_tensor",
      [](DType t, py::array_t<float, py::array::c_style | py::array::forcecast> src, int n_threads) {
        if (src.ndim() < 1) throw std::invalid_argument("[quantize_tensor] src must have at least 1 dim");
        const int64_t ncols = (int64_t)src.shape(src.ndim() - 1);
        const int64_t nrows = ncols ? (int64_t)src.size() / ncols : 0;
        if (ncols == 0) throw std::invalid_argument("[quantize_tensor] empty rows");
        if (!quant_supported(t) || t == DType::Q8_1)
          throw std::invalid_argument(std::string("[quantize_tensor] cannot quantize to ") + dtype_name(t));
        if (ncols % dtype_block_size(t) != 0)
          throw std::invalid_argument("[quantize_tensor] row length " + std::to_string(ncols) +
                                      " is not a multiple of the " + dtype_name(t) + " block size " +
                                      std::to_string(dtype_block_size(t)));
        if (n_threads <= 0) n_threads = (int)std::max(1u, std::thread::hardware_concurrency());
        const size_t rb = dtype_row_size(t, ncols);
        py::array_t<uint8_t> out({(py::ssize_t)nrows, (py::ssize_t)rb});
        const float* s = src.data();
        uint8_t* d = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          quantize_rows(t, s, d, nrows, ncols, n_threads);
        }
        return out;
      },
      py::arg("dtype"), py::arg("src"), py::arg("n_threads") = 0,
      "Quantize a float32 array (rows = its last dim) to dtype with n_threads threads (0: all cores).\n"
      "Returns uint8 [n_rows, row_bytes]; the bytes do not depend on n_threads. Releases the GIL.");

  m.def(
      "dequantize_tensor",
      [](DType t, py::buffer raw, int64_t nrows, int64_t ncols) {
        py::buffer_info bi = raw.request();
        if (!quant_supported(t)) throw std::invalid_argument(std::string("[dequantize_tensor] unsupported dtype ") + dtype_name(t));
        if (nrows < 0 || ncols <= 0 || ncols % dtype_block_size(t) != 0)
          throw std::invalid_argument("[dequantize_tensor] bad shape for " + std::string(dtype_name(t)));
        const size_t rb = dtype_row_size(t, ncols);
        if ((size_t)(bi.size * bi.itemsize) < rb * (size_t)nrows)
          throw std::invalid_argument("[dequantize_tensor] source buffer too small");
        py::array_t<float> out({(py::ssize_t)nrows, (py::ssize_t)ncols});
        const uint8_t* s = static_cast<const uint8_t*>(bi.ptr);
        float* d = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          for (int64_t r = 0; r < nrows; ++r) row_to_f32(t, s + (size_t)r * rb, d + r * ncols, ncols);
        }
        return out;
      },
      py::arg("dtype"), py::arg("raw"), py::arg("n_rows"), py::arg("n_cols"),
      "Decode n_rows rows of n_cols elements of dtype (contiguous bytes) to float32 [n_rows, n_cols].\n"
      "Releases the GIL.");

  m.def("packable", [](DType t) { return packable(t); }, py::arg("dtype"),
        "Whether weights of dtype can be stored in the packed x16 layout (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).");
  m.def(
      "pack_x16",
      [](DType t, py::buffer raw, int64_t nrows, int64_t ncols) {
        py::buffer_info bi = raw.request(true);
        const size_t n = x16_bytes("pack_x16", t, bi, nrows, ncols);
        uint8_t* p = static_cast<uint8_t*>(bi.ptr);
        {
          py::gil_scoped_release nogil;
          // chunk by chunk: a chunk's packed bytes take its own rows' place (no tensor-sized copy);
          // a large weight's chunks are spread over the cores (model loading packs gigabytes)
          const size_t cb = n / (size_t)(nrows / 16);
          const int64_t n_chunks = nrows / 16;
          auto pack_range = [&](int64_t c0, int64_t c1) {
            std::vector<uint8_t> rows;
            pack_chunks(t, p, cb, ncols, c0, c1, rows);
          };
          const unsigned cores = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
          const int nth = n >= (size_t(8) << 20) ? (int)cores : 1;
          std::vector<std::thread> th;
          for (int i = 1; i < nth; ++i) th.emplace_back(pack_range, n_chunks * i / nth, n_chunks * (i + 1) / nth);
          pack_range(0, n_chunks / nth);
          for (auto& x : th) x.join();
        }
      },
      py::arg("dtype"), py::arg("raw"), py::arg("n_rows"), py::arg("n_cols"),
      "Rewrite a row-major [n_rows, n_cols] weight of dtype (writable bytes) in place into the packed\n"
      "x16 layout that Graph.external(..., packed=True) expects. Releases the GIL.");

#if defined(__unix__) || defined(__APPLE__)
  m.def(
      "read_pack",
      [](int fd, py::buffer raw, int64_t a, int64_t b, int64_t file_off, const std::vector<std::tuple<int64_t, int64_t, int64_t, DType, int64_t>>& packs,
         py::buffer stop) {
        py::buffer_info bi = raw.request(true);
        py::buffer_info si = stop.request();
        const int64_t size = (int64_t)(bi.size * bi.itemsize);
        if (a < 0 || b < a || b > size || file_off < 0)
          throw std::invalid_argument("[read_pack] range [" + std::to_string(a) + ", " + std::to_string(b) +
                                      ") does not fit the " + std::to_string(size) + "-byte buffer");
        if (si.size * si.itemsize < 1) throw std::invalid_argument("[read_pack] stop must hold a byte");
        int64_t prev_end = 0;
        for (const auto& [s, e, cb, t, ncols] : packs) {
          if (s < prev_end || e > size || e < s || cb <= 0 || (e - s) % cb != 0 || !packable(t) || ncols <= 0 ||
              ncols % dtype_block_size(t) != 0 || dtype_row_size(t, ncols) * 16 != (size_t)cb)
            throw std::invalid_argument("[read_pack] bad packed tensor [" + std::to_string(s) + ", " + std::to_string(e) + ")");
          if (e > a && s < b && ((std::max(a, s) - s) % cb != 0 || (std::min(b, e) - s) % cb != 0))
            throw std::invalid_argument("[read_pack] the range cuts a 16-row chunk of the packed tensor at " +
                                        std::to_string(s));
          prev_end = e;
        }
        uint8_t* p = static_cast<uint8_t*>(bi.ptr);
        const volatile uint8_t* stop_flag = static_cast<const volatile uint8_t*>(si.ptr);
        std::string err;
        bool stopped = false, short_file = false;
        {
          py::gil_scoped_release nogil;
          // [x, y) of the buffer from the file; false when the file ends first or a read fails
          auto read = [&](int64_t x, int64_t y) {
            while (x < y) {
              if (*stop_flag) {
                stopped = true;
                return false;
              }
              const size_t n = (size_t)std::min<int64_t>(y - x, int64_t(64) << 20);
              const ssize_t got = ::pread(fd, p + x, n, (off_t)(file_off + x));
              if (got < 0 && errno == EINTR) continue;
              if (got < 0) {
                err = std::strerror(errno);
                return false;
              }
              if (got == 0) {
                short_file = true;
                err = std::to_string(file_off + x);
                return false;
              }
              x += got;
            }
            return true;
          };
          std::vector<uint8_t> rows;
          bool ok = true;
          for (const auto& [s, e, cb, t, ncols] : packs) {
            if (!ok || e <= a || s >= b) continue;
            if (!(ok = read(a, std::max(a, s)))) break;  // the bytes before this tensor
            // slabs of about 4 MiB (whole 16-row chunks), each packed right after it is read,
            // while its bytes are still in cache; a chunk's packed bytes take its rows' place
            const int64_t slab = std::max<int64_t>(1, (int64_t(4) << 20) / cb) * cb;
            a = std::max(a, s);
            while (a < std::min(e, b)) {
              const int64_t z = std::min({a + slab, e, b});
              if (!(ok = read(a, z))) break;
              pack_chunks(t, p + s, (size_t)cb, ncols, (a - s) / cb, (z - s) / cb, rows);
              a = z;
            }
          }
          if (ok) read(a, b);
        }
        if (stopped) throw std::runtime_error("pyfast is exiting: the weights were not read");
        if (short_file) throw std::invalid_argument("file ended at byte " + err + " while reading tensor data");
        if (!err.empty()) throw std::runtime_error("[read_pack] reading the file failed: " + err);
      },
      py::arg("fd"), py::arg("raw"), py::arg("a"), py::arg("b"), py::arg("file_offset"), py::arg("packs"),
      py::arg("stop"),
      "Read bytes [a, b) of the writable buffer raw from the open file fd at file_offset + a, packing\n"
      "the parts of packs ((start, end, chunk bytes, dtype, n_cols) in order, not overlapping, buffer\n"
      "offsets; chunks whole within [a, b)) into the x16 layout slab by slab as they arrive. Stops\n"
      "with RuntimeError once stop[0] is non-zero (checked between reads of at most 64 MiB or one\n"
      "slab). Releases the GIL for the whole read, so model loading does not wait on Python threads.");
#endif

  m.def(
      "unpack_x16",
      [](DType t, py::buffer raw, int64_t nrows, int64_t ncols) {
        py::buffer_info bi = raw.request();
        x16_bytes("unpack_x16", t, bi, nrows, ncols);
        const size_t rb = dtype_row_size(t, ncols);
        py::array_t<uint8_t> out({(py::ssize_t)nrows, (py::ssize_t)rb});
        const uint8_t* s = static_cast<const uint8_t*>(bi.ptr);
        uint8_t* d = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          for (int64_t c = 0; c < nrows / 16; ++c) unpack_x16(t, s + c * 16 * rb, ncols, 0, 16, d + c * 16 * rb);
        }
        return out;
      },
      py::arg("dtype"), py::arg("raw"), py::arg("n_rows"), py::arg("n_cols"),
      "The row-major copy (uint8 [n_rows, row_bytes]) of a weight in the packed x16 layout.");

  m.def("avx2_use_vnni", [](bool on) { mm::avx2_use_vnni(on); }, py::arg("on"),
        "Whether the avx2 matmul path uses AVX-VNNI (when the CPU has it) or the maddubs variant\n"
        "(tests cover both; results are identical).");
  m.def("avx2_uses_vnni", [] { return mm::avx2_uses_vnni(); }, "Whether the avx2 path uses AVX-VNNI now.");
}

}  // namespace pyfast_py
