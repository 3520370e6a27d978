// GroupNorm backward for small groups, either layout, in one launch (and the
// affine kernel after it when dgamma and dbeta are wanted): one CTA per
// (sample, group) holds the group's x and dy in registers, at most
// kBackwardRegistersItems vectors of each a thread, from its one read of them
// to its one write of dx. The passes (backward_passes.cuh) take four
// launches for the same: a small input's backward is their latency, not its
// bytes.
//
// The per-channel sums (dgamma, dbeta and, weighted by gamma, the dx
// coefficients) are added in a fixed order through a shared table of
// entries, each a pair (sum(dy), sum(dy * (x - mean))):
//   contiguous    one entry per vector (a vector lies in one channel);
//                 channel d's entries are d * HxW / V .. (d + 1) * HxW / V - 1.
//   channels-last one entry per (thread, lane): blockDim.x is a multiple of
//                 the D / V vectors of a row, so a thread's vectors all lie
//                 in one column and it adds its lanes' sums in registers;
//                 channel d's entries are d, d + D, d + 2D, ...
// A warp then adds each channel's entries, so no atomics: results do not
// depend on timing. The planner keeps the table and the static scratch
// within the shared memory a block gets without opting in to more.
#pragma once

#include "backward_passes.cuh"

namespace groupnorm {

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBackwardRegistersMaxThreads) groupnorm_backward_registers_kernel(
    const scalar_t* __restrict__ dy,             // x's layout
    const scalar_t* __restrict__ x,              // [N, C, HxW] or [N, HxW, C]
    const acc_t<scalar_t>* __restrict__ mean,    // [N, G]
    const acc_t<scalar_t>* __restrict__ rstd,    // [N, G]
    const scalar_t* __restrict__ gamma,          // [C] or nullptr
    acc_t<scalar_t>* __restrict__ affine_pairs,  // [N, C, 2], or nullptr: dgamma, dbeta not wanted
    scalar_t* __restrict__ dx,                   // x's layout, or nullptr (not wanted)
    int64_t N, int HxW, int64_t C, int G, int D, bool channels_last) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  constexpr int K = kBackwardRegistersItems;
  extern __shared__ __align__(16) unsigned char smem[];
  A* entries = reinterpret_cast<A*>(smem);  // [entries][2], see above
  __shared__ A scratch[2 * kBackwardRegistersMaxThreads / kWarp];
  griddep_release();  // the affine kernel may launch
  // The host guarantees L <= blockDim.x * K * V, HxW % V == 0 (contiguous),
  // D % V == 0 and blockDim.x % (D / V) == 0 (channels-last).
  const int L = D * HxW;
  const int nvec = L / V;
  const int cols = D / V;  // channels-last: vectors in one row of the unit
  const int tid = threadIdx.x;
  const int step = blockDim.x;
  const int warp = tid / kWarp;
  const int lane = tid % kWarp;
  const int warps = step / kWarp;
  // Offset of vector i from the unit's first element (a channels-last row's
  // can pass 2^31).
  const auto offset = [&](int i) -> int64_t {
    if (!channels_last) return int64_t(i) * V;
    const int r = i / cols;
    return int64_t(r) * C + (i - r * cols) * V;
  };
  const auto weight = [&](int64_t c) { return gamma != nullptr ? static_cast<A>(gamma[c]) : A(1); };

  for (int64_t unit = blockIdx.x; unit < N * G; unit += gridDim.x) {
    const int64_t n = unit / G;
    const int g = int(unit - n * G);
    const int64_t base = channels_last ? n * HxW * C + int64_t(g) * D : unit * L;
    const int64_t c_first = int64_t(g) * D;
    const A mu = mean[unit];
    const A rs = rstd[unit];

    Raw held_dy[K], held_x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = tid + k * step;
      if (i < nvec) {
        held_dy[k] = *reinterpret_cast<const Raw*>(dy + base + offset(i));
        held_x[k] = *reinterpret_cast<const Raw*>(x + base + offset(i));
      }
    }
    if (!channels_last) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = tid + k * step;
        if (i >= nvec) continue;
        const VecT g_v = as_vec<VecT>(held_dy[k]), x_v = as_vec<VecT>(held_x[k]);
        A s_dy = 0, s_dyx = 0;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const A d = static_cast<A>(g_v.val[e]);
          s_dy += d;
          s_dyx += d * (static_cast<A>(x_v.val[e]) - mu);
        }
        store_pair(entries + 2 * i, s_dy, s_dyx);
      }
    } else {
      A s_dy[V], s_dyx[V];
#pragma unroll
      for (int e = 0; e < V; ++e) s_dy[e] = s_dyx[e] = 0;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (tid + k * step >= nvec) continue;
        const VecT g_v = as_vec<VecT>(held_dy[k]), x_v = as_vec<VecT>(held_x[k]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const A d = static_cast<A>(g_v.val[e]);
          s_dy[e] += d;
          s_dyx[e] += d * (static_cast<A>(x_v.val[e]) - mu);
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) store_pair(entries + 2 * (tid * V + e), s_dy[e], s_dyx[e]);
    }
    __syncthreads();  // the table is written

    // Warp w adds channels w, w + warps, ...; lane 0 keeps the gamma-weighted
    // group sums of those it added.
    const int count = channels_last ? step / cols : HxW / V;  // entries a channel
    const int first_stride = channels_last ? 1 : HxW / V;
    const int entry_stride = channels_last ? D : 1;
    A s1 = 0, s2 = 0;
    for (int d = warp; d < D; d += warps) {
      A t_dy = 0, t_dyx = 0;
      for (int j = lane; j < count; j += kWarp) {
        const A* pair = entries + 2 * (d * first_stride + j * entry_stride);
        t_dy += pair[0];
        t_dyx += pair[1];
      }
      t_dy = warp_sum(t_dy);
      t_dyx = warp_sum(t_dyx);
      if (lane == 0) {
        const int64_t c = c_first + d;
        if (affine_pairs != nullptr) store_pair(affine_pairs + (n * C + c) * 2, t_dy, t_dyx * rs);
        s1 += weight(c) * t_dy;
        s2 += weight(c) * t_dyx;
      }
    }
    if (dx != nullptr) {  // the same in every thread
      block_sums(scratch, s1, s2);
      const A M = A(L);
      const A k1 = rs * s1 / M;
      const A k2 = rs * rs * rs * s2 / M;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = tid + k * step;
        if (i >= nvec) continue;
        const int64_t c = channels_last ? c_first + (i % cols) * V : c_first + i / (HxW / V);
        const auto coef = [&](int e) {
          return Coef<A>{rs * weight(channels_last ? c + e : c), mu, k1, k2};
        };
        store_vec_streaming<scalar_t, V>(
            dx + base + offset(i),
            dx_vec<scalar_t, V>(as_vec<VecT>(held_dy[k]), as_vec<VecT>(held_x[k]), coef));
      }
    }
    __syncthreads();  // the table is read: the next unit may write it
  }
}

}  // namespace groupnorm
