// dtypes, CPU features and ISA selection, host buffers, thread pools, row codecs.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "bindings/bindings.h"
#include "pyfast/cpu.h"
#include "pyfast/threadpool.h"

namespace py = pybind11;
using namespace pyfast;

namespace pyfast_py {

// Host memory owned by Python objects (KV caches, recurrent states); 64-byte aligned, zeroed.
struct HostBuffer {
  explicit HostBuffer(size_t n) : nbytes(n) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) throw std::bad_alloc();
    std::memset(p, 0, n ? n : 64);
    data = static_cast<uint8_t*>(p);
  }
  ~HostBuffer() { std::free(data); }
  uint8_t* data = nullptr;
  size_t nbytes = 0;
};

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
                                                     "Zeroed, 64-byte aligned host memory (KV caches, states).")
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_readonly("nbytes", &HostBuffer::nbytes)
      .def("zero", [](HostBuffer& b) { std::memset(b.data, 0, b.nbytes); })
      .def("copy_from", [](HostBuffer& b, const HostBuffer& o, size_t dst_off, size_t src_off, size_t n) {
        if (dst_off + n > b.nbytes || src_off + n > o.nbytes) throw std::out_of_range("Buffer.copy_from: range out of bounds");
        std::memmove(b.data + dst_off, o.data + src_off, n);
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
