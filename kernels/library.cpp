// The kernels of the operators <ns>::forward, ::backward and ::forward_fused
// (the forward with the epilogue of epilogue.cuh; forward only), registered
// with torch's dispatcher from C++: the CUDA entry points of ops.cpp and
// their autograd. Eager calls, torch.compile'd graphs and torch.export'd
// programs all reach these, so there is one autograd, and a call costs the
// dispatcher's few microseconds instead of a Python custom op's tens.
// The schemas and fake (meta) functions are defined from Python
// (groupnorm_inline.py), which chooses the namespace: they are needed to
// trace before this library is built.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <memory>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using ForwardOp = Outputs(const at::Tensor&, const c10::optional<at::Tensor>&,
                          const c10::optional<at::Tensor>&, int64_t, double);
using BackwardOp = Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const c10::optional<at::Tensor>&, int64_t, bool,
                           bool);
using ForwardFusedOp = Outputs(const at::Tensor&, const c10::optional<at::Tensor>&,
                               const c10::optional<at::Tensor>&, int64_t, double,
                               const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                               const c10::optional<at::Tensor>&, c10::IntArrayRef, double);

struct Operators {
  c10::TypedOperatorHandle<ForwardOp> forward;
  c10::TypedOperatorHandle<BackwardOp> backward;
  c10::TypedOperatorHandle<ForwardFusedOp> forward_fused;
};

// Set once by register_kernels, before any kernel below can run.
const Operators* operators = nullptr;

Outputs as_tuple(std::vector<at::Tensor> t) {
  return {std::move(t[0]), std::move(t[1]), std::move(t[2])};
}

Outputs forward_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                     const c10::optional<at::Tensor>& bias, int64_t groups, double eps) {
  return as_tuple(::forward(x, weight, bias, groups, eps, "auto", 0, 0));
}

Outputs backward_cuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                      const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                      int64_t groups, bool need_dx, bool need_affine) {
  return as_tuple(::backward(dy, x, mean, rstd, weight, groups, need_dx, need_affine, "auto", 0));
}

Outputs forward_fused_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                           const c10::optional<at::Tensor>& scale,
                           const c10::optional<at::Tensor>& shift,
                           const c10::optional<at::Tensor>& residual,
                           c10::IntArrayRef activations, double slope) {
  return as_tuple(::forward_fused(x, weight, bias, groups, eps, "auto", 0, 0, scale, shift,
                                  residual, activations.vec(), slope));
}

const char* const kNoDoubleBackward =
    "groupnorm_inline: double backward (gradients of gradients) is not supported; use torch's "
    "own group_norm for that";

// y of the forward op, with mean and rstd ([N, G], no gradient) saved for
// the backward op beside x and weight. Both ops are called through the
// dispatcher, below autograd, so that torch.compile traces them as ops.
// Autograd makes an input edge only for each defined tensor argument:
// needs_input_grad takes that edge's index, so absent weight/bias shift it.
class GroupNormFunction : public torch::autograd::Function<GroupNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x,
                                                const c10::optional<at::Tensor>& weight,
                                                const c10::optional<at::Tensor>& bias,
                                                int64_t groups, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, mean, rstd] = operators->forward.call(x, weight, bias, groups, eps);
    const bool has_weight = weight.has_value() && weight->defined();
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->save_for_backward({x, has_weight ? *weight : at::Tensor(), mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["weight_edge"] = int64_t(has_weight ? 1 : -1);
    ctx->saved_data["bias_edge"] = int64_t(has_bias ? 1 + int(has_weight) : -1);
    return {y, mean, rstd};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const auto needs = [&](const char* edge) {
      const int64_t index = ctx->saved_data[edge].toInt();
      return index >= 0 && ctx->needs_input_grad(size_t(index));
    };
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_weight = needs("weight_edge"), need_bias = needs("bias_edge");
    auto [dx, dweight, dbias] = operators->backward.call(
        grads[0], saved[0], saved[2], saved[3],
        weight.defined() ? c10::optional<at::Tensor>(weight) : c10::nullopt,
        ctx->saved_data["groups"].toInt(), need_dx, need_weight || need_bias);
    return {need_dx ? dx : at::Tensor(), need_weight ? dweight : at::Tensor(),
            need_bias ? dbias : at::Tensor(), at::Tensor() /* groups */, at::Tensor() /* eps */};
  }
};

