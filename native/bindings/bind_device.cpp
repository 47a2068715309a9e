// Devices: listing what is there and opening one (the backend interface, pyfast/backend.h).
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "pyfast/backend.h"

namespace py = pybind11;
using namespace pyfast;

namespace pyfast_py {

py::dict device_dict(const DeviceInfo& d) {
  py::dict o;
  o["name"] = d.name;
  o["kind"] = d.kind;
  o["index"] = d.index;
  o["description"] = d.description;
  o["memory_bytes"] = d.memory_bytes;
  o["max_buffer_range"] = d.max_buffer_range;
  o["integer_dot"] = d.integer_dot;
  return o;
}

void bind_device(py::module_& m) {
  m.def("devices", [] {
    py::list out;
    for (const DeviceInfo& d : list_devices()) out.append(device_dict(d));
    return out;
  }, "Every device: the CPU first, then each compiled-in backend's (dicts: name, kind, index, description, "
     "memory_bytes, max_buffer_range).");
  m.def("backends", [] {
    py::list out;
    for (const BackendFactory& f : backend_factories()) {
      py::dict d;
      d["kind"] = f.kind;
      d["unavailable"] = f.unavailable;
      out.append(d);
    }
    return out;
  }, "The backend kinds this build knows, and why one cannot have devices (empty when it can).");

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Device", "An opened non-CPU device (see open_device).")
      .def_property_readonly("info", [](const Backend& b) { return device_dict(b.info()); })
      .def_property_readonly("name", [](const Backend& b) { return b.info().name; })
      .def("__repr__", [](const Backend& b) { return "<Device " + b.info().name + " (" + b.info().description + ")>"; });
  m.def("open_device", [](const std::string& name) -> py::object {
    std::shared_ptr<Backend> b = open_device(name);
    if (!b) return py::none();
    return py::cast(b);
  }, py::arg("name"),
     "Open a device by name ('vulkan:0'); None for 'cpu'. Raises ValueError for an unknown kind or index "
     "and RuntimeError when the driver cannot open it.");
}

}  // namespace pyfast_py
