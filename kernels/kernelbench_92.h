// KernelBench level-2 #92 as one fused entry point: the whole of that
// solution's extension (groupnorm_tools writes it; the library does not
// compile it). kernelbench_92.cpp checks and allocates, kernelbench_92.cu
// launches its kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// logsumexp over channels of c + hardswish(tanh(GroupNorm(c))), c = conv2d(x,
// conv_weight, conv_bias) (stride 1, no padding): [N, 1, H - K + 1, W - K + 1].
// Float32 CUDA tensors; conv_weight [C, C_in, K, K] with K 1, 3, 5 or 7.
// Forward only: the result has no autograd history.
at::Tensor conv_groupnorm_logsumexp(const at::Tensor& x, const at::Tensor& conv_weight,
                                    const at::Tensor& conv_bias, const at::Tensor& gamma,
                                    const at::Tensor& beta, int64_t groups, double eps);

// What the kernels read and write; every tensor contiguous float32.
struct Launch {
  const float* x;       // [N, C_in, H, W]
  const float* weight;  // [C, C_in, K, K]
  const float* bias;    // [C]
  const float* gamma;   // [C]
  const float* beta;    // [C]
  float* conv;          // [N, C, OH, OW]: the convolution's output
  float* partials;      // [N, conv_tiles(OH, OW), C, 2]: each tile's (mean, M2)
  float* coef;          // [N, C, 2]: GroupNorm as a * c + b
  float* out;           // [N, OH, OW]
  int N, C_in, C, H, W, K, groups;
  double eps;
};

constexpr int kMaxChannels = 1024;  // the coefficients kernel keeps [C] statistics in shared memory

// Shared memory the convolution kernel needs a CTA, its number of tiles,
// and its work items (tiles of each sample and block of channels).
size_t conv_shared_bytes(int64_t C_in, int64_t K);
int64_t conv_tiles(int OH, int OW);
int64_t conv_items(int N, int C, int OH, int OW);

// Launches the three kernels on `stream` (the caller's device current).
void launch_conv_groupnorm_logsumexp(const Launch& args, cudaStream_t stream);
