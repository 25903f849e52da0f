/// The extension module distributed_shampoo_cpp._C: the Engine (python/src/engine.h) and what the
/// package checks at import. Errors thrown by the library (c10::Error) arrive as Python
/// exceptions with the library's message, and its warnings (TORCH_WARN) as Python warnings
/// (torch::wrap_pybind_function).

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include "python/src/engine.h"
#include "shampoo/config.h"

namespace py = pybind11;
using shampoo::python::Engine;
using shampoo::python::GroupSpec;

namespace {

std::vector<GroupSpec> groups_from(const py::list& groups) {
  std::vector<GroupSpec> specs;
  for (const auto& item : groups) {
    const auto pair = item.cast<py::tuple>();
    specs.push_back(GroupSpec{pair[0].cast<std::vector<at::Tensor>>(), pair[1].cast<py::dict>()});
  }
  return specs;
}

void bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init(torch::wrap_pybind_function(
               [](const py::list& groups, const py::dict& distributed,
                  const py::object& process_group) {
                 return std::make_unique<Engine>(groups_from(groups), distributed, process_group);
               })),
           py::arg("groups"), py::arg("distributed"), py::arg("process_group"))
      .def("step", torch::wrap_pybind_function_no_gil([](Engine& e) { e.step(); }))
      .def("set_floats", torch::wrap_pybind_function(&Engine::set_floats))
      .def("add_param_group",
           torch::wrap_pybind_function([](Engine& e, std::vector<at::Tensor> params,
                                          const py::dict& options) {
             e.add_param_group(GroupSpec{std::move(params), options});
           }))
      .def("group_step", torch::wrap_pybind_function(&Engine::group_step))
      .def("num_groups", &Engine::num_groups)
      .def("state_pieces", torch::wrap_pybind_function(&Engine::state_pieces))
      .def("load_state_pieces", torch::wrap_pybind_function(&Engine::load_state_pieces))
      .def("train", torch::wrap_pybind_function(&Engine::train))
      .def("eval", torch::wrap_pybind_function(&Engine::eval))
      .def("is_training", &Engine::is_training)
      .def("stats", &Engine::stats)
      .def("memory_summary", &Engine::memory_summary)
      .def("save_checkpoint", torch::wrap_pybind_function(&Engine::save_checkpoint))
      .def("load_checkpoint", torch::wrap_pybind_function(&Engine::load_checkpoint));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Distributed Shampoo for LibTorch: the C++ engine behind distributed_shampoo_cpp";
  // The torch this module was compiled against; __init__.py compares it with the torch imported.
  m.attr("TORCH_VERSION") = TORCH_VERSION;
  m.attr("WITH_CUDA") = static_cast<bool>(SHAMPOO_WITH_CUDA);
  // NewtonSchulzRootInvConfig's default schedule, the engine's (one list of the numbers).
  m.def("default_newton_schulz_coefficients", [] {
    std::vector<std::vector<double>> out;
    for (const auto& t : shampoo::default_newton_schulz_coefficients()) {
      out.emplace_back(t.begin(), t.end());
    }
    return out;
  });
  bind_engine(m);
}
