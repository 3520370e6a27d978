// What a kernel computes per element once the statistics are known: the
// forward's normalise-and-affine with its epilogue, and the backward's dx.
//
// The forward epilogue (issue 24) is
//   s = x + add;  y = GN(s) * gamma + beta;  y = y * (1 + scale) + shift;  y = act(y);
//   y = y + residual
// with scale, shift per (sample, channel) and residual in y's layout, or with
// residual_first y = act(y + residual) (a ResNet block's tail). Each forward
// kernel takes it as a compile-time switch (kFused) and, when on, a
// run-time value (Epilogue<scalar_t, true>): the plain instantiation compiles
// to the code it had before the epilogue existed, and the fused ones serve
// every option (below: a copy per store kind; the Any copy all of them).
//  - scale and shift fold into the per-channel affine the kernels already
//    compute (channel_affine): rstd * gamma * (1 + s) and beta * (1 + s) + t,
//    so they cost nothing per element.
//  - the activation chain runs on the accumulation-type value before the
//    cast: SiLU or ReLU alone inline, other chains in a called function
//    (activate). At the vector width its planner prefers, a fused kernel
//    has a copy per store kind (Store, has_store_copies): those of the
//    common calls, nothing or SiLU or ReLU alone and no residual, test
//    nothing per stored vector; Any tests every option, and is the only
//    copy at other widths and for double.
//  - the residual is read at the element offset y is written at (same
//    layout), in the store's vector width, and added last (or before the
//    activations).
// The registers kernel takes the inline forms alone (no called chain): with
// the call it needed up to 73 registers instead of 40; the planner gives
// calls with a chain another kernel.
#pragma once

#include <cmath>
#include <type_traits>

#include "activation.h"
#include "vec.cuh"

namespace groupnorm {

// The epilogue of a plain GroupNorm: nothing.
template <typename scalar_t, bool kFused>
struct Epilogue {};

template <typename scalar_t>
struct Epilogue<scalar_t, true> {
  using A = acc_t<scalar_t>;
  const scalar_t* add;       // [N, C] or nullptr: the norm of x + add (the prologue)
  const scalar_t* scale;     // [N, C] or nullptr: y * (1 + scale)
  const scalar_t* shift;     // [N, C] or nullptr: + shift
  const scalar_t* residual;  // y's layout and strides, or nullptr: added last
  int64_t C;                 // channels of a row of scale and shift
  A slope;                   // LeakyReLU's negative slope
  int activations;           // length of the chain, 0 to kMaxActivations
  uint32_t chain;            // activation i in bits 8i to 8i + 7 (Activation codes)
  bool residual_first;       // the residual added before the chain, not after
};

// The prologue: s = x + add[nc], rounded to scalar_t as torch's add rounds,
// what the kernels normalise in place of x; x itself without an add. The
// channels-last stream and team plans that keep less than their slice get s
// from a separate add instead (forward_fused in ops.cpp).
template <typename scalar_t, bool kFused>
__device__ __forceinline__ bool has_add(const Epilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    return ep.add != nullptr;
  } else {
    return false;
  }
}

template <typename scalar_t, bool kFused>
__device__ __forceinline__ scalar_t pre_norm(scalar_t x, int64_t nc,
                                             const Epilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    using A = acc_t<scalar_t>;
    if (ep.add != nullptr) return static_cast<scalar_t>(static_cast<A>(x) + static_cast<A>(ep.add[nc]));
  }
  return x;
}

// x + a rounded to scalar_t as torch's add rounds it: in acc_t, then once
// to scalar_t. Half and bfloat16 lanes go two an instruction (HADD2), which
// rounds the exact sum once: the same value, as float's 24 bits are at least
// 2p + 2 for their p of 11 and 8 bits. The registers kernel keeps pre_norm:
// there this form took 15-16 more registers.
template <typename scalar_t, int V>
__device__ __forceinline__ Vec<scalar_t, V> rounded_sum(const Vec<scalar_t, V>& x,
                                                        const Vec<scalar_t, V>& a) {
  Vec<scalar_t, V> s;
  if constexpr (sizeof(scalar_t) == 2 && V % 2 == 0) {
    using Pair = std::conditional_t<std::is_same_v<scalar_t, c10::Half>, __half2, __nv_bfloat162>;
#pragma unroll
    for (int e = 0; e < V; e += 2) {
      Pair px, pa;
      memcpy(&px, &x.val[e], sizeof(Pair));
      memcpy(&pa, &a.val[e], sizeof(Pair));
      const Pair ps = __hadd2(px, pa);
      memcpy(&s.val[e], &ps, sizeof(Pair));
    }
  } else {
    using A = acc_t<scalar_t>;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      s.val[e] = static_cast<scalar_t>(static_cast<A>(x.val[e]) + static_cast<A>(a.val[e]));
    }
  }
  return s;
}

