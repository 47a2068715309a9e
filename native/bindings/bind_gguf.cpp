// Python face of the GGUF reader: _native.GGUFFile, _native.GGUFTensorInfo, _native.GGUFError.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "pyfast/gguf.h"

namespace py = pybind11;
using pyfast::GGUFFile;
using pyfast::GGUFTensorInfo;
using pyfast::GGUFValue;
using pyfast::GGUFValueType;

namespace {

// Strings from the file are UTF-8; invalid bytes (possible in byte-level vocabularies) are kept
// losslessly as surrogates: s.encode("utf-8", "surrogateescape") gives the original bytes back.
PyObject* str_to_py(std::string_view s) {
  return PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "surrogateescape");
}

PyObject* scalar_to_py(const GGUFValue& v) {
  switch (v.type) {
    case GGUFValueType::BOOL: return PyBool_FromLong(v.bits != 0);
    case GGUFValueType::FLOAT32:
    case GGUFValueType::FLOAT64: return PyFloat_FromDouble(v.as_float());
    case GGUFValueType::UINT64: return PyLong_FromUnsignedLongLong(v.bits);
    default: return PyLong_FromLongLong(v.as_int());
  }
}

// New reference, or nullptr with a Python error set.
PyObject* value_to_py(const GGUFValue& v) {
  if (v.type == GGUFValueType::STRING) return str_to_py(v.str);
  if (v.type != GGUFValueType::ARRAY) return scalar_to_py(v);
  const Py_ssize_t n = (Py_ssize_t)v.count;
  PyObject* list = PyList_New(n);
  if (!list) return nullptr;
  const size_t esz = pyfast::gguf_value_type_size(v.elem_type);
  GGUFValue e;
  e.type = v.elem_type;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* item;
    if (esz) {
      e.bits = 0;
      std::memcpy(&e.bits, v.data + (size_t)i * esz, esz);
      item = scalar_to_py(e);
    } else if (v.elem_type == GGUFValueType::STRING) {
      item = str_to_py(v.strings[(size_t)i]);
    } else {
      item = value_to_py(v.items[(size_t)i]);
    }
    if (!item) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, item);
  }
  return list;
}

// The inverse of str_to_py: a str (or bytes) name back to the file's bytes.
std::string name_from_py(const py::handle& o) {
  if (PyBytes_Check(o.ptr())) return py::cast<std::string>(o);
  if (!PyUnicode_Check(o.ptr())) throw py::type_error("tensor name must be str or bytes");
  py::object b = py::reinterpret_steal<py::object>(
      PyUnicode_AsEncodedString(o.ptr(), "utf-8", "surrogateescape"));
  if (!b) throw py::error_already_set();
  return py::cast<std::string>(b);
}

