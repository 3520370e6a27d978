// The backward of the fused forward (epilogue.cuh), inside the backward's
// passes (backward_passes.cuh) and registers kernel (backward_registers.cuh).
// With s = x + add, z = GN(s) * gamma * (1 +
// scale) + shift = (s - mean) * a + b (channel_affine folds scale and shift
// into a and b) and y = act(z) (+ residual), the kernels take dy and x as the
// plain backward does and recompute, per element, s and
//   g = dy * act'(z)        (the chain taken back by torch's formulas)
// The plain backward's algebra then runs on g * (1 + scale) in place of dy:
// the sums kernels add g and g * (s - mean) per (sample, channel) chunk, the
// coefficients kernel multiplies each channel's sums by (1 + scale) before
// the group's, so that
//   dshift[n, c] = sum(g)
//   dscale[n, c] = sum(g * (xhat * gamma + beta)) = gamma * rstd * sum(g * (s - mean)) + beta *
//   sum(g) dadd[n, c]   = sum(dx) = alpha * sum(g) - HxW * k1 - k2 * sum(s - mean)
// (alpha, k1, k2: the dx coefficients, Coef), the last needing a third sum,
// of s - mean, which the sums kernels add only when add's gradient is wanted.
// The residual's gradient is dy itself. Nothing of full size is saved or
// written but dx: x, the statistics and the small tensors suffice.
#pragma once

#include "epilogue.cuh"

namespace groupnorm {

// The plain backward: nothing.
template <typename scalar_t, bool kFused>
struct BackwardEpilogue {};

template <typename scalar_t>
struct BackwardEpilogue<scalar_t, true> {
  using A = acc_t<scalar_t>;
  Epilogue<scalar_t, true> forward;  // add, scale, shift and the chain (no residual)
  const scalar_t* beta;              // [C] or nullptr
  const A* rstd;                     // [N, G]
  A* x_partial;                      // sum(s - mean) per partial pair, or nullptr (no dadd)
  A* channel_sums;                   // [N, C, 2]: (1 + scale) * gamma * sum(g), sum(s - mean)
  scalar_t* dscale;                  // [N, C] or nullptr (not wanted)
  scalar_t* dshift;                  // [N, C] or nullptr
  scalar_t* dadd;                    // [N, C] or nullptr
};

template <typename scalar_t, bool kFused>
__device__ __forceinline__ bool wants_x_sums(const BackwardEpilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    return ep.x_partial != nullptr;
  } else {
    return false;
  }
}

template <typename scalar_t, bool kFused>
__device__ __forceinline__ bool wants_add_gradient(const BackwardEpilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    return ep.dadd != nullptr;
  } else {
    return false;
  }
}

// Channel c of sample n from its sums of g (t_dy) and of g * (s - mean)
// (t_dyx): dshift and dscale where wanted. Returns 1 + scale[n, c], by which
// both sums then enter the group's sums and the affine partials.
template <typename scalar_t>
__device__ __forceinline__ acc_t<scalar_t> store_scale_shift_gradients(
    const BackwardEpilogue<scalar_t, true>& ep, int64_t n, int64_t c, acc_t<scalar_t> weight,
    acc_t<scalar_t> rstd, acc_t<scalar_t> t_dy, acc_t<scalar_t> t_dyx) {
  using A = acc_t<scalar_t>;
  const int64_t nc = n * ep.forward.C + c;
  if (ep.dshift != nullptr) ep.dshift[nc] = static_cast<scalar_t>(t_dy);
  if (ep.dscale != nullptr) {
    const A b = ep.beta != nullptr ? static_cast<A>(ep.beta[c]) : A(0);
    ep.dscale[nc] = static_cast<scalar_t>(weight * rstd * t_dyx + b * t_dy);
  }
  return ep.forward.scale != nullptr ? A(1) + static_cast<A>(ep.forward.scale[nc]) : A(1);
}

