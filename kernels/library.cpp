// The kernels of the operators <ns>::forward, ::backward, ::forward_fused
// (the forward with the epilogue of epilogue.cuh) and ::backward_fused (its
// backward, backward_epilogue.cuh), registered
// with torch's dispatcher from C++: the CUDA entry points of ops.cpp and
// their autograd. Eager calls, torch.compile'd graphs and torch.export'd
// programs all reach these, so there is one autograd, and a call costs the
// dispatcher's few microseconds instead of a Python custom op's tens.
// The schemas and fake (meta) functions are defined from Python
// (groupnorm_inline.py), which chooses the namespace: they are needed to
// trace before this library is built.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <memory>
#include <tuple>
#include <vector>

#include "activation.h"
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
                               const c10::optional<at::Tensor>&, c10::IntArrayRef, double,
                               const c10::optional<at::Tensor>&, bool);

using FusedGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using BackwardFusedOp = FusedGrads(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, int64_t,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, c10::IntArrayRef, double,
    const c10::optional<at::Tensor>&, bool, bool, bool, bool, bool);

struct Operators {
  c10::TypedOperatorHandle<ForwardOp> forward;
  c10::TypedOperatorHandle<BackwardOp> backward;
  c10::TypedOperatorHandle<ForwardFusedOp> forward_fused;
  c10::TypedOperatorHandle<BackwardFusedOp> backward_fused;
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
                           const c10::optional<at::Tensor>& residual, c10::IntArrayRef activations,
                           double slope, const c10::optional<at::Tensor>& add,
                           bool residual_first) {
  return as_tuple(::forward_fused(x, weight, bias, groups, eps, "auto", 0, 0, scale, shift,
                                  residual, activations.vec(), slope, add, residual_first));
}

FusedGrads backward_fused_cuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                               const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                               const c10::optional<at::Tensor>& bias, int64_t groups,
                               const c10::optional<at::Tensor>& scale,
                               const c10::optional<at::Tensor>& shift,
                               c10::IntArrayRef activations, double slope,
                               const c10::optional<at::Tensor>& add, bool need_dx,
                               bool need_affine, bool need_scale, bool need_shift, bool need_add) {
  auto g = ::backward_fused(dy, x, mean, rstd, weight, bias, groups, scale, shift,
                            activations.vec(), slope, add, need_dx, need_affine, need_scale,
                            need_shift, need_add);
  return {g[0], g[1], g[2], g[3], g[4], g[5]};
}

// Below autograd: the fused Function's backward calls it without grad mode
// and guards its results itself.
FusedGrads backward_fused_autograd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    int64_t groups, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
    c10::IntArrayRef activations, double slope, const c10::optional<at::Tensor>& add,
    bool need_dx, bool need_affine, bool need_scale, bool need_shift, bool need_add) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return operators->backward_fused.call(dy, x, mean, rstd, weight, bias, groups, scale, shift,
                                        activations, slope, add, need_dx, need_affine, need_scale,
                                        need_shift, need_add);
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
  const bool differentiable =
      dy.requires_grad() || x.requires_grad() || (weight.has_value() && weight->requires_grad());
  if (!at::GradMode::is_enabled() || !differentiable) return grads;
  auto error = std::make_shared<torch::autograd::DelayedError>(kNoDoubleBackward, 3);
  torch::autograd::variable_list inputs;
  for (const at::Tensor* t : {&std::get<0>(grads), &std::get<1>(grads), &std::get<2>(grads)}) {
    inputs.push_back(t->defined() ? t->detach().requires_grad_(true) : at::Tensor());
  }
  return as_tuple(error->apply(std::move(inputs)));
}

