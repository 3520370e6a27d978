// The entry points on tensors: checks, the problem description, allocation of
// outputs and workspaces, and the launch of a plan on the current stream
// under a device guard. No host synchronisation; every temporary comes from
// PyTorch's caching allocator.
#include "ops.h"

#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/hardswish.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/mish.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "counters.h"
#include "dispatch.h"
#include "kernel_shapes.h"
#include "launchers.h"
#include "message.h"

namespace groupnorm {
namespace {

struct Checked {
  at::Tensor x;  // the tensor the kernel reads (a contiguous copy if x was neither layout)
  c10::optional<at::Tensor> gamma, beta;
  Problem problem;
};

// (N, C, *) whose memory order is N, *, C with no gaps: channels_last,
// channels_last_3d, and the same for any number of trailing dims.
bool is_channels_last_like(const at::Tensor& x) {
  if (x.dim() < 3) return false;
  const int64_t C = x.size(1);
  if (C != 1 && x.stride(1) != 1) return false;
  int64_t expected = C;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    if (x.size(d) != 1 && x.stride(d) != expected) return false;
    expected *= x.size(d);
  }
  return x.size(0) == 1 || x.stride(0) == expected;
}

c10::optional<at::Tensor> check_affine(const c10::optional<at::Tensor>& t, const char* name,
                                       const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return c10::nullopt;
  const int64_t C = x.size(1);
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == C,
                    message("groupnorm: ", name, " must have shape [", C,
                            "] (one value per channel), got ", t->sizes()));
  TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(),
                   message("groupnorm: ", name, " has dtype ", t->scalar_type(),
                           " but input has dtype ", x.scalar_type()));
  TORCH_CHECK_VALUE(t->device() == x.device(), message("groupnorm: ", name, " is on ", t->device(),
                                                       " but input is on ", x.device()));
  return t->contiguous();
}

Checked check_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& gamma,
                     const c10::optional<at::Tensor>& beta, int64_t groups, double eps) {
  TORCH_CHECK_VALUE(x.defined(), "groupnorm: input is undefined");
  TORCH_CHECK_VALUE(x.is_cuda(), message("groupnorm: input must be a CUDA tensor, got one on ",
                                         x.device(), " (group_norm() handles CPU tensors)"));
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
      message("groupnorm: input dtype must be float32, float16, bfloat16 or float64, got ", dtype));
  TORCH_CHECK_VALUE(x.dim() >= 2,
                    message("groupnorm: input must have shape (N, C, *), got ", x.sizes()));
  const int64_t C = x.size(1);
  TORCH_CHECK_VALUE(groups > 0, message("groupnorm: num_groups must be positive, got ", groups));
  TORCH_CHECK_VALUE(C % groups == 0, message("groupnorm: num_channels (", C,
                                             ") must be divisible by num_groups (", groups, ")"));
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0,
                    message("groupnorm: eps must be finite and >= 0, got ", eps));
  Checked c;
  c.gamma = check_affine(gamma, "weight", x);
  c.beta = check_affine(beta, "bias", x);
  const bool contiguous = x.is_contiguous();
  const bool channels_last = !contiguous && is_channels_last_like(x);
  c.x = contiguous || channels_last ? x : x.contiguous();
  int64_t HxW = 1;
  for (int64_t d = 2; d < x.dim(); ++d) HxW *= x.size(d);
  const int device = x.device().index();
  c.problem = Problem{x.size(0),
                      C,
                      HxW,
                      int(groups),
                      channels_last,
                      dtype_of(dtype),
                      int64_t(x.element_size()),
                      dtype == at::kDouble ? 8 : 4,
                      reinterpret_cast<uintptr_t>(c.x.data_ptr()),
                      device,
                      &device_info(device)};
  return c;
}

// The epilogue's tensors as the kernels read them, kept alive until the
// launches are enqueued, and their pointers.
struct CheckedEpilogue {
  at::Tensor add, scale, shift, residual;  // undefined when absent
  EpilogueArgs args;
};

void check_like_input(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(),
                   message("groupnorm: ", name, " has dtype ", t.scalar_type(),
                           " but input has dtype ", x.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == x.device(), message("groupnorm: ", name, " is on ", t.device(),
                                                      " but input is on ", x.device()));
}

