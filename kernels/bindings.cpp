// The Python module: the entry points of ops.h, with plans as dicts.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace {

pybind11::dict as_dict(const groupnorm::PlanFields& fields) {
  pybind11::dict out;
  for (const auto& [name, value] : fields) {
    std::visit([&](const auto& v) { out[pybind11::str(name)] = pybind11::cast(v); }, value);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "GroupNorm forward: [y, mean, rstd]");
  m.def("forward_fused", &forward_fused,
        "GroupNorm forward with its prologue (add) and epilogue (scale, shift, activations, "
        "residual, before the activations with residual_first): [y, mean, rstd]",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("groups"), pybind11::arg("eps"),
        pybind11::arg("kernel"), pybind11::arg("team"), pybind11::arg("lag"), pybind11::arg("scale"), pybind11::arg("shift"),
        pybind11::arg("residual"), pybind11::arg("activations"), pybind11::arg("slope"),
        pybind11::arg("add") = pybind11::none(), pybind11::arg("residual_first") = false);
  m.def("backward", &backward, "GroupNorm backward: [dx, dweight, dbias]");
  m.def("backward_fused", &backward_fused,
        "The backward of forward_fused without its residual: [dx, dweight, dbias, dscale, dshift, "
        "dadd]; kernel forces the passes or the registers kernel",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("mean"), pybind11::arg("rstd"),
        pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("groups"),
        pybind11::arg("scale"), pybind11::arg("shift"), pybind11::arg("activations"),
        pybind11::arg("slope"), pybind11::arg("add"), pybind11::arg("need_dx"),
        pybind11::arg("need_affine"), pybind11::arg("need_scale"), pybind11::arg("need_shift"),
        pybind11::arg("need_add"), pybind11::arg("kernel") = "auto");
  m.def("register_kernels", &register_kernels,
        "Registers the CUDA and autograd kernels of <namespace>::forward, ::backward, "
        "::forward_fused and ::backward_fused");
  m.def(
      "plan",
      [](const at::Tensor& x, int64_t groups, const std::string& kernel, int64_t team,
         int64_t lag, bool epilogue, const std::vector<int64_t>& activations) {
        return as_dict(forward_plan(x, groups, kernel, team, lag, epilogue, activations));
      },
      "The forward's plan for x (with an epilogue, or an activation chain's codes), as a dict",
      pybind11::arg("x"), pybind11::arg("groups"), pybind11::arg("kernel"), pybind11::arg("team"),
      pybind11::arg("lag"), pybind11::arg("epilogue") = false,
      pybind11::arg("activations") = std::vector<int64_t>{});
  m.def(
      "backward_plan",
      [](const at::Tensor& x, int64_t groups, const std::string& kernel, int64_t lag, bool epilogue,
         const std::vector<int64_t>& activations) {
        return as_dict(backward_plan(x, groups, kernel, lag, epilogue, activations));
      },
      "The backward's plan for x (the fused backward's, with an epilogue or an activation "
      "chain's codes), as a dict",
      pybind11::arg("x"), pybind11::arg("groups"), pybind11::arg("kernel"), pybind11::arg("lag"),
      pybind11::arg("epilogue") = false, pybind11::arg("activations") = std::vector<int64_t>{});
}
