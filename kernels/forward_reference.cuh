// The oracle: one CTA per (sample, group), scalar accesses, three sweeps over
// global memory (mean, centred variance, normalise). Obviously right rather
// than fast; it takes any layout whose trailing dims flatten to one stride
// (contiguous and channels-last both do), and is the path tests compare the
// fast kernels against and the fallback for shapes they do not take.
#pragma once

#include "epilogue.cuh"
#include "reduce.cuh"

namespace groupnorm {

template <typename scalar_t, bool kFused>
__global__ void __launch_bounds__(kReferenceThreads) groupnorm_forward_reference_kernel(
    const scalar_t* __restrict__ x,       // [N, C, HxW] with strides below
    const scalar_t* __restrict__ gamma,   // [C] or nullptr
    const scalar_t* __restrict__ beta,    // [C] or nullptr
    scalar_t* __restrict__ y,             // same strides as x
    acc_t<scalar_t>* __restrict__ mean,   // [N, G]
    acc_t<scalar_t>* __restrict__ rstd,   // [N, G]
    const Epilogue<scalar_t, kFused> ep,  // scale, shift [N, C]; residual with y's strides
    int64_t N, int64_t HxW, int G, int D, int64_t stride_n, int64_t stride_c, int64_t stride_s,
    acc_t<scalar_t> eps) {
  using A = acc_t<scalar_t>;
  __shared__ A red[kReferenceThreads];
  __shared__ A total[1];
  const int64_t count = int64_t(D) * HxW;

  for (int64_t unit = blockIdx.x; unit < N * G; unit += gridDim.x) {
    const int64_t n = unit / G;
    const int64_t c0 = (unit % G) * D;
    const auto at = [&](int64_t e) {
      const int64_t c = c0 + e / HxW;
      const int64_t s = e % HxW;
      return n * stride_n + c * stride_c + s * stride_s;
    };
    // element e of the unit: x, or with the prologue x + add
    const auto value = [&](int64_t e) {
      return pre_norm(x[at(e)], n * (int64_t(G) * D) + c0 + e / HxW, ep);
    };

    // Summing x - x[0] keeps the float sum small for inputs far from zero; the
    // compensated sums keep an oracle's long serial sums as exact as torch's.
    const A shift = static_cast<A>(value(0));
    CompensatedSum<A> sum;
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      sum.add(static_cast<A>(value(e)) - shift);
    }
    red[threadIdx.x] = sum.sum;
    __syncthreads();
    reduce_groups(red, 1, blockDim.x, 1, blockDim.x, total);
    const A mu = shift + total[0] / A(count);
    __syncthreads();

    CompensatedSum<A> m2;
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      const A d = static_cast<A>(value(e)) - mu;
      m2.add(d * d);
    }
    red[threadIdx.x] = m2.sum;
    __syncthreads();
    reduce_groups(red, 1, blockDim.x, 1, blockDim.x, total);
    const A rs = rsqrt(total[0] / A(count) + eps);
    if (threadIdx.x == 0) {
      mean[unit] = mu;
      rstd[unit] = rs;
    }

    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      const ChannelAffine<A> f = channel_affine(n, c0 + e / HxW, rs, gamma, beta, ep);
      A v[1] = {affine_value(value(e), mu, f)};
      store_output<scalar_t, 1>(y, at(e), v, ep);
    }
    __syncthreads();  // red and total are reused by the next unit
  }
}

}  // namespace groupnorm