// Whether a call must go through its autograd Function: grad mode on and a
// tensor argument requiring grad, or a forward-mode tangent (which the
// Function refuses). Otherwise (inference, compiled inference graphs) the
// call goes straight to the CUDA kernel: the Function's node and output
// wrapping cost microseconds of host time and would record nothing.
bool needs_autograd(const at::Tensor& t) {
  return t.defined() &&
         ((at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined());
}

bool needs_autograd(const c10::optional<at::Tensor>& t) {
  return t.has_value() && needs_autograd(*t);
}

Outputs forward_autograd(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                         const c10::optional<at::Tensor>& bias, int64_t groups, double eps) {
  if (!needs_autograd(x) && !needs_autograd(weight) && !needs_autograd(bias)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return operators->forward.call(x, weight, bias, groups, eps);
  }
  return as_tuple(GroupNormFunction::apply(x, weight, bias, groups, eps));
}

c10::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

bool defined(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

using groupnorm::Activation;

// An activation's gradient by ATen's derivative formulas: what the backward
// of a residual added before the activations takes the chain back with.
at::Tensor activation_gradient(Activation a, const at::Tensor& g, const at::Tensor& in,
                               const at::Tensor& out, double slope) {
  switch (a) {
    case Activation::SiLU: return at::silu_backward(g, in);
    case Activation::GELU: return at::gelu_backward(g, in);
    case Activation::GELUTanh: return at::gelu_backward(g, in, "tanh");
    case Activation::ReLU: return at::threshold_backward(g, out, 0);
    case Activation::LeakyReLU: return at::leaky_relu_backward(g, in, slope, false);
    case Activation::Tanh: return at::tanh_backward(g, out);
    case Activation::Sigmoid: return at::sigmoid_backward(g, out);
    case Activation::Hardswish: return at::hardswish_backward(g, in);
    case Activation::Mish: return at::mish_backward(g, in);
  }
  TORCH_CHECK(false, "groupnorm: unknown activation");
}

// dy * act'(v) for the chain applied to v, by ATen: its values forward, then
// the gradients back.
at::Tensor chain_gradient(const at::Tensor& dy, const at::Tensor& v,
                          const std::vector<int64_t>& chain, double slope) {
  std::vector<at::Tensor> values{v};
  for (int64_t code : chain) {
    values.push_back(aten_activation(Activation(code), values.back(), slope));
  }
  at::Tensor g = dy;
  for (size_t i = chain.size(); i-- > 0;) {
    g = activation_gradient(Activation(chain[i]), g, values[i], values[i + 1], slope);
  }
  return g;
}

// The fused forward's autograd. Saves what the plain GroupNorm saves (x,
// weight, mean, rstd) and the small tensors (bias, scale, shift, add); no
// full-size activation. The backward operator recomputes the value before
// the activations in its kernels (backward_epilogue.cuh) and returns every
// gradient but the residual's, which is dy. With the residual added before
// the activations (residual_first) the residual is saved too (an input: no
// copy), the forward without the activations recomputes v = z + residual,
// ATen takes the chain back (g = dy * act'(v), the residual's gradient), and
// the backward operator runs on g without an activation. Everything goes
// through the dispatcher, so torch.compile traces it.
class FusedGroupNormFunction : public torch::autograd::Function<FusedGroupNormFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& x,
      const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
      int64_t groups, double eps, const c10::optional<at::Tensor>& scale,
      const c10::optional<at::Tensor>& shift, const c10::optional<at::Tensor>& residual,
      c10::IntArrayRef activations, double slope, const c10::optional<at::Tensor>& add,
      bool residual_first) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, mean, rstd] = operators->forward_fused.call(
        x, weight, bias, groups, eps, scale, shift, residual, activations, slope, add,
        residual_first);
    const auto tensor = [](const c10::optional<at::Tensor>& t) {
      return defined(t) ? *t : at::Tensor();
    };
    // the residual matters to the backward only before a chain
    const bool recompute = residual_first && !activations.empty();
    ctx->save_for_backward({x, tensor(weight), tensor(bias), tensor(scale), tensor(shift), mean,
                            rstd, tensor(add), recompute ? tensor(residual) : at::Tensor()});
    ctx->mark_non_differentiable({mean, rstd});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["activations"] = activations.vec();
    ctx->saved_data["slope"] = slope;
    ctx->saved_data["recompute"] = recompute;
    // autograd makes an input edge for each defined tensor argument only
    int64_t edge = 1;
    for (const auto& [name, t] :
         {std::pair{"weight", &weight}, std::pair{"bias", &bias}, std::pair{"scale", &scale},
          std::pair{"shift", &shift}, std::pair{"residual", &residual}, std::pair{"add", &add}}) {
      ctx->saved_data[name] = defined(*t) ? edge++ : int64_t(-1);
    }
    return {y, mean, rstd};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2], &scale = saved[3],
                     &shift = saved[4], &mean = saved[5], &rstd = saved[6], &add = saved[7],
                     &residual = saved[8];
    const auto needs = [&](const char* name) {
      const int64_t index = ctx->saved_data[name].toInt();
      return index >= 0 && ctx->needs_input_grad(size_t(index));
    };
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const double slope = ctx->saved_data["slope"].toDouble();
    std::vector<int64_t> chain = ctx->saved_data["activations"].toIntVector();
    const bool grad_mode = at::GradMode::is_enabled();  // create_graph
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_weight = needs("weight"), need_bias = needs("bias");
    const bool need_scale = needs("scale"), need_shift = needs("shift"), need_add = needs("add");
    const bool need_residual = needs("residual");
    at::Tensor dy = grads[0];
    at::Tensor dx, dweight, dbias, dscale, dshift, dadd;
    if (ctx->saved_data["recompute"].toBool()) {
      at::NoGradGuard no_grad;
      const double eps = ctx->saved_data["eps"].toDouble();
      const at::Tensor v = std::get<0>(operators->forward_fused.call(
          input, optional_of(weight), optional_of(bias), groups, eps, optional_of(scale),
          optional_of(shift), residual, {}, slope, optional_of(add), false));
      dy = chain_gradient(dy, v, chain, slope);  // also the residual's gradient
      chain.clear();
    }
    if (need_dx || need_weight || need_bias || need_scale || need_shift || need_add) {
      at::NoGradGuard no_grad;
      std::tie(dx, dweight, dbias, dscale, dshift, dadd) = operators->backward_fused.call(
          dy, input, mean, rstd, optional_of(weight), optional_of(bias), groups,
          optional_of(scale), optional_of(shift), chain, slope, optional_of(add), need_dx,
          need_weight || need_bias, need_scale, need_shift, need_add);
      // in the shape scale, shift and add came in: [N, C], or [N, C, 1, ...] from a graph;
      // unsqueezed, not reshaped to sizes, which torch.compile would fix as constants
      const auto unsqueezed = [](at::Tensor t, int64_t dims) {
        while (t.dim() < dims) t = t.unsqueeze(-1);
        return t;
      };
      if (need_scale) dscale = unsqueezed(dscale, scale.dim());
      if (need_shift) dshift = unsqueezed(dshift, shift.dim());
      if (need_add) dadd = unsqueezed(dadd, add.dim());
    }
    torch::autograd::variable_list out{need_dx ? dx : at::Tensor(),
                                       need_weight ? dweight : at::Tensor(),
                                       need_bias ? dbias : at::Tensor(),
                                       at::Tensor() /* groups */,
                                       at::Tensor() /* eps */,
                                       need_scale ? dscale : at::Tensor(),
                                       need_shift ? dshift : at::Tensor(),
                                       need_residual ? dy : at::Tensor(),
                                       at::Tensor() /* activations */,
                                       at::Tensor() /* slope */,
                                       need_add ? dadd : at::Tensor(),
                                       at::Tensor() /* residual_first */};
    if (!grad_mode) return out;
    // create_graph: gradients of these gradients are refused when asked for
    for (at::Tensor& t : out) {
      if (!t.defined()) continue;
      auto error = std::make_shared<torch::autograd::DelayedError>(kNoDoubleBackward, 1);
      t = error->apply({t.detach().requires_grad_(true)})[0];
    }
    return out;
  }
};