// V lanes of one channel nc (the contiguous layout).
template <typename scalar_t, int V, bool kFused>
__device__ __forceinline__ Vec<scalar_t, V> pre_norm_vec(const Vec<scalar_t, V>& v, int64_t nc,
                                                         const Epilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    if (ep.add != nullptr) {
      Vec<scalar_t, V> a;
#pragma unroll
      for (int e = 0; e < V; ++e) a.val[e] = ep.add[nc];
      return rounded_sum(v, a);
    }
  }
  return v;
}

// y = (x - mean) * scale + shift for one channel, with scale = rstd * gamma[c]
// and shift = beta[c], or with the epilogue's scale and shift folded in.
// Subtracting the mean first keeps shifted inputs accurate (x * scale +
// (shift - mean * scale) would cancel).
template <typename A>
struct ChannelAffine {
  A scale, shift;
};

// Channel c, without an epilogue.
template <typename scalar_t, typename A>
__device__ __forceinline__ ChannelAffine<A> channel_affine(int64_t c, A rstd,
                                                           const scalar_t* __restrict__ gamma,
                                                           const scalar_t* __restrict__ beta) {
  return {gamma != nullptr ? rstd * static_cast<A>(gamma[c]) : rstd,
          beta != nullptr ? static_cast<A>(beta[c]) : A(0)};
}

// Channel c of sample n with the epilogue's scale and shift: rstd * gamma[c]
// * (1 + scale[n, c]) and beta[c] * (1 + scale[n, c]) + shift[n, c]; one
// test of the pointers, nothing more without them.
template <typename scalar_t, typename A, bool kFused>
__device__ __forceinline__ ChannelAffine<A> channel_affine(int64_t n, int64_t c, A rstd,
                                                           const scalar_t* __restrict__ gamma,
                                                           const scalar_t* __restrict__ beta,
                                                           const Epilogue<scalar_t, kFused>& ep) {
  ChannelAffine<A> f = channel_affine(c, rstd, gamma, beta);
  if constexpr (kFused) {
    if (ep.scale != nullptr || ep.shift != nullptr) {
      const int64_t nc = n * ep.C + c;
      const A s = ep.scale != nullptr ? A(1) + static_cast<A>(ep.scale[nc]) : A(1);
      const A t = ep.shift != nullptr ? static_cast<A>(ep.shift[nc]) : A(0);
      f.scale *= s;
      f.shift = f.shift * s + t;
    }
  }
  return f;
}

// The affine value of x, in the accumulation type.
template <typename scalar_t, typename A>
__device__ __forceinline__ A affine_value(scalar_t x, A mean, ChannelAffine<A> f) {
  return (static_cast<A>(x) - mean) * f.scale + f.shift;
}

template <typename scalar_t, typename A>
__device__ __forceinline__ scalar_t normalise(scalar_t x, A mean, ChannelAffine<A> f) {
  return static_cast<scalar_t>(affine_value(x, mean, f));
}

// A vector of one channel (the contiguous layout), without an epilogue.
template <typename scalar_t, int V, typename A>
__device__ __forceinline__ Vec<scalar_t, V> normalise_vec(const Vec<scalar_t, V>& v, A mean,
                                                          ChannelAffine<A> f) {
  Vec<scalar_t, V> out;
#pragma unroll
  for (int e = 0; e < V; ++e) out.val[e] = normalise(v.val[e], mean, f);
  return out;
}

// 1 / (1 + exp(-v)): in float by the SFU's 2^x and reciprocal, flushing
// subnormals (a few ulp, as Inductor's sigmoid; 1 + 2^x is at least 1, so
// only the tails flush, to 0 and 1), five instructions without a branch; in
// double as torch's.
template <typename A>
__device__ __forceinline__ A logistic(A v) {
  if constexpr (std::is_same_v<A, float>) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.4426950408889634f));
    return __fdividef(1.0f, 1.0f + e);
  } else {
    return A(1) / (A(1) + exp(-v));
  }
}