at::Tensor check_modulation(const c10::optional<at::Tensor>& t, const char* name,
                            const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  const int64_t N = x.size(0), C = x.size(1);
  // [N, C], or [N, C, 1, ...] as graphs broadcast it (the compile pass folds those)
  bool per_channel = t->dim() >= 2 && t->dim() <= x.dim() && t->size(0) == N && t->size(1) == C;
  for (int64_t d = 2; per_channel && d < t->dim(); ++d) per_channel = t->size(d) == 1;
  TORCH_CHECK_VALUE(per_channel, message("groupnorm: ", name, " must have shape [", N, ", ", C,
                                         "] (one value per sample and channel) or [", N, ", ", C,
                                         ", 1, ...], got ", t->sizes()));
  check_like_input(*t, name, x);
  return t->reshape({N, C}).contiguous();
}

// Whether a and b (of one shape) put every element at the same offset.
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

at::Tensor check_residual(const c10::optional<at::Tensor>& t, const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK_VALUE(
      t->sizes() == x.sizes(),
      message("groupnorm: residual must have the input's shape ", x.sizes(), ", got ", t->sizes()));
  check_like_input(*t, "residual", x);
  return *t;
}

CheckedEpilogue check_epilogue(const at::Tensor& x, const c10::optional<at::Tensor>& scale,
                               const c10::optional<at::Tensor>& shift,
                               const c10::optional<at::Tensor>& residual,
                               const std::vector<int64_t>& activations, double slope,
                               const c10::optional<at::Tensor>& add, bool residual_first) {
  TORCH_CHECK_VALUE(activations.size() <= size_t(kMaxActivations),
                    message("groupnorm: at most ", kMaxActivations, " activations in a chain, got ",
                            activations.size()));
  TORCH_CHECK_VALUE(std::isfinite(slope),
                    message("groupnorm: the leaky_relu slope must be finite, got ", slope));
  CheckedEpilogue e;
  for (size_t i = 0; i < activations.size(); ++i) {
    const int64_t code = activations[i];
    TORCH_CHECK_VALUE(code >= 0 && code < kActivationCodes,
                      message("groupnorm: unknown activation code ", code, " (codes are 0 to ",
                              kActivationCodes - 1, ")"));
    e.args.chain[i] = Activation(code);
  }
  e.args.activations = int(activations.size());
  e.args.slope = slope;
  e.add = check_modulation(add, "add", x);
  e.scale = check_modulation(scale, "scale", x);
  e.shift = check_modulation(shift, "shift", x);
  e.residual = check_residual(residual, x);
  TORCH_CHECK_VALUE(!residual_first || e.residual.defined(),
                    "groupnorm: residual_first adds the residual before the activations, but "
                    "there is no residual");
  e.args.residual_first = residual_first && !activations.empty();  // else one sum either way
  e.args.C = x.size(1);
  for (auto [tensor, pointer] :
       {std::pair{&e.add, &e.args.add}, std::pair{&e.scale, &e.args.scale},
        std::pair{&e.shift, &e.args.shift}, std::pair{&e.residual, &e.args.residual}}) {
    if (tensor->defined() && tensor->numel() > 0) *pointer = tensor->data_ptr();
  }
  return e;
}

at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Workspaces from the caching allocator on the launch stream. The tensors
// are freed when the call returns, after the launches are enqueued: the
// allocator hands their memory only to later work on the same stream, which
// runs after these launches. Counters come from the stream's slot
// (counters.cpp), or from a temporary zeroed on the stream where it has none.
class TensorWorkspace final : public WorkspaceAllocator {
 public:
  TensorWorkspace(const at::Tensor& like, cudaStream_t stream) : like_(like), stream_(stream) {}
  uint8_t* allocate(int64_t bytes) override {
    held_.push_back(at::empty({bytes}, like_.options().dtype(at::kByte)));
    return held_.back().data_ptr<uint8_t>();
  }
  uint8_t* counters(int64_t bytes) override {
    if (uint8_t* shared = stream_counters(bytes, like_, stream_)) return shared;
    uint8_t* zeroed = allocate(bytes);
    C10_CUDA_CHECK(cudaMemsetAsync(zeroed, 0, size_t(bytes), stream_));
    return zeroed;
  }

 private:
  const at::Tensor& like_;
  cudaStream_t stream_;
  std::vector<at::Tensor> held_;
};