py::object to_py(const GGUFValue& v) {
  PyObject* o = value_to_py(v);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

std::string type_str(const GGUFValue& v) {
  if (!v.is_array()) return pyfast::gguf_value_type_name(v.type);
  std::string inner;
  if (v.elem_type == GGUFValueType::ARRAY)
    inner = v.count ? type_str(v.items[0]) : "array";
  else
    inner = pyfast::gguf_value_type_name(v.elem_type);
  return "array[" + inner + "]";
}

// The Python object: the parsed file plus cached Python views of it. close() drops this
// object's reference; arrays from tensor_data() hold their own and keep the mapping alive.
struct PyGGUFFile {
  std::string path;
  std::shared_ptr<const GGUFFile> file;
  py::object metadata, metadata_types, tensors;  // caches, built on first use

  const GGUFFile& get() const {
    if (!file) throw py::value_error(path + ": GGUF file is closed");
    return *file;
  }
};

py::str name_to_py(const GGUFTensorInfo& t) {
  PyObject* o = str_to_py(t.name);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

void close_file(PyGGUFFile& s) {
  s.file.reset();
  s.metadata = py::object();
  s.metadata_types = py::object();
  s.tensors = py::object();
}

py::tuple shape_tuple(const GGUFTensorInfo& t) {
  py::tuple s(t.shape.size());
  for (size_t i = 0; i < t.shape.size(); i++) s[i] = py::int_(t.shape[i]);
  return s;
}

std::string tensor_repr(const GGUFTensorInfo& t) {
  std::string shape;
  for (size_t i = 0; i < t.shape.size(); i++) shape += (i ? ", " : "") + std::to_string(t.shape[i]);
  if (t.shape.size() == 1) shape += ",";
  return "GGUFTensorInfo(name=" + py::repr(name_to_py(t)).cast<std::string>() + ", type=" + t.dtype->name + ", shape=(" + shape +
         "), offset=" + std::to_string(t.offset) + ", nbytes=" + std::to_string(t.nbytes) + ")";
}

}  // namespace

namespace pyfast_py {

void bind_gguf(py::module_& m) {
  py::register_exception<pyfast::GGUFError>(m, "GGUFError", PyExc_ValueError);
  // Open failures become the matching OSError subclass (FileNotFoundError, PermissionError, ...).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pyfast::GGUFOpenError& e) {
      const std::string msg = std::string(e.what()).substr(e.path().size() + 2);
      py::object err = py::module_::import("builtins")
                           .attr("OSError")(e.error_number(), msg, e.path());
      PyErr_SetObject((PyObject*)Py_TYPE(err.ptr()), err.ptr());
    }
  });

  py::class_<GGUFTensorInfo>(m, "GGUFTensorInfo", "One entry of a GGUF file's tensor index.")
      .def_property_readonly("name", &name_to_py)
      .def_readonly("type", &GGUFTensorInfo::type, "Raw ggml type id (== pyfast DType value).")
      .def_property_readonly("type_name", [](const GGUFTensorInfo& t) { return std::string(t.dtype->name); },
                             "Type name, e.g. 'F32', 'Q8_0'.")
      .def_property_readonly("shape", &shape_tuple, "Shape, outermost dimension first (numpy order).")
      .def_readonly("n_elements", &GGUFTensorInfo::n_elements)
      .def_readonly("offset", &GGUFTensorInfo::offset, "Absolute file offset of the tensor's data.")
      .def_readonly("nbytes", &GGUFTensorInfo::nbytes)
      .def("__repr__", &tensor_repr);

  py::class_<PyGGUFFile>(m, "GGUFFile",
                         "A GGUF file, memory-mapped read-only and parsed natively.\n\n"
                         "GGUFFile(path) raises GGUFError (a ValueError) for a malformed file and\n"
                         "OSError for one that cannot be opened.")
      .def(py::init([](const py::object& path) {
             py::module_ os = py::module_::import("os");
             std::string p_str = py::cast<std::string>(os.attr("fsdecode")(path));
             std::string p_bytes = py::cast<std::string>(os.attr("fsencode")(path));
             std::shared_ptr<const GGUFFile> f;
             {
               py::gil_scoped_release nogil;
               f = std::make_shared<GGUFFile>(p_bytes);
             }
             PyGGUFFile r;
             r.path = p_str;
             r.file = std::move(f);
             return r;
           }),
           py::arg("path"), "Open and parse the GGUF file at `path` (str or os.PathLike).")
      .def_readonly("path", &PyGGUFFile::path)
      .def_property_readonly("closed", [](const PyGGUFFile& s) { return !s.file; })
      .def_property_readonly("version", [](const PyGGUFFile& s) { return s.get().version(); })
      .def_property_readonly("alignment", [](const PyGGUFFile& s) { return s.get().alignment(); })
      .def_property_readonly("data_offset", [](const PyGGUFFile& s) { return s.get().data_offset(); },
                             "Absolute file offset where the tensor data section starts.")
      .def_property_readonly("file_size", [](const PyGGUFFile& s) { return s.get().file_size(); })
      .def("prefetch", [](PyGGUFFile& s, std::vector<std::pair<uint64_t, uint64_t>> ranges) { s.get().prefetch(std::move(ranges)); },
           py::arg("ranges") = std::vector<std::pair<uint64_t, uint64_t>>{},
           "Start mapping the tensor data (or only `ranges`: (absolute file offset, bytes) pairs) into\n"
           "memory on a background thread (returns at once; once per file).")
      .def_property_readonly(
          "metadata",
          [](PyGGUFFile& s) -> py::object {
            const GGUFFile& f = s.get();
            if (!s.metadata) {
              py::dict d;
              for (const auto& kv : f.metadata()) {
                py::object key = py::reinterpret_steal<py::object>(str_to_py(kv.first));
                if (!key) throw py::error_already_set();
                d[key] = to_py(kv.second);
              }
              s.metadata = std::move(d);
            }
            return s.metadata;
          },
          "dict key -> int | float | bool | str | list (arrays, possibly nested), in file order.\n"
          "Built once and cached; the same dict object is returned each time.")
      .def_property_readonly(
          "metadata_types",
          [](PyGGUFFile& s) -> py::object {
            const GGUFFile& f = s.get();
            if (!s.metadata_types) {
              py::dict d;
              for (const auto& kv : f.metadata()) {
                py::object key = py::reinterpret_steal<py::object>(str_to_py(kv.first));
                if (!key) throw py::error_already_set();
                d[key] = py::str(type_str(kv.second));
              }
              s.metadata_types = std::move(d);
            }
            return s.metadata_types;
          },
          "dict key -> GGUF value type name ('uint32', 'string', 'array[float32]', ...).")
      .def_property_readonly(
          "tensors",
          [](PyGGUFFile& s) -> py::object {
            const GGUFFile& f = s.get();
            if (!s.tensors) {
              py::list l;
              for (const auto& t : f.tensors()) l.append(py::cast(t));
              s.tensors = std::move(l);
            }
            return s.tensors;
          },
          "list of GGUFTensorInfo in file order.")
      .def(
          "tensor_data",
          [](PyGGUFFile& s, const py::object& name_obj) {
            const GGUFFile& f = s.get();
            const std::string name = name_from_py(name_obj);
            const GGUFTensorInfo* t = f.find_tensor(name);
            if (!t) throw py::key_error(s.path + ": no tensor named " + py::repr(name_obj).cast<std::string>());
            // The capsule owns a reference to the file, so the mapping outlives close() and the
            // GGUFFile object for as long as the array (or any view of it) exists.
            auto* keep = new std::shared_ptr<const GGUFFile>(s.file);
            py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<const GGUFFile>*>(p); });
            py::array a(py::dtype::of<uint8_t>(), {(py::ssize_t)t->nbytes}, {(py::ssize_t)1},
                        f.tensor_data(*t), base);
            a.attr("setflags")(py::arg("write") = false);  // the mapping is PROT_READ
            return a;
          },
          py::arg("name"),
          "The tensor's raw bytes as a read-only, zero-copy numpy uint8 array over the mapping.")
      .def("close", &close_file,
           "Drop this object's reference to the mapping; arrays from tensor_data() stay valid.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyGGUFFile& s, py::args) { close_file(s); })
      .def("__repr__", [](const PyGGUFFile& s) {
        if (!s.file) return "<GGUFFile '" + s.path + "' (closed)>";
        return "<GGUFFile '" + s.path + "' v" + std::to_string(s.file->version()) + ", " +
               std::to_string(s.file->metadata().size()) + " metadata keys, " +
               std::to_string(s.file->tensors().size()) + " tensors>";
      });
}

}  // namespace pyfast_py
