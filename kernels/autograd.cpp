// Eager autograd for groupnorm_cuda, in C++: the backward runs on autograd's
// device thread without taking the Python lock, which a Python
// autograd.Function would (tens of microseconds per step on small inputs).
// torch.compile and torch.export use the registered torch.library op instead;
// both run the same forward() and backward() entry points.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include "ops.h"

// Autograd makes an input edge only for each defined tensor argument:
// needs_input_grad takes that edge's index, so absent weight/bias shift it.
class GroupNormFunction : public torch::autograd::Function<GroupNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight,
                            const c10::optional<at::Tensor>& bias, int64_t groups, double eps) {
    std::vector<at::Tensor> out = ::forward(x, weight, bias, groups, eps, "auto", 0, 0);
    // mean and rstd ([N, G] fp32) are all the backward needs beyond x and weight.
    const bool has_weight = weight.has_value() && weight->defined();
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->save_for_backward({x, has_weight ? *weight : at::Tensor(), out[1], out[2]});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["weight_edge"] = int64_t(has_weight ? 1 : -1);
    ctx->saved_data["bias_edge"] = int64_t(has_bias ? 1 + int(has_weight) : -1);
    return out[0];
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
    std::vector<at::Tensor> g =
        ::backward(grads[0], saved[0], saved[2], saved[3],
                   weight.defined() ? c10::optional<at::Tensor>(weight) : c10::nullopt,
                   ctx->saved_data["groups"].toInt(), need_dx, need_weight || need_bias, "auto", 0);
    torch::autograd::variable_list result = {need_dx ? g[0] : at::Tensor(),
                                             need_weight ? g[1] : at::Tensor(),
                                             need_bias ? g[2] : at::Tensor()};
    if (at::GradMode::is_enabled()) refuse_double_backward(result);
    result.push_back(at::Tensor());  // groups
    result.push_back(at::Tensor());  // eps
    return result;
  }

 private:
  // With create_graph=True the gradients are handed on behind a node that
  // raises if anything differentiates through them (as Python's
  // once_differentiable does), instead of silently having no gradient.
  static void refuse_double_backward(torch::autograd::variable_list& grads) {
    auto error = std::make_shared<torch::autograd::DelayedError>(
        "groupnorm_inline: double backward (gradients of gradients) is not supported; use "
        "torch's own group_norm for that",
        int64_t(grads.size()));
    torch::autograd::variable_list inputs;
    for (const at::Tensor& t : grads) {
      inputs.push_back(t.defined() ? t.detach().requires_grad_(true) : at::Tensor());
    }
    grads = error->apply(std::move(inputs));
  }
};

at::Tensor forward_autograd(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                            const c10::optional<at::Tensor>& bias, int64_t groups, double eps) {
  return GroupNormFunction::apply(x, weight, bias, groups, eps);
}