cudaStream_t current_stream(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
}

const void* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

// s = x + add (add [N, C]) in x's layout, for the plans that cannot form s
// in their kernel: add_per_channel_kernel, or ATen's broadcast add (element
// by element) where a sample holds 2^31 elements or more.
at::Tensor pre_norm_sum(const Checked& c, const at::Tensor& add) {
  Problem p = c.problem;
  if (p.C * p.HxW >= (int64_t(1) << 31)) {
    std::vector<int64_t> per_channel{p.N, p.C};
    per_channel.resize(size_t(c.x.dim()), 1);
    return at::add(c.x, add.view(per_channel));
  }
  if (p.channels_last) p.addr |= reinterpret_cast<uintptr_t>(add.data_ptr());  // read as vectors
  at::Tensor s = at::empty_like(c.x);
  with_kernel_types(p, [&](auto tag, auto fused) {
    using scalar_t = typename decltype(tag)::type;
    launch_add_per_channel<scalar_t, decltype(fused)::value>(p, c.x.data_ptr(), add.data_ptr(),
                                                             s.data_ptr(), current_stream(c.x));
  });
  return s;
}

}  // namespace
}  // namespace groupnorm

using namespace groupnorm;

at::Tensor aten_activation(Activation a, const at::Tensor& v, double slope, bool in_place) {
  at::Tensor t = v;
  switch (a) {
    case Activation::SiLU:
      return in_place ? at::silu_(t) : at::silu(v);
    case Activation::GELU:
      return in_place ? at::gelu_(t) : at::gelu(v);
    case Activation::GELUTanh:
      return in_place ? at::gelu_(t, "tanh") : at::gelu(v, "tanh");
    case Activation::ReLU:
      return in_place ? at::relu_(t) : at::relu(v);
    case Activation::LeakyReLU:
      return in_place ? at::leaky_relu_(t, slope) : at::leaky_relu(v, slope);
    case Activation::Tanh:
      return in_place ? at::tanh_(t) : at::tanh(v);
    case Activation::Sigmoid:
      return in_place ? at::sigmoid_(t) : at::sigmoid(v);
    case Activation::Hardswish:
      return in_place ? at::hardswish_(t) : at::hardswish(v);
    case Activation::Mish:
      return in_place ? at::mish_(t) : at::mish(v);
  }
  TORCH_CHECK(false, "groupnorm: unknown activation");
}

std::vector<at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                                const std::string& kernel, int64_t team, int64_t lag) {
  return forward_fused(x, weight, bias, groups, eps, kernel, team, lag, c10::nullopt, c10::nullopt,
                       c10::nullopt, {}, 0.01, c10::nullopt, false);
}