// What the forward computed for one channel of one sample: the add, the
// group's mean and the channel's folded affine (z = (s - mu) * f.scale + f.shift).
template <typename A>
struct Recompute {
  A add, mu;
  ChannelAffine<A> f;
};

template <typename scalar_t>
__device__ __forceinline__ Recompute<acc_t<scalar_t>> recompute_of(
    int64_t n, int64_t c, int G, const acc_t<scalar_t>* __restrict__ mean,
    const scalar_t* __restrict__ gamma, const BackwardEpilogue<scalar_t, true>& ep) {
  using A = acc_t<scalar_t>;
  const int64_t C = ep.forward.C;
  const int64_t unit = n * G + c / (C / G);
  return {ep.forward.add != nullptr ? static_cast<A>(ep.forward.add[n * C + c]) : A(0),
          mean[unit], channel_affine(n, c, ep.rstd[unit], gamma, ep.beta, ep.forward)};
}

// The gradient with respect to z of act(z), given the gradient g of act(z):
// torch's backward formulas (ATen's silu_backward, gelu_backward,
// threshold_backward, ...), in the accumulation type; those written in
// terms of the output (ReLU, tanh, sigmoid) compute it here, where only
// they pay for it.
template <typename A>
__device__ __forceinline__ A activation_gradient(Activation a, A g, A z, A slope) {
  switch (a) {
    case Activation::SiLU: {
      const A s = logistic(z);
      return g * s * (A(1) + z * (A(1) - s));
    }
    case Activation::GELU: {
      const A cdf = A(0.5) * (A(1) + erf(z * A(M_SQRT1_2)));
      const A pdf = A(M_2_SQRTPI * M_SQRT1_2 * 0.5) * exp(A(-0.5) * z * z);
      return g * (cdf + z * pdf);
    }
    case Activation::GELUTanh: {
      const A beta = A(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = A(0.044715);
      const A t = tanh(beta * (z + kappa * z * z * z));
      const A left = A(0.5) * z, right = A(1) + t;
      return g * (A(0.5) * right + left * (A(1) - t * t) * beta * (A(1) + A(3) * kappa * z * z));
    }
    case Activation::ReLU:
      return activation(Activation::ReLU, z, slope) <= A(0) ? A(0) : g;
    case Activation::LeakyReLU:
      return z > A(0) ? g : g * slope;
    case Activation::Tanh: {
      const A out = tanh(z);
      return g * (A(1) - out * out);
    }
    case Activation::Sigmoid: {
      const A out = logistic(z);
      return g * (A(1) - out) * out;
    }
    case Activation::Hardswish:
      return z < A(-3) ? A(0) : (z <= A(3) ? g * (z / A(3) + A(0.5)) : g);
    case Activation::Mish: {
      const A t = tanh(log1p(exp(z)));
      return g * (t + z * logistic(z) * (A(1) - t * t));
    }
  }
  return g;
}

// The chain taken back on a vector: g holds dy and becomes dy * act'(z).
// Called, not inlined, as activate is (epilogue.cuh); each step's input is
// recomputed from z forwards, so that nothing but two vectors is held.
template <typename A, int V>
__device__ __noinline__ Lanes<A, V> chain_gradient(Lanes<A, V> z, Lanes<A, V> g, uint32_t chain,
                                                   int count, A slope) {
  for (int i = count; i-- > 0;) {
    const Activation a = Activation((chain >> (8 * i)) & 0xffu);
    Lanes<A, V> in = i > 0 ? activate(z, chain, i, slope) : z;
#pragma unroll
    for (int e = 0; e < V; ++e) g.v[e] = activation_gradient(a, g.v[e], in.v[e], slope);
  }
  return g;
}

// For V lanes of dy and x whose channels' Recompute of(e) gives: s (as the
// forward rounded it) minus mean in `centred`, z in `z`, and g = dy in `g`.
template <typename scalar_t, int V, typename Of>
__device__ __forceinline__ void recompute_values(const Vec<scalar_t, V>& dy,
                                                 const Vec<scalar_t, V>& x,
                                                 const BackwardEpilogue<scalar_t, true>& ep, Of of,
                                                 acc_t<scalar_t> (&centred)[V],
                                                 acc_t<scalar_t> (&z)[V],
                                                 acc_t<scalar_t> (&g)[V]) {
  using A = acc_t<scalar_t>;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const Recompute<A> r = of(e);
    const A s = ep.forward.add != nullptr
                    ? static_cast<A>(static_cast<scalar_t>(static_cast<A>(x.val[e]) + r.add))
                    : static_cast<A>(x.val[e]);
    centred[e] = s - r.mu;
    z[e] = centred[e] * r.f.scale + r.f.shift;
    g[e] = static_cast<A>(dy.val[e]);
  }
}