// One activation, as torch.nn.functional computes it on CUDA in the
// accumulation type (float, or double for double), NaN and inf propagating
// alike; SiLU and sigmoid through logistic.
template <typename A>
__device__ __forceinline__ A activation(Activation a, A v, A slope) {
  switch (a) {
    case Activation::SiLU:
      return v * logistic(v);
    case Activation::GELU:
      return v * A(0.5) * (A(1) + erf(v * A(M_SQRT1_2)));
    case Activation::GELUTanh: {
      const A inner = A(M_SQRT2 * M_2_SQRTPI * 0.5) * (v + A(0.044715) * (v * v * v));
      return A(0.5) * v * (A(1) + tanh(inner));
    }
    case Activation::ReLU:
      return v < A(0) ? A(0) : v;
    case Activation::LeakyReLU:
      return v > A(0) ? v : v * slope;
    case Activation::Tanh:
      return tanh(v);
    case Activation::Sigmoid:
      return logistic(v);
    case Activation::Hardswish: {
      // torch's CUDA kernel multiplies by 1/6 rounded to float, for double too
      const A clipped = v + A(3) < A(0) ? A(0) : v + A(3);
      return v * (A(6) < clipped ? A(6) : clipped) * A(1.0f / 6.0f);
    }
    case Activation::Mish:
      return v * tanh(log1p(exp(v)));
  }
  return v;
}

// V values of the accumulation type, passed to and returned from activate
// in registers.
template <typename A, int V>
struct Lanes {
  A v[V];
};

// Activation kA on every lane: one switch a vector, V independent chains of
// arithmetic for the scheduler to interleave.
template <Activation kA, typename A, int V>
__device__ __forceinline__ void activate_lanes(Lanes<A, V>& l, A slope) {
#pragma unroll
  for (int e = 0; e < V; ++e) l.v[e] = activation(kA, l.v[e], slope);
}

// The chain, in order, on a stored vector. One function per type and width,
// called, not inlined: inlined into every store of every kernel it took
// registers from the whole kernel (the registers kernel spilled) and
// doubled the build; called per element it cost a call, a switch and the
// caller's saved registers for each value.
template <typename A, int V>
__device__ __noinline__ Lanes<A, V> activate(Lanes<A, V> l, uint32_t chain, int count, A slope) {
  for (int i = 0; i < count; ++i, chain >>= 8) {
    switch (Activation(chain & 0xffu)) {
      case Activation::SiLU: activate_lanes<Activation::SiLU>(l, slope); break;
      case Activation::GELU: activate_lanes<Activation::GELU>(l, slope); break;
      case Activation::GELUTanh: activate_lanes<Activation::GELUTanh>(l, slope); break;
      case Activation::ReLU: activate_lanes<Activation::ReLU>(l, slope); break;
      case Activation::LeakyReLU: activate_lanes<Activation::LeakyReLU>(l, slope); break;
      case Activation::Tanh: activate_lanes<Activation::Tanh>(l, slope); break;
      case Activation::Sigmoid: activate_lanes<Activation::Sigmoid>(l, slope); break;
      case Activation::Hardswish: activate_lanes<Activation::Hardswish>(l, slope); break;
      case Activation::Mish: activate_lanes<Activation::Mish>(l, slope); break;
    }
  }
  return l;
}

// V elements of the residual, read once: through the read-only path, which
// lets the loads move ahead of the kernel's stores.
template <typename scalar_t, int V>
__device__ __forceinline__ Vec<scalar_t, V> load_residual(const scalar_t* p) {
  using VecT = Vec<scalar_t, V>;
  VecT v;
  if constexpr (sizeof(VecT) == 16) {
    const float4 w = __ldg(reinterpret_cast<const float4*>(p));
    memcpy(&v, &w, sizeof(VecT));
  } else if constexpr (sizeof(VecT) == 8) {
    const float2 w = __ldg(reinterpret_cast<const float2*>(p));
    memcpy(&v, &w, sizeof(VecT));
  } else if constexpr (sizeof(VecT) == 4) {
    const float w = __ldg(reinterpret_cast<const float*>(p));
    memcpy(&v, &w, sizeof(VecT));
  } else {
    const unsigned short w = __ldg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&v, &w, sizeof(VecT));
  }
  return v;
}

