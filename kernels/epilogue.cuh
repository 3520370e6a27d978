// What a kernel computes per element once the statistics are known: the
// forward's normalise-and-affine, and the backward's dx.
#pragma once

#include "vec.cuh"

namespace groupnorm {

// y = (x - mean) * scale + shift for one channel, with scale = rstd * gamma[c]
// and shift = beta[c]. Subtracting the mean first keeps shifted inputs
// accurate (x * scale + (shift - mean * scale) would cancel).
template <typename A>
struct ChannelAffine {
  A scale, shift;
};

template <typename scalar_t, typename A>
__device__ __forceinline__ ChannelAffine<A> channel_affine(int64_t c, A rstd,
                                                           const scalar_t* __restrict__ gamma,
                                                           const scalar_t* __restrict__ beta) {
  return {gamma != nullptr ? rstd * static_cast<A>(gamma[c]) : rstd,
          beta != nullptr ? static_cast<A>(beta[c]) : A(0)};
}

template <typename scalar_t, typename A>
__device__ __forceinline__ scalar_t normalise(scalar_t x, A mean, ChannelAffine<A> f) {
  return static_cast<scalar_t>((static_cast<A>(x) - mean) * f.scale + f.shift);
}

// A vector of one channel (the contiguous layout).
template <typename scalar_t, int V, typename A>
__device__ __forceinline__ Vec<scalar_t, V> normalise_vec(const Vec<scalar_t, V>& v, A mean,
                                                          ChannelAffine<A> f) {
  Vec<scalar_t, V> out;
#pragma unroll
  for (int e = 0; e < V; ++e) out.val[e] = normalise(v.val[e], mean, f);
  return out;
}

// Per (sample, channel): dx = alpha * dy - k1 - (x - mu) * k2, with
// alpha = rstd * gamma[c], k1 = rstd * sum(g) / M, k2 = rstd^3 * sum(g * (x - mu)) / M,
// g = dy * gamma and M elements per (sample, group). Subtracting mu first
// keeps inputs far from zero (1000 + randn) accurate.
template <typename A>
struct alignas(4 * sizeof(A)) Coef {  // one 16-byte load for float
  A alpha, mu, k1, k2;
};

// dx of V lanes of dy and x; coef(e) gives lane e's coefficients.
template <typename scalar_t, int V, typename CoefOf>
__device__ __forceinline__ Vec<scalar_t, V> dx_vec(const Vec<scalar_t, V>& g,
                                                   const Vec<scalar_t, V>& v, CoefOf coef) {
  using A = acc_t<scalar_t>;
  Vec<scalar_t, V> out;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const Coef<A> c = coef(e);
    out.val[e] = static_cast<scalar_t>(c.alpha * static_cast<A>(g.val[e]) - c.k1 -
                                       (static_cast<A>(v.val[e]) - c.mu) * c.k2);
  }
  return out;
}

}  // namespace groupnorm
