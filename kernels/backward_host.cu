// Host side of the backward: checks, layout matching and launches.
#include <ATen/ops/zeros.h>

#include "backward.cu"
#include "forward_host.cu"

// Returns [dx, dweight, dbias]; each is an empty tensor when not asked for.
// dy may have any strides: when they differ from x's it is copied into x's
// layout first.
std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                                 int64_t groups, bool need_dx, bool need_affine) {
  using namespace groupnorm;
  Checked c = check_inputs(x, weight, c10::nullopt, groups, 0.0);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK_VALUE(dy.defined() && dy.sizes() == x.sizes(),
                    message("groupnorm backward: grad_output must have the input's shape ",
                            x.sizes(), ", got ", dy.defined() ? dy.sizes() : c10::IntArrayRef{}));
  TORCH_CHECK_TYPE(dy.scalar_type() == x.scalar_type(),
                   message("groupnorm backward: grad_output has dtype ", dy.scalar_type(),
                           " but input has dtype ", x.scalar_type()));
  TORCH_CHECK_VALUE(dy.device() == x.device(),
                    message("groupnorm backward: grad_output is on ", dy.device(),
                            " but input is on ", x.device()));
  const auto acc_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t N = c.shape.N, C = c.shape.C, HxW = c.shape.HxW;
  for (const at::Tensor* t : {&mean, &rstd}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == N && t->size(1) == groups &&
                          t->scalar_type() == acc_dtype && t->device() == x.device() &&
                          t->is_contiguous(),
                      message("groupnorm backward: mean and rstd must be contiguous [", N, ", ",
                              groups, "] ", c10::toString(acc_dtype), " tensors on ", x.device()));
  }
  const int D = int(C / groups);
  // Channels-last walks rows of D channels with one block; wider groups (rare)
  // take the contiguous walk on a copy.
  at::Tensor xk = c.x;
  bool channels_last = c.shape.channels_last;
  if (channels_last && D > kBackwardThreads) {
    xk = x.contiguous();
    channels_last = false;
  }
  at::Tensor dyk = dy;
  if (dy.strides() != xk.strides()) {
    dyk = at::empty_like(xk);
    dyk.copy_(dy);
  }
  at::Tensor dx = need_dx ? at::empty_like(xk) : at::empty({0}, x.options());
  const auto affine_options = x.options();
  at::Tensor dgamma = at::empty({0}, affine_options), dbeta = at::empty({0}, affine_options);
  if (need_affine) {
    dgamma = N * HxW == 0 ? at::zeros({C}, affine_options) : at::empty({C}, affine_options);
    dbeta = N * HxW == 0 ? at::zeros({C}, affine_options) : at::empty({C}, affine_options);
  }
  if (x.numel() == 0) return {dx, dgamma, dbeta};
  at::Tensor part = need_affine ? at::empty({2, N, C}, x.options().dtype(acc_dtype)) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const unsigned grid = unsigned(std::min<int64_t>(N * groups, kMaxGrid));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "groupnorm_backward", [&] {
        using A = acc_t<scalar_t>;
        A* dgamma_part = need_affine ? part.data_ptr<A>() : nullptr;
        A* dbeta_part = need_affine ? dgamma_part + N * C : nullptr;
        const scalar_t* gamma = c.gamma ? c.gamma->data_ptr<scalar_t>() : nullptr;
        scalar_t* dx_p = need_dx ? dx.data_ptr<scalar_t>() : nullptr;
        const auto kernel = channels_last ? &groupnorm_backward_kernel<scalar_t, true>
                                          : &groupnorm_backward_kernel<scalar_t, false>;
        kernel<<<grid, kBackwardThreads, 0, stream>>>(
            dyk.data_ptr<scalar_t>(), xk.data_ptr<scalar_t>(), mean.data_ptr<A>(),
            rstd.data_ptr<A>(), gamma, dx_p, dgamma_part, dbeta_part, N, HxW, int(C), int(groups));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (need_affine) {
          groupnorm_backward_affine_kernel<scalar_t><<<unsigned((C + 255) / 256), 256, 0, stream>>>(
              dgamma_part, dbeta_part, dgamma.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(), N,
              int(C));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  return {dx, dgamma, dbeta};
}
