// s = x + add, add one value per (sample, channel), rounded to the input's
// dtype as torch's add rounds: the separate pass of the plans that cannot
// form s where they load x (ops.cpp). ATen's add of the (N, C, 1, ...) view
// takes its broadcasting path, element by element.
//
// A sample's vectors are split among `blocks` CTAs, each striding over
// them; a vector's channel comes from its index by one 32-bit division
// (contiguous: vectors of one channel; channels-last: V channels of a row).
#pragma once

#include "epilogue.cuh"

namespace groupnorm {

constexpr int kAddThreads = 256;

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kAddThreads)
    add_per_channel_kernel(const scalar_t* __restrict__ x,    // [N, C, HxW] or [N, HxW, C]
                           const scalar_t* __restrict__ add,  // [N, C]
                           scalar_t* __restrict__ s,          // x's layout
                           uint32_t vectors,  // of a sample: C * HxW / V, under 2^31
                           FastDivider per_index,  // by HxW / V (contiguous) or C / V
                           uint32_t cols,          // C / V (channels-last)
                           int64_t C, int blocks, bool channels_last) {
  using VecT = Vec<scalar_t, V>;
  const int64_t n = blockIdx.x / blocks;
  const int64_t base = n * int64_t(vectors) * V;
  const scalar_t* add_n = add + n * C;
  const uint32_t stride = uint32_t(blocks) * blockDim.x;
  for (uint32_t j = (blockIdx.x % blocks) * blockDim.x + threadIdx.x; j < vectors; j += stride) {
    const VecT v = load_vec<scalar_t, V>(x + base + int64_t(j) * V);
    VecT a;
    if (channels_last) {
      const uint32_t c = (j - per_index.div(j) * cols) * V;  // j % cols, times V
      a = load_vec<scalar_t, V>(add_n + c);
    } else {
      const scalar_t one = add_n[per_index.div(j)];
#pragma unroll
      for (int e = 0; e < V; ++e) a.val[e] = one;
    }
    const VecT out = rounded_sum(v, a);
    *reinterpret_cast<VecT*>(s + base + int64_t(j) * V) = out;
  }
}

}  // namespace groupnorm
