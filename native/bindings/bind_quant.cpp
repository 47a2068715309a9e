// Whole-tensor quantization and dequantization (pyfast quantize, tests).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/bindings.h"
#include "cpu/quant/quant.h"
#include "pyfast/cpu.h"

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
            std::vector<uint8_t> rows(cb);
            for (int64_t c = c0; c < c1; ++c) {
              std::memcpy(rows.data(), p + c * cb, cb);
              pack_x16(t, rows.data(), p + c * cb, 16, ncols);
            }
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
