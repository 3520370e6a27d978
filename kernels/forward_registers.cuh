// GroupNorm forward for small units, either layout: one CTA per unit (sample,
// group) that holds the whole unit in registers, at most K vectors per thread,
// from its one read of x to its one write of y. 16-bit vectors are held as
// 32-bit words (Words): unpacked, each element would take a register of its
// own.
//
// Small shapes are bound by latency, not bandwidth: a few microseconds of
// launch, one DRAM round trip and the barriers between the sweeps. This
// kernel has no shared slice, no team and no workspace to clear; its only
// barriers are the two block sums (the shifted sum, then the centred sum of
// squares). A channels-last unit is HxW rows of D channels, C apart, so each
// CTA reads only its own group's columns and the team barrier of the
// channels-last kernel (whose unit is a whole sample) is not needed.
//
// A group too large for one CTA is shared by a thread-block cluster (sm_90+)
// of `ranks` CTAs, which the hardware schedules together: each CTA sums its
// part, publishes the sum in its shared memory, and every CTA adds the
// cluster's sums in rank order through distributed shared memory, so all of
// them normalise with the same bits. Still one read of x and no workspace.
//
// With kFused it also takes the epilogue's inline forms (epilogue.cuh): the
// (N, C) add as it loads x, scale and shift folded into the channel affine,
// SiLU or ReLU alone, the residual. Not the called activation chains: their
// call costs its caller saved registers, which this kernel, holding its
// group in registers, has none to spare for (the planner gives them other
// kernels).
#pragma once

#include <cooperative_groups.h>

#include "epilogue.cuh"
#include "reduce.cuh"

namespace groupnorm {

// The sum over the `ranks` CTAs of this CTA's cluster of one value per CTA
// (`block_total`, the same in every thread), added in rank order. `slot` is
// this CTA's shared variable for it, read by the others; the caller keeps a
// CTA's slots alive until every CTA of the cluster has read them (a final
// cluster barrier). A cluster barrier, which is also a block one, separates
// the publishing from the reading.
template <bool kClustered, typename A>
__device__ __forceinline__ A cluster_sum(A block_total, A* slot, int ranks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (kClustered && ranks > 1) {
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    if (threadIdx.x == 0) *slot = block_total;
    cluster.sync();
    A total = 0;
    for (int r = 0; r < ranks; ++r) total += *cluster.map_shared_rank(slot, r);
    return total;
  }
#else
  // Built without clusters: the host never launches ranks > 1 then
  // (active_clusters), and a launch that did would get a wrong sum here.
  if (kClustered && ranks > 1) __trap();
#endif
  return block_total;
}

template <bool kClustered>
__device__ __forceinline__ void cluster_barrier(int ranks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (kClustered && ranks > 1) cooperative_groups::this_cluster().sync();
#endif
}

template <typename scalar_t, int V, int K, bool kFused, Store kStore>
__global__ void __launch_bounds__(kRegistersMaxThreads) groupnorm_forward_registers_kernel(
    const scalar_t* __restrict__ x,      // [N, C, HxW] or [N, HxW, C]
    const scalar_t* __restrict__ gamma,  // [C] or nullptr
    const scalar_t* __restrict__ beta,   // [C] or nullptr
    scalar_t* __restrict__ y,            // x's layout
    acc_t<scalar_t>* __restrict__ mean,  // [N, G]
    acc_t<scalar_t>* __restrict__ rstd,  // [N, G]
    const Epilogue<scalar_t, kFused> ep,  // no called chain (the planner)
    int64_t units, int HxW, int64_t C, int G, int D, bool channels_last, int ranks,
    acc_t<scalar_t> eps) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  __shared__ A scratch[kRegistersMaxThreads / kWarp];
  __shared__ A cluster_slots[2];  // this CTA's sum and M2, read by its cluster
  // The host guarantees L <= ranks * blockDim.x * K * V (so L fits an int),
  // HxW % V == 0 (contiguous) and D % V == 0 (channels-last), and launches
  // clusters of `ranks` CTAs (one CTA per group when ranks == 1).
  // CTA `rank` holds vectors rank * blockDim.x + threadIdx.x + k * step.
  // Only the many-items form runs in clusters: the cluster arithmetic cost the
  // few-items form registers (40 -> 64 for bfloat16) and the CTAs per SM that
  // its many small groups need.
  constexpr bool kClustered = K == kRegistersManyItems;
  const int clustered_ranks = kClustered ? ranks : 1;
  const int rank = kClustered ? int(blockIdx.x % clustered_ranks) : 0;
  const int first = rank * int(blockDim.x) + int(threadIdx.x);
  const int step = clustered_ranks * int(blockDim.x);
  const int L = D * HxW;
  const int nvec = L / V;
  const int cols = D / V;  // channels-last: vectors in one row of the unit
  // Offset of vector i from the unit's first element. A channels-last row
  // offset can pass 2^31 (HxW * C), so it is 64-bit.
  const auto offset = [&](int i) -> int64_t {
    if (!channels_last) return int64_t(i) * V;
    const int r = i / cols;
    return int64_t(r) * C + (i - r * cols) * V;
  };