// Adds the residual's vector at p to v.
template <typename scalar_t, int V>
__device__ __forceinline__ void add_residual(acc_t<scalar_t> (&v)[V], const scalar_t* p) {
  const Vec<scalar_t, V> r = load_residual<scalar_t, V>(p);
#pragma unroll
  for (int e = 0; e < V; ++e) v[e] += static_cast<acc_t<scalar_t>>(r.val[e]);
}

// Writes y[at, at + V) from the affine values v: the activation chain, the
// residual at the same offset (before the chain with residual_first), then
// the rounding to scalar_t. kStore: the kernel's store kind (Bare, SiLU and
// ReLU test nothing per vector, Any every option). kCalls: whether a chain
// other than SiLU or ReLU alone may come, through the call; a kernel built
// without it is never planned for one (EpilogueArgs::inline_chain).
// kResidualFirst: whether a residual before the chain may come; the stream
// kernels, at their register bound, are built without it and never launched
// with one (forward_fused splits such a call).
template <typename scalar_t, int V, bool kFused, bool kCalls = true, bool kResidualFirst = true,
          Store kStore = Store::Any>
__device__ __forceinline__ void store_output(scalar_t* __restrict__ y, int64_t at,
                                             acc_t<scalar_t> (&v)[V],
                                             const Epilogue<scalar_t, kFused>& ep) {
  using A = acc_t<scalar_t>;
  if constexpr (kStore == Store::SiLU || kStore == Store::ReLU) {
    constexpr Activation kA = kStore == Store::SiLU ? Activation::SiLU : Activation::ReLU;
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = activation(kA, v[e], A(0));
  } else if constexpr (kFused && kStore == Store::Any) {
    const bool first = kResidualFirst && ep.residual_first;
    if (first) add_residual<scalar_t, V>(v, ep.residual + at);
    // SiLU (diffusion models) and ReLU (timm, MONAI) alone inline; other
    // chains through the call, which costs its caller saved registers
    if (ep.activations == 1 && ep.chain == uint32_t(Activation::SiLU)) {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = activation(Activation::SiLU, v[e], ep.slope);
    } else if (ep.activations == 1 && ep.chain == uint32_t(Activation::ReLU)) {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = activation(Activation::ReLU, v[e], ep.slope);
    } else if (ep.activations > 0) {
      if constexpr (kCalls) {
        Lanes<A, V> l;
#pragma unroll
        for (int e = 0; e < V; ++e) l.v[e] = v[e];
        l = activate(l, ep.chain, ep.activations, ep.slope);
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = l.v[e];
      } else {
        __trap();  // a planning error: loud, never a wrong answer
      }
    }
    if (ep.residual != nullptr && !first) add_residual<scalar_t, V>(v, ep.residual + at);
  }
  Vec<scalar_t, V> out;
#pragma unroll
  for (int e = 0; e < V; ++e) out.val[e] = static_cast<scalar_t>(v[e]);
  store_vec_streaming<scalar_t, V>(y + at, out);
}

// A vector of one channel (the contiguous layout) normalised, then the
// epilogue, stored at y + at.
template <typename scalar_t, int V, bool kResidualFirst, Store kStore, typename A, bool kFused>
__device__ __forceinline__ void normalise_store(scalar_t* __restrict__ y, int64_t at,
                                                const Vec<scalar_t, V>& v, A mean,
                                                ChannelAffine<A> f,
                                                const Epilogue<scalar_t, kFused>& ep) {
  A out[V];
#pragma unroll
  for (int e = 0; e < V; ++e) out[e] = affine_value(v.val[e], mean, f);
  store_output<scalar_t, V, kFused, true, kResidualFirst, kStore>(y, at, out, ep);
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

// Lane e's sum of g and of g * (v - mu) over one vector of dy (g) and one
// of x (v), added to s_dy[e] and s_dyx[e]: the channels-last sums, V
// channels a thread.
template <typename scalar_t, int V, typename A>
__device__ __forceinline__ void add_lane_sums(const Vec<scalar_t, V>& g, const Vec<scalar_t, V>& v,
                                              A mu, A (&s_dy)[V], A (&s_dyx)[V]) {
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const A d = static_cast<A>(g.val[e]);
    s_dy[e] += d;
    s_dyx[e] += d * (static_cast<A>(v.val[e]) - mu);
  }
}

}  // namespace groupnorm