std::vector<at::Tensor> forward_fused(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                      const c10::optional<at::Tensor>& bias, int64_t groups,
                                      double eps, const std::string& kernel, int64_t team,
                                      int64_t lag, const c10::optional<at::Tensor>& scale,
                                      const c10::optional<at::Tensor>& shift,
                                      const c10::optional<at::Tensor>& residual,
                                      const std::vector<int64_t>& activations, double slope,
                                      const c10::optional<at::Tensor>& add, bool residual_first) {
  Checked c = check_inputs(x, weight, bias, groups, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  CheckedEpilogue epilogue =
      check_epilogue(x, scale, shift, residual, activations, slope, add, residual_first);
  // c.x is dense (contiguous or channels-last-like), so y gets its exact strides.
  const auto outputs = [&] {
    const auto stats = x.options().dtype(acc_dtype(x));
    return std::vector<at::Tensor>{at::empty_like(c.x), at::empty({c.problem.N, groups}, stats),
                                   at::empty({c.problem.N, groups}, stats)};
  };
  if (x.numel() == 0) return outputs();
  // The kernels read the residual at the offsets they write y at: one of
  // other strides is read from a copy in y's (a pass over it, into an
  // aligned block). Else its vectors must suit its address too.
  const bool copy_residual = epilogue.residual.defined() && !same_layout(epilogue.residual, c.x);
  if (!copy_residual) c.problem.addr |= reinterpret_cast<uintptr_t>(epilogue.args.residual);
  c.problem.epilogue = epilogue.args.any();
  c.problem.called_chain = !epilogue.args.inline_chain();
  c.problem.store = epilogue.args.store();
  const ForwardPlan plan = choose_forward(c.problem, Request{kernel, team, lag});
  const bool team_kernel =
      plan.kernel == ForwardKernel::Contiguous || plan.kernel == ForwardKernel::ChannelsLast;
  if (epilogue.add.defined() && (plan.kernel == ForwardKernel::StreamChannelsLast ||
                                 (team_kernel && plan.team.kept < plan.team.slice))) {
    // The prologue is in the reference and registers kernels, the contiguous
    // stream (both items of a piece turn x into s) and team kernels that keep
    // their whole slice on chip (where it turns the kept x into s once); the
    // channels-last stream and team plans that keep less get s by a
    // separate add (a pass more), before anything of this call is allocated.
    return forward_fused(pre_norm_sum(c, epilogue.add), weight, bias, groups, eps, kernel, team,
                         lag, scale, shift, residual, activations, slope, c10::nullopt,
                         residual_first);
  }
  if (epilogue.args.residual_first &&
      (plan.kernel == ForwardKernel::Stream || plan.kernel == ForwardKernel::StreamChannelsLast)) {
    // The stream kernels are built without a residual before the activations
    // (at their register bound; epilogue.cuh): they add it last with no
    // activation, and ATen applies the chain in place (a pass more).
    std::vector<at::Tensor> out = forward_fused(x, weight, bias, groups, eps, kernel, team, lag,
                                                scale, shift, residual, {}, slope, add, false);
    for (int64_t code : activations) aten_activation(Activation(code), out[0], slope, true);
    return out;
  }
  const std::vector<at::Tensor> out = outputs();
  const at::Tensor &y = out[0], &mean = out[1], &rstd = out[2];
  if (copy_residual) {
    epilogue.residual = at::empty_like(y).copy_(epilogue.residual);
    epilogue.args.residual = epilogue.residual.data_ptr();
  }
  const cudaStream_t stream = current_stream(x);
  TensorWorkspace workspace(y, stream);
  const ForwardArgs args{c.x.data_ptr(),
                         data_or_null(c.gamma),
                         data_or_null(c.beta),
                         y.data_ptr(),
                         mean.data_ptr(),
                         rstd.data_ptr(),
                         eps,
                         epilogue.args};
  with_kernel_types(c.problem, [&](auto tag, auto fused) {
    using scalar_t = typename decltype(tag)::type;
    constexpr bool kFused = decltype(fused)::value;
    switch (plan.kernel) {
      case ForwardKernel::Reference:
        return launch_reference<scalar_t, kFused>(plan, c.problem, args, stream);
      case ForwardKernel::Registers:
        return plan.registers.items == kRegistersFewItems
                   ? launch_registers<scalar_t, kRegistersFewItems, kFused>(plan, c.problem, args,
                                                                            stream)
                   : launch_registers<scalar_t, kRegistersManyItems, kFused>(plan, c.problem, args,
                                                                             stream);
      case ForwardKernel::Contiguous:
      case ForwardKernel::ChannelsLast:
        return launch_team<scalar_t, kFused>(plan, c.problem, args, workspace, stream);
      case ForwardKernel::Stream:
        return launch_stream<scalar_t, kFused>(plan, c.problem, args, workspace, stream);
      case ForwardKernel::StreamChannelsLast:
        return launch_stream_channels_last<scalar_t, kFused>(plan, c.problem, args, workspace,
                                                             stream);
    }
  });
  return out;
}

namespace {

// dy, mean and rstd against x.
void check_grad_output(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                       const at::Tensor& rstd, const Problem& p, int64_t groups) {
  TORCH_CHECK_VALUE(dy.defined() && dy.sizes() == x.sizes(),
                    message("groupnorm backward: grad_output must have the input's shape ",
                            x.sizes(), ", got ", dy.defined() ? dy.sizes() : c10::IntArrayRef{}));
  TORCH_CHECK_TYPE(dy.scalar_type() == x.scalar_type(),
                   message("groupnorm backward: grad_output has dtype ", dy.scalar_type(),
                           " but input has dtype ", x.scalar_type()));
  TORCH_CHECK_VALUE(dy.device() == x.device(),
                    message("groupnorm backward: grad_output is on ", dy.device(),
                            " but input is on ", x.device()));
  for (const at::Tensor* t : {&mean, &rstd}) {
    TORCH_CHECK_VALUE(
        t->dim() == 2 && t->size(0) == p.N && t->size(1) == groups &&
            t->scalar_type() == acc_dtype(x) && t->device() == x.device() && t->is_contiguous(),
        message("groupnorm backward: mean and rstd must be contiguous [", p.N, ", ", groups, "] ",
                c10::toString(acc_dtype(x)), " tensors on ", x.device()));
  }
}

// dy in the layout of xk, the (dense) tensor the kernels read for x.
at::Tensor in_layout_of(const at::Tensor& xk, const at::Tensor& dy) {
  if (dy.strides() == xk.strides()) return dy;
  at::Tensor dyk = at::empty_like(xk);
  dyk.copy_(dy);
  return dyk;
}

// A gradient of C or (N, C) sums, or an empty tensor when not wanted: zeros
// where the sums are over no element.
at::Tensor sums_output(bool wanted, c10::IntArrayRef sizes, bool over_nothing,
                       const at::TensorOptions& options) {
  if (!wanted) return at::empty({0}, options);
  return over_nothing ? at::zeros(sizes, options) : at::empty(sizes, options);
}

// Plans and launches a backward whose outputs are allocated: the plain
// passes, stream or registers kernel, or the fused passes or registers
// kernel (problem.epilogue).
void run_backward(Problem both, const at::Tensor& dyk, bool need_dx, const BackwardArgs& args,
                  const std::string& kernel, int64_t lag, const at::Tensor& like) {
  both.addr |= reinterpret_cast<uintptr_t>(dyk.data_ptr());  // vectors must suit x and dy
  const BackwardPlan plan = choose_backward(both, need_dx, Request{kernel, 0, lag});
  const cudaStream_t stream = current_stream(like);
  TensorWorkspace workspace(like, stream);
  with_kernel_types(both, [&](auto tag, auto fused) {
    using scalar_t = typename decltype(tag)::type;
    constexpr bool kFused = decltype(fused)::value;
    if constexpr (!kFused) {
      if (plan.kernel == BackwardKernel::Stream ||
          plan.kernel == BackwardKernel::StreamChannelsLast) {
        return launch_backward_stream<scalar_t>(plan, both, args, workspace, stream);
      }
    }
    if (plan.kernel == BackwardKernel::Registers) {
      return launch_backward_registers<scalar_t, kFused>(plan, both, args, workspace, stream);
    }
    launch_backward_passes<scalar_t, kFused>(plan, both, args, workspace, stream);
  });
}

}  // namespace

std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                                 int64_t groups, bool need_dx, bool need_affine,
                                 const std::string& kernel, int64_t lag) {
  Checked c = check_inputs(x, weight, c10::nullopt, groups, 0.0);
  const c10::cuda::CUDAGuard guard(x.device());
  const Problem& p = c.problem;
  const at::Tensor& xk = c.x;
  check_grad_output(dy, x, mean, rstd, p, groups);
  const auto empty = [&] { return at::empty({0}, x.options()); };
  if (!need_dx && !need_affine) return {empty(), empty(), empty()};  // nothing to compute
  const at::Tensor dyk = in_layout_of(xk, dy);
  at::Tensor dx = need_dx ? at::empty_like(xk) : empty();
  const bool over_nothing = p.N * p.HxW == 0;
  at::Tensor dgamma = sums_output(need_affine, {p.C}, over_nothing, x.options());
  at::Tensor dbeta = sums_output(need_affine, {p.C}, over_nothing, x.options());
  if (x.numel() == 0) return {dx, dgamma, dbeta};
  const BackwardArgs args{dyk.data_ptr(),
                          xk.data_ptr(),
                          mean.data_ptr(),
                          rstd.data_ptr(),
                          data_or_null(c.gamma),
                          need_dx ? dx.data_ptr() : nullptr,
                          need_affine ? dgamma.data_ptr() : nullptr,
                          need_affine ? dbeta.data_ptr() : nullptr};
  run_backward(p, dyk, need_dx, args, kernel, lag, xk);
  return {dx, dgamma, dbeta};
}

