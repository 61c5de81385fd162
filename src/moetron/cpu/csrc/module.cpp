// The extension module: every kernel of kernels.h. They touch only tensors and vectors once the arguments are
// converted, so the GIL is released while they run.
#include "kernels.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("swiglu_forward", &moetron_cpu::swiglu_forward, no_gil);
  m.def("swiglu_backward", &moetron_cpu::swiglu_backward, no_gil);
  m.def("first_max_column", &moetron_cpu::first_max_column, no_gil);
  m.def("softmax_gradient_rows", &moetron_cpu::softmax_gradient_rows, no_gil);
  m.def("fused_head_forward", &moetron_cpu::fused_head_forward, no_gil);
  m.def("transpose_scaled", &moetron_cpu::transpose_scaled, no_gil);
  m.def("add_rows", &moetron_cpu::add_rows, no_gil);
}
