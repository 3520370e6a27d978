// The extension's entry points on tensors (ops.cpp), bound to Python by
// bindings.cpp. Errors name the problem and the values.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "activation.h"
#include "plan.h"

// Returns [y, mean, rstd]; mean and rstd are [N, G] in the accumulation type
// (float, or double for double input). kernel, team and lag force a path
// (Request); "auto", 0, 0 let choose_forward decide.
std::vector<at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                                const std::string& kernel, int64_t team, int64_t lag);

// forward() with the prologue and epilogue of issue 24: s = x + add (add: [N,
// C] of x's dtype and device, or absent; a separate add first where the
// planner streams the groups), y = GN(s) * weight + bias, then
// y * (1 + scale) + shift (scale, shift: [N, C] of x's dtype and device, or
// absent), then the activations in order (Activation codes, activation.h; at
// most kMaxActivations; slope: LeakyReLU's), then y + residual (x's shape,
// dtype and device; copied into y's layout first if its strides differ), or
// with residual_first the residual before the activations (where the planner
// streams the groups: the residual added last without the activations, then
// ATen's activations, a pass more).
// forward() is this without any of them; the operators (library.cpp) and the
// KernelBench export call that one.
std::vector<at::Tensor> forward_fused(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                      const c10::optional<at::Tensor>& bias, int64_t groups,
                                      double eps, const std::string& kernel, int64_t team,
                                      int64_t lag, const c10::optional<at::Tensor>& scale,
                                      const c10::optional<at::Tensor>& shift,
                                      const c10::optional<at::Tensor>& residual,
                                      const std::vector<int64_t>& activations, double slope,
                                      const c10::optional<at::Tensor>& add, bool residual_first);

// One activation applied to v by ATen (torch's formulas): into a new tensor,
// or into v itself with in_place.
at::Tensor aten_activation(groupnorm::Activation a, const at::Tensor& v, double slope,
                           bool in_place = false);

// Registers forward(), backward(), forward_fused() and backward_fused() as
// the CUDA and autograd kernels of the operators <ns>::forward, ::backward,
// ::forward_fused and ::backward_fused, whose schemas the caller has defined
// (library.cpp). Once per process.
void register_kernels(const std::string& ns);

// Returns [dx, dweight, dbias]; each is an empty tensor when not asked for.
// kernel: "auto", "passes", "stream" or "registers"; lag forces the stream
// kernel's lag.
std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                                 int64_t groups, bool need_dx, bool need_affine,
                                 const std::string& kernel, int64_t lag);

// The backward of forward_fused (without the residual, whose gradient is
// dy): returns [dx, dweight, dbias, dscale, dshift, dadd], dscale, dshift and
// dadd [N, C] in x's dtype; each an empty tensor when not asked for (or its
// operand absent). The passes or registers kernel with the epilogue
// recomputed per element (backward_epilogue.cuh); bias is what the forward
// added. kernel: "auto", "passes" or "registers".
std::vector<at::Tensor> backward_fused(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, int64_t groups,
    const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
    const std::vector<int64_t>& activations, double slope, const c10::optional<at::Tensor>& add,
    bool need_dx, bool need_affine, bool need_scale, bool need_shift, bool need_add,
    const std::string& kernel = "auto");

// The plan forward() would run for x (forward_fused(), with `epilogue` or an
// activation chain), or backward() for x and a grad_output laid out like it
// (dx wanted; backward_fused() with `epilogue` or an activation chain).
// Empty input: no launch, no fields but that.
groupnorm::PlanFields forward_plan(const at::Tensor& x, int64_t groups, const std::string& kernel,
                                   int64_t team, int64_t lag, bool epilogue,
                                   const std::vector<int64_t>& activations);
groupnorm::PlanFields backward_plan(const at::Tensor& x, int64_t groups, const std::string& kernel,
                                    int64_t lag, bool epilogue,
                                    const std::vector<int64_t>& activations);