  for (int64_t unit = blockIdx.x / clustered_ranks; unit < units;
       unit += gridDim.x / clustered_ranks) {
    const int64_t n = unit / G;
    const int g = int(unit - n * G);
    const int64_t base = channels_last ? n * HxW * C + int64_t(g) * D : unit * L;
    const scalar_t* xs = x + base;
    // Vector i's first channel in its group: a contiguous vector lies in one
    // channel, a channels-last one spans V.
    const auto channel = [&](int i) -> int64_t {
      return channels_last ? (i % cols) * V : i * V / HxW;
    };

    Raw raw[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = first + k * step;
      if (i < nvec) raw[k] = *reinterpret_cast<const Raw*>(xs + offset(i));
    }
    if (has_add(ep)) {  // hold s = x + add in place of x
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = first + k * step;
        if (i >= nvec) continue;
        const int64_t nc = n * C + int64_t(g) * D + channel(i);
        VecT s = as_vec<VecT>(raw[k]);
#pragma unroll
        for (int e = 0; e < V; ++e) s.val[e] = pre_norm(s.val[e], channels_last ? nc + e : nc, ep);
        raw[k] = as_vec<Raw>(s);
      }
    }
    // Calls f(value) for every element this thread holds.
    const auto for_each_held = [&](auto f) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (first + k * step < nvec) {
          const VecT v = as_vec<VecT>(raw[k]);
#pragma unroll
          for (int e = 0; e < V; ++e) f(static_cast<A>(v.val[e]));
        }
      }
    };
    // Summing x - x[0] keeps the float sum small for inputs far from zero.
    const A shift = static_cast<A>(pre_norm(xs[0], n * C + int64_t(g) * D, ep));
    A sum = 0;
    for_each_held([&](A value) { sum += value - shift; });
    const A mu =
        shift + cluster_sum<kClustered>(block_sum(sum, scratch), &cluster_slots[0], ranks) / A(L);
    A m2 = 0;
    for_each_held([&](A value) { m2 += (value - mu) * (value - mu); });
    const A rs = rsqrt(
        cluster_sum<kClustered>(block_sum(m2, scratch), &cluster_slots[1], ranks) / A(L) + eps);
    if (threadIdx.x == 0 && rank == 0) {
      mean[unit] = mu;
      rstd[unit] = rs;
    }

    const int64_t c_first = int64_t(g) * D;  // the group's first channel
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = first + k * step;
      if (i >= nvec) continue;
      const VecT v = as_vec<VecT>(raw[k]);
      const int64_t c = c_first + channel(i);
      if constexpr (kFused) {
        A out[V];
        if (!channels_last) {
          const ChannelAffine<A> f = channel_affine(n, c, rs, gamma, beta, ep);
#pragma unroll
          for (int e = 0; e < V; ++e) out[e] = affine_value(v.val[e], mu, f);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e)
            out[e] = affine_value(v.val[e], mu, channel_affine(n, c + e, rs, gamma, beta, ep));
        }
        store_output<scalar_t, V, kFused, false, true, kStore>(y, base + offset(i), out, ep);
      } else {
        VecT out;
        if (!channels_last) {
          out = normalise_vec<scalar_t, V>(v, mu, channel_affine(c, rs, gamma, beta));
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e)
            out.val[e] = normalise(v.val[e], mu, channel_affine(c + e, rs, gamma, beta));
        }
        store_vec_streaming<scalar_t, V>(y + base + offset(i), out);
      }
    }
    // The cluster's slots are read: they may be reused or freed.
    cluster_barrier<kClustered>(ranks);
  }
}

}  // namespace groupnorm