// recompute_values, then g = dy * act'(z) for the chains the passes and
// the registers kernel take themselves: none, or SiLU or ReLU alone,
// inline. Any other chain is taken back by the chain kernel first, whose g
// they then read as dy (launch_backward.cu): the call a chain needs raised
// every fused pass's registers by a third to a half, whatever the call's
// form.
template <typename scalar_t, int V, typename Of>
__device__ __forceinline__ void recompute_lanes(const Vec<scalar_t, V>& dy,
                                                const Vec<scalar_t, V>& x,
                                                const BackwardEpilogue<scalar_t, true>& ep, Of of,
                                                acc_t<scalar_t> (&centred)[V],
                                                acc_t<scalar_t> (&g)[V]) {
  using A = acc_t<scalar_t>;
  A z[V];
  recompute_values<scalar_t, V>(dy, x, ep, of, centred, z, g);
  const Epilogue<scalar_t, true>& f = ep.forward;
  if (f.activations == 1 && f.chain == uint32_t(Activation::SiLU)) {
#pragma unroll
    for (int e = 0; e < V; ++e) g[e] = activation_gradient(Activation::SiLU, g[e], z[e], f.slope);
  } else if (f.activations == 1 && f.chain == uint32_t(Activation::ReLU)) {
#pragma unroll
    for (int e = 0; e < V; ++e) g[e] = activation_gradient(Activation::ReLU, g[e], z[e], f.slope);
  }
}

// The chain kernel: g = dy * act'(z) in x's dtype and layout, for a chain
// the passes do not take, one pass over x and dy before them. Vector j
// holds elements [j * V, j * V + V) of one channel row (contiguous: V
// divides HxW) or of V channels of one position (channels-last: V divides C).
template <typename scalar_t, int V>
__global__ void __launch_bounds__(256) groupnorm_backward_chain_kernel(
    const scalar_t* __restrict__ dy, const scalar_t* __restrict__ x,
    const acc_t<scalar_t>* __restrict__ mean, const scalar_t* __restrict__ gamma,
    scalar_t* __restrict__ g_out, int64_t vectors, int64_t HxW, int G, bool channels_last,
    const BackwardEpilogue<scalar_t, true> ep) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  const int64_t C = ep.forward.C;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < vectors;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = j * V;
    const int64_t n = i / (HxW * C);
    const int64_t c0 = channels_last ? i % C : (i / HxW) % C;
    const int step = channels_last ? 1 : 0;  // channels a lane apart
    const VecT d = load_vec<scalar_t, V>(dy + i), v = load_vec<scalar_t, V>(x + i);
    Lanes<A, V> z, g;
    A centred[V];
    recompute_values<scalar_t, V>(
        d, v, ep, [&](int e) { return recompute_of(n, c0 + e * step, G, mean, gamma, ep); },
        centred, z.v, g.v);
    g = chain_gradient(z, g, ep.forward.chain, ep.forward.activations, ep.forward.slope);
    VecT out;
#pragma unroll
    for (int e = 0; e < V; ++e) out.val[e] = static_cast<scalar_t>(g.v[e]);
    *reinterpret_cast<VecT*>(g_out + i) = out;  // kept in L2 for the passes' first reads
  }
}

}  // namespace groupnorm