std::vector<at::Tensor> backward_fused(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, int64_t groups,
    const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& shift,
    const std::vector<int64_t>& activations, double slope, const c10::optional<at::Tensor>& add,
    bool need_dx, bool need_affine, bool need_scale, bool need_shift, bool need_add,
    const std::string& kernel) {
  Checked c = check_inputs(x, weight, bias, groups, 0.0);
  const c10::cuda::CUDAGuard guard(x.device());
  const Problem& p = c.problem;
  const at::Tensor& xk = c.x;
  CheckedEpilogue epilogue =
      check_epilogue(x, scale, shift, c10::nullopt, activations, slope, add, false);
  need_scale = need_scale && epilogue.scale.defined();
  need_shift = need_shift && epilogue.shift.defined();
  need_add = need_add && epilogue.add.defined();
  check_grad_output(dy, x, mean, rstd, p, groups);
  const bool over_nothing = p.N * p.HxW == 0;
  at::Tensor dx = need_dx ? at::empty_like(xk) : at::empty({0}, x.options());
  std::vector<at::Tensor> out{dx};
  for (auto [wanted, sizes] : {std::pair{need_affine, std::vector<int64_t>{p.C}},
                               std::pair{need_affine, std::vector<int64_t>{p.C}},
                               std::pair{need_scale, std::vector<int64_t>{p.N, p.C}},
                               std::pair{need_shift, std::vector<int64_t>{p.N, p.C}},
                               std::pair{need_add, std::vector<int64_t>{p.N, p.C}}}) {
    out.push_back(sums_output(wanted, sizes, over_nothing, x.options()));
  }
  if (x.numel() == 0 || !(need_dx || need_affine || need_scale || need_shift || need_add)) {
    return out;
  }
  const at::Tensor dyk = in_layout_of(xk, dy);
  const auto pointer = [](bool wanted, const at::Tensor& t) {
    return wanted ? t.data_ptr() : nullptr;
  };
  BackwardArgs args{dyk.data_ptr(),
                    xk.data_ptr(),
                    mean.data_ptr(),
                    rstd.data_ptr(),
                    data_or_null(c.gamma),
                    pointer(need_dx, out[0]),
                    pointer(need_affine, out[1]),
                    pointer(need_affine, out[2])};
  args.beta = data_or_null(c.beta);
  args.epilogue = epilogue.args;
  args.dscale = pointer(need_scale, out[3]);
  args.dshift = pointer(need_shift, out[4]);
  args.dadd = pointer(need_add, out[5]);
  Problem fused = p;
  fused.epilogue = true;
  fused.called_chain = !epilogue.args.inline_chain();
  run_backward(fused, dyk, need_dx, args, kernel, 0, xk);
  return out;
}

