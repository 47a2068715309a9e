// Communicators for the allreduce op (pyfast/comm.h); pyfast/parallel/comm.py builds them.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "pyfast/comm.h"

namespace py = pybind11;
using namespace pyfast;

namespace pyfast_py {

namespace {
// A registered communicator; unregistered when the Python object goes away (plans that use it
// must go first: a run after that fails with "no communicator with id").
struct PyComm {
  std::shared_ptr<Communicator> c;
  int id = 0;
  explicit PyComm(std::shared_ptr<Communicator> cc) : c(std::move(cc)), id(comm_register(c)) {}
  ~PyComm() { comm_unregister(id); }
};
}  // namespace

void bind_comm(py::module_& m) {
  py::class_<PyComm, std::shared_ptr<PyComm>>(m, "Communicator",
      "A group of ranks for Graph.allreduce, registered under `id` while this object lives.")
      .def_static("local", [] { return std::make_shared<PyComm>(make_local_comm()); },
                  "One rank: allreduce copies its input.")
      .def_static("mpi", [](uintptr_t fn, uintptr_t comm, uintptr_t dt, uintptr_t op, int rank, int size,
                            uintptr_t reduce_fn) {
        return std::make_shared<PyComm>(make_mpi_comm(fn, comm, dt, op, rank, size, reduce_fn));
      }, py::arg("allreduce_fn"), py::arg("comm"), py::arg("dtype_float"), py::arg("op_sum"), py::arg("rank"),
         py::arg("size"), py::arg("reduce_fn") = 0,
         "MPI_Allreduce of a loaded MPI library: its address and the handle values of the communicator, "
         "MPI_FLOAT and MPI_SUM (mpi4py: MPI._handleof); reduce_fn: MPI_Reduce's address (root-only sums).")
#if defined(PYFAST_HAVE_NCCL)
      .def_static("nccl", [](const std::string& lib, py::bytes unique_id, int rank, int size, int device) {
        const std::string id = unique_id;
        std::shared_ptr<Communicator> c;
        {
          py::gil_scoped_release rel;  // joining waits for every rank
          c = make_nccl_comm(lib, id, rank, size, device);
        }
        return std::make_shared<PyComm>(std::move(c));
      }, py::arg("lib"), py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device") = 0,
         "NCCL between GPUs: libnccl at `lib` (opened now), the id from nccl_unique_id on rank 0, this rank, "
         "the group size and this rank's CUDA device. Graph.allreduce then runs on the GPU.")
#endif
      .def_property_readonly("on_device", [](const PyComm& p) { return p.c->on_device(); })
      .def_property_readonly("id", [](const PyComm& p) { return p.id; })
      .def_property_readonly("rank", [](const PyComm& p) { return p.c->rank(); })
      .def_property_readonly("size", [](const PyComm& p) { return p.c->size(); })
      .def_property_readonly("kind", [](const PyComm& p) { return p.c->kind(); })
      .def("stats", [](const PyComm& p) {
        py::dict d;
        d["seconds"] = p.c->ns.load() / 1e9;
        d["calls"] = p.c->calls.load();
        d["bytes"] = p.c->bytes.load();
        return d;
      }, "Time (s, wall clock of the calling thread), number and bytes of the allreduce calls so far.")
      .def("reset_stats", [](PyComm& p) { p.c->ns = 0; p.c->calls = 0; p.c->bytes = 0; })
      .def("allreduce", [](PyComm& p, py::array_t<float, py::array::c_style | py::array::forcecast> a) {
        py::array_t<float> out(a.request().shape);
        {
          py::gil_scoped_release rel;
          p.c->allreduce_sum_f32(a.data(), out.mutable_data(), (int64_t)a.size());
        }
        return out;
      }, "The sum of a float32 array over the ranks (outside a graph).");
#if defined(PYFAST_HAVE_NCCL)
  m.attr("has_nccl") = true;
  m.def("nccl_unique_id", [](const std::string& lib) { return py::bytes(nccl_unique_id(lib)); }, py::arg("lib"),
        "A new NCCL unique id (bytes) for Communicator.nccl, made on rank 0 and sent to the others.");
#else
  m.attr("has_nccl") = false;
#endif
}

}  // namespace pyfast_py
