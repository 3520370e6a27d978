// KernelBench level-2 #92's entry point: checks (errors name the argument
// and the values, joined by message.h), allocations, then the kernels of
// kernelbench_92.cu.
#include "kernelbench_92.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "message.h"

namespace {

using groupnorm::message;

void check_float_cuda(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat,
              message("conv_groupnorm_logsumexp: ", name, " must be a float32 CUDA tensor (this ",
                      "solution is built for float32 alone); got ", t.scalar_type(), " on ",
                      t.device()));
  TORCH_CHECK(t.device() == x.device(), message("conv_groupnorm_logsumexp: ", name, " is on ",
                                                t.device(), " but x is on ", x.device()));
}

void check_per_channel(const at::Tensor& t, const char* name, int64_t C) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == C,
              message("conv_groupnorm_logsumexp: ", name, " must be [", C, "]; got ", t.sizes()));
}

}  // namespace

at::Tensor conv_groupnorm_logsumexp(const at::Tensor& x_in, const at::Tensor& conv_weight,
                                    const at::Tensor& conv_bias, const at::Tensor& gamma,
                                    const at::Tensor& beta, int64_t groups, double eps) {
  check_float_cuda(x_in, "x", x_in);
  check_float_cuda(conv_weight, "conv_weight", x_in);
  check_float_cuda(conv_bias, "conv_bias", x_in);
  check_float_cuda(gamma, "gamma", x_in);
  check_float_cuda(beta, "beta", x_in);
  TORCH_CHECK(x_in.dim() == 4,
              message("conv_groupnorm_logsumexp: x must be [N, C_in, H, W]; got ", x_in.sizes()));
  TORCH_CHECK(conv_weight.dim() == 4 && conv_weight.size(2) == conv_weight.size(3) &&
                  conv_weight.size(2) % 2 == 1 && conv_weight.size(2) <= 7,
              message("conv_groupnorm_logsumexp: conv_weight must be [C, C_in, K, K] with K 1, ",
                      "3, 5 or 7; got ", conv_weight.sizes()));
  const int64_t N = x_in.size(0), C_in = x_in.size(1), H = x_in.size(2), W = x_in.size(3);
  const int64_t C = conv_weight.size(0), K = conv_weight.size(2);
  TORCH_CHECK(conv_weight.size(1) == C_in,
              message("conv_groupnorm_logsumexp: x has ", C_in,
                      " channels but conv_weight expects ", conv_weight.size(1)));
  check_per_channel(conv_bias, "conv_bias", C);
  check_per_channel(gamma, "gamma", C);
  check_per_channel(beta, "beta", C);
  TORCH_CHECK(C >= 1 && C <= kMaxChannels, message("conv_groupnorm_logsumexp: at most ",
                                                   kMaxChannels, " output channels; got ", C));
  TORCH_CHECK(groups > 0 && C % groups == 0,
              message("conv_groupnorm_logsumexp: num_groups (", groups, ") must divide the ", C,
                      " channels"));
  TORCH_CHECK(H >= K && W >= K, message("conv_groupnorm_logsumexp: the input (", H, " x ", W,
                                        ") is smaller than the ", K, " x ", K, " kernel"));
  TORCH_CHECK(N <= 65535 && C_in * H * W < (int64_t(1) << 31),
              message("conv_groupnorm_logsumexp: at most 65535 samples of fewer than 2^31 ",
                      "elements; got ", x_in.sizes()));
  const int64_t OH = H - K + 1, OW = W - K + 1;
  auto out = at::empty({N, 1, OH, OW}, x_in.options());
  if (N == 0) return out;

  const c10::cuda::CUDAGuard guard(x_in.device());
  int shared_limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        x_in.device().index()));
  const size_t shared_bytes = conv_shared_bytes(C_in, K);
  TORCH_CHECK(shared_bytes <= size_t(shared_limit),
              message("conv_groupnorm_logsumexp: ", C_in, " input channels with a ", K, " x ", K,
                      " kernel need ", shared_bytes, " bytes of shared memory a block; this ",
                      "device has ", shared_limit));
  TORCH_CHECK(conv_items(int(N), int(C), int(OH), int(OW)) < (int64_t(1) << 31),
              message("conv_groupnorm_logsumexp: more than 2^31 work items of the convolution ",
                      "kernel; got ", x_in.sizes()));
  const auto x = x_in.contiguous();
  const auto weight = conv_weight.contiguous();
  const auto bias = conv_bias.contiguous();
  const auto gamma_c = gamma.contiguous();
  const auto beta_c = beta.contiguous();
  auto conv = at::empty({N, C, OH, OW}, x.options());
  auto partials = at::empty({N, conv_tiles(int(OH), int(OW)), C, 2}, x.options());
  auto coef = at::empty({N, C, 2}, x.options());
  const Launch args{x.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                    gamma_c.data_ptr<float>(), beta_c.data_ptr<float>(), conv.data_ptr<float>(),
                    partials.data_ptr<float>(), coef.data_ptr<float>(), out.data_ptr<float>(),
                    int(N), int(C_in), int(C), int(H), int(W), int(K), int(groups), eps};
  launch_conv_groupnorm_logsumexp(args, c10::cuda::getCurrentCUDAStream().stream());
  return out;
}