namespace {

// x's problem as a plan query sees it: with an epilogue when asked for or
// when the activation chain is not empty, and what that chain needs.
Checked plan_problem(const at::Tensor& x, int64_t groups, bool epilogue,
                     const std::vector<int64_t>& activations) {
  Checked c = check_inputs(x, c10::nullopt, c10::nullopt, groups, 0.0);
  const EpilogueArgs chain = check_epilogue(x, c10::nullopt, c10::nullopt, c10::nullopt,
                                            activations, 0.0, c10::nullopt, false)
                                 .args;
  c.problem.epilogue = epilogue || chain.any();
  c.problem.called_chain = !chain.inline_chain();
  c.problem.store = chain.store();
  return c;
}

}  // namespace

PlanFields forward_plan(const at::Tensor& x, int64_t groups, const std::string& kernel,
                        int64_t team, int64_t lag, bool epilogue,
                        const std::vector<int64_t>& activations) {
  const Checked c = plan_problem(x, groups, epilogue, activations);
  if (x.numel() == 0)
    return {{"kernel", std::string("none")}, {"reason", std::string("empty input: no launch")}};
  const c10::cuda::CUDAGuard guard(x.device());
  return describe(choose_forward(c.problem, Request{kernel, team, lag}), c.problem);
}

PlanFields backward_plan(const at::Tensor& x, int64_t groups, const std::string& kernel,
                         int64_t lag, bool epilogue, const std::vector<int64_t>& activations) {
  const Checked c = plan_problem(x, groups, epilogue, activations);
  if (x.numel() == 0)
    return {{"kernel", std::string("none")}, {"reason", std::string("empty input: no launch")}};
  const c10::cuda::CUDAGuard guard(x.device());
  return describe(choose_backward(c.problem, true, Request{kernel, 0, lag}), c.problem);
}