// The backward op's autograd: with create_graph=True its gradients are
// handed on behind a node that raises if anything differentiates through
// them (as Python's once_differentiable does), instead of silently having
// no gradient.
Outputs backward_autograd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                          const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                          int64_t groups, bool need_dx, bool need_affine) {
  Outputs grads;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    grads = operators->backward.call(dy, x, mean, rstd, weight, groups, need_dx, need_affine);
  }
  const bool differentiable = dy.requires_grad() || x.requires_grad() ||
                              (weight.has_value() && weight->requires_grad());
  if (!at::GradMode::is_enabled() || !differentiable) return grads;
  auto error = std::make_shared<torch::autograd::DelayedError>(kNoDoubleBackward, 3);
  torch::autograd::variable_list inputs;
  for (const at::Tensor* t : {&std::get<0>(grads), &std::get<1>(grads), &std::get<2>(grads)}) {
    inputs.push_back(t->defined() ? t->detach().requires_grad_(true) : at::Tensor());
  }
  return as_tuple(error->apply(std::move(inputs)));
}

Outputs forward_autograd(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                         const c10::optional<at::Tensor>& bias, int64_t groups, double eps) {
  return as_tuple(GroupNormFunction::apply(x, weight, bias, groups, eps));
}

// The fused forward has no backward yet: with gradients wanted it refuses
// (also while torch.compile traces a training graph), instead of returning
// outputs that silently have none.
Outputs forward_fused_autograd(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                               const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                               const c10::optional<at::Tensor>& scale,
                               const c10::optional<at::Tensor>& shift,
                               const c10::optional<at::Tensor>& residual,
                               c10::IntArrayRef activations, double slope) {
  bool wanted = x.requires_grad();
  for (const auto* t : {&weight, &bias, &scale, &shift, &residual}) {
    wanted = wanted || (t->has_value() && (*t)->defined() && (*t)->requires_grad());
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(wanted && at::GradMode::is_enabled()),
      "groupnorm_inline: the fused backward of scale, shift, activation and residual is not "
      "implemented yet; run the fused forward without gradients (torch.no_grad(), or tensors "
      "that do not require grad), or apply these ops after group_norm");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return operators->forward_fused.call(x, weight, bias, groups, eps, scale, shift, residual,
                                       activations, slope);
}

}  // namespace

void register_kernels(const std::string& ns) {
  TORCH_CHECK(operators == nullptr, "groupnorm_inline: the kernels are registered already");
  auto& dispatcher = c10::Dispatcher::singleton();
  operators = new Operators{
      dispatcher.findSchemaOrThrow((ns + "::forward").c_str(), "").typed<ForwardOp>(),
      dispatcher.findSchemaOrThrow((ns + "::backward").c_str(), "").typed<BackwardOp>(),
      dispatcher.findSchemaOrThrow((ns + "::forward_fused").c_str(), "")
          .typed<ForwardFusedOp>()};
  // The registrations last as long as the process, as TORCH_LIBRARY_IMPL's do.
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                                       c10::DispatchKey::CUDA, __FILE__, __LINE__));
  libraries.back()->impl("forward", TORCH_FN(forward_cuda));
  libraries.back()->impl("backward", TORCH_FN(backward_cuda));
  libraries.back()->impl("forward_fused", TORCH_FN(forward_fused_cuda));
  libraries.push_back(std::make_unique<torch::Library>(
      torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__));
  libraries.back()->impl("forward", TORCH_FN(forward_autograd));
  libraries.back()->impl("backward", TORCH_FN(backward_autograd));
  libraries.back()->impl("forward_fused", TORCH_FN(forward_fused_autograd));
}