Outputs forward_fused_autograd(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                               const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                               const c10::optional<at::Tensor>& scale,
                               const c10::optional<at::Tensor>& shift,
                               const c10::optional<at::Tensor>& residual,
                               c10::IntArrayRef activations, double slope,
                               const c10::optional<at::Tensor>& add, bool residual_first) {
  if (!needs_autograd(x) && !needs_autograd(weight) && !needs_autograd(bias) &&
      !needs_autograd(scale) && !needs_autograd(shift) && !needs_autograd(residual) &&
      !needs_autograd(add)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return operators->forward_fused.call(x, weight, bias, groups, eps, scale, shift, residual,
                                         activations, slope, add, residual_first);
  }
  return as_tuple(FusedGroupNormFunction::apply(x, weight, bias, groups, eps, scale, shift,
                                                residual, activations, slope, add, residual_first));
}

}  // namespace

void register_kernels(const std::string& ns) {
  TORCH_CHECK(operators == nullptr, "groupnorm_inline: the kernels are registered already");
  auto& dispatcher = c10::Dispatcher::singleton();
  operators = new Operators{
      dispatcher.findSchemaOrThrow((ns + "::forward").c_str(), "").typed<ForwardOp>(),
      dispatcher.findSchemaOrThrow((ns + "::backward").c_str(), "").typed<BackwardOp>(),
      dispatcher.findSchemaOrThrow((ns + "::forward_fused").c_str(), "").typed<ForwardFusedOp>(),
      dispatcher.findSchemaOrThrow((ns + "::backward_fused").c_str(), "")
          .typed<BackwardFusedOp>()};
  // The registrations last as long as the process, as TORCH_LIBRARY_IMPL's do.
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                                       c10::DispatchKey::CUDA, __FILE__, __LINE__));
  libraries.back()->impl("forward", TORCH_FN(forward_cuda));
  libraries.back()->impl("backward", TORCH_FN(backward_cuda));
  libraries.back()->impl("forward_fused", TORCH_FN(forward_fused_cuda));
  libraries.back()->impl("backward_fused", TORCH_FN(backward_fused_cuda));
  libraries.push_back(std::make_unique<torch::Library>(
      torch::Library::IMPL, ns, c10::DispatchKey::Autograd, __FILE__, __LINE__));
  libraries.back()->impl("forward", TORCH_FN(forward_autograd));
  libraries.back()->impl("backward", TORCH_FN(backward_autograd));
  libraries.back()->impl("forward_fused", TORCH_FN(forward_fused_autograd));
  libraries.back()->impl("backward_fused", TORCH_FN(backward_fused_autograd));
}
