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
//
// With kFused it is the backward of the fused forward as the passes are
// (backward_epilogue.cuh): an entry adds g = dy * act'(z), g * (s - mean)
// and s - mean, each channel's sums give dshift, dscale and, scaled by
// (1 + scale), the group's; dadd follows the dx coefficients. A chain the
// passes do not take back inline reaches it as the chain kernel's g. The
// recompute takes about twice the registers: half the threads a CTA. The
// sums round g to x's dtype (as torch's own activation backward, whose
// output is a tensor of it, does) and hold it in place of dy, so that dx
// does not take the activation's derivative a second time.
#pragma once

#include "backward_passes.cuh"

namespace groupnorm {

// The threads a CTA at most: 64 registers a thread for the plain kernel, 128
// for the fused one (one CTA an SM at most: the compiler otherwise gives
// single-element vectors 32 registers, and spills).
template <bool kFused>
__host__ __device__ constexpr int backward_registers_max_threads() {
  return kFused ? kFusedBackwardRegistersMaxThreads : kBackwardRegistersMaxThreads;
}

// For W lanes of one channel whose Recompute is r: dy's gradient through
// the epilogue (kFused; dy itself otherwise) in grad, x (s) minus the mean
// in centred.
template <typename scalar_t, int W, bool kFused>
__device__ __forceinline__ void gradient_lanes(const Vec<scalar_t, W>& d, const Vec<scalar_t, W>& v,
                                               const Recompute<acc_t<scalar_t>>& r,
                                               const BackwardEpilogue<scalar_t, kFused>& ep,
                                               acc_t<scalar_t> (&centred)[W],
                                               acc_t<scalar_t> (&grad)[W]) {
  if constexpr (kFused) {
    recompute_lanes<scalar_t, W>(d, v, ep, [&](int) { return r; }, centred, grad);
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) {
      grad[e] = static_cast<acc_t<scalar_t>>(d.val[e]);
      centred[e] = static_cast<acc_t<scalar_t>>(v.val[e]) - r.mu;
    }
  }
}

// Lane e of a held vector, as a vector of one.
template <typename scalar_t, int V>
__device__ __forceinline__ Vec<scalar_t, 1> lane_of(const RawVec<scalar_t, V>& held, int e) {
  Vec<scalar_t, 1> out;
  out.val[0] = as_vec<Vec<scalar_t, V>>(held).val[e];
  return out;
}

template <typename scalar_t, int V, bool kFused>
__global__ void
__launch_bounds__(backward_registers_max_threads<kFused>(), 1) groupnorm_backward_registers_kernel(
    const scalar_t* __restrict__ dy,             // x's layout (with a chain: its g)
    const scalar_t* __restrict__ x,              // [N, C, HxW] or [N, HxW, C]
    const acc_t<scalar_t>* __restrict__ mean,    // [N, G]
    const acc_t<scalar_t>* __restrict__ rstd,    // [N, G]
    const scalar_t* __restrict__ gamma,          // [C] or nullptr
    acc_t<scalar_t>* __restrict__ affine_pairs,  // [N, C, 2], or nullptr: dgamma, dbeta not wanted
    scalar_t* __restrict__ dx,                   // x's layout, or nullptr (not wanted)
    int64_t N, int HxW, int64_t C, int G, int D, bool channels_last,
    const BackwardEpilogue<scalar_t, kFused> ep) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  constexpr int K = kBackwardRegistersItems;
  constexpr int kSums = kFused ? 3 : 2;  // an entry: sum(g), sum(g * (s - mean)), sum(s - mean)
  extern __shared__ __align__(16) unsigned char smem[];
  A* entries = reinterpret_cast<A*>(smem);  // [entries][kSums], see above
  __shared__ A scratch[2 * backward_registers_max_threads<kFused>() / kWarp];
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
  const bool x_sums = wants_add_gradient(ep);
  // Offset of vector i from the unit's first element (a channels-last row's
  // can pass 2^31).
  const auto offset = [&](int i) -> int64_t {
    if (!channels_last) return int64_t(i) * V;
    const int r = i / cols;
    return int64_t(r) * C + (i - r * cols) * V;
  };
  const auto weight = [&](int64_t c) { return gamma != nullptr ? static_cast<A>(gamma[c]) : A(1); };
  const auto store_sums = [&](int entry, A s_dy, A s_dyx, A s_x) {
    store_pair(entries + kSums * entry, s_dy, s_dyx);
    if (kFused && x_sums) entries[kSums * entry + 2] = s_x;
  };

  for (int64_t unit = blockIdx.x; unit < N * G; unit += gridDim.x) {
    const int64_t n = unit / G;
    const int g = int(unit - n * G);
    const int64_t base = channels_last ? n * HxW * C + int64_t(g) * D : unit * L;
    const int64_t c_first = int64_t(g) * D;
    // the first channel of vector i (channels-last: of its first lane)
    const auto channel = [&](int i) -> int64_t {
      return channels_last ? c_first + (i % cols) * V : c_first + i / (HxW / V);
    };
    const A mu = mean[unit];
    const A rs = rstd[unit];
    // What the forward computed channel c's z from (the mean alone for the
    // plain kernel), read once a vector (contiguous) or once a lane of the
    // thread's column (channels-last), never per element: each vector of the
    // contiguous layout lies in one channel; channels-last sums walk lane by
    // lane over the thread's vectors, and dx keeps each lane's scale and add.
    const auto recompute = [&](int64_t c) -> Recompute<A> {
      if constexpr (kFused) {
        const A add = ep.forward.add != nullptr ? static_cast<A>(ep.forward.add[n * C + c]) : A(0);
        return {add, mu, channel_affine(n, c, rs, gamma, ep.beta, ep.forward)};
      } else {
        return {A(0), mu, {}};
      }
    };

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
        A centred[V], grad[V];
        gradient_lanes<scalar_t, V>(as_vec<VecT>(held_dy[k]), as_vec<VecT>(held_x[k]),
                                    recompute(channel(i)), ep, centred, grad);
        A s_dy = 0, s_dyx = 0, s_x = 0;
        VecT g_v;  // kFused: g in x's dtype, held for dx in place of dy
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if constexpr (kFused) {
            g_v.val[e] = static_cast<scalar_t>(grad[e]);
            grad[e] = static_cast<A>(g_v.val[e]);
            s_x += centred[e];
          }
          s_dy += grad[e];
          s_dyx += grad[e] * centred[e];
        }
        if constexpr (kFused) held_dy[k] = as_vec<Raw>(g_v);
        store_sums(i, s_dy, s_dyx, s_x);
      }
    } else if constexpr (kFused) {  // lane by lane: one channel's values at a time
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const Recompute<A> r = recompute(channel(tid) + e);
        A s_dy = 0, s_dyx = 0, s_x = 0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (tid + k * step >= nvec) continue;
          A centred[1], grad[1];
          gradient_lanes<scalar_t, 1>(lane_of<scalar_t, V>(held_dy[k], e),
                                      lane_of<scalar_t, V>(held_x[k], e), r, ep, centred, grad);
          VecT g_v = as_vec<VecT>(held_dy[k]);  // g in x's dtype, held for dx in place of dy
          g_v.val[e] = static_cast<scalar_t>(grad[0]);
          held_dy[k] = as_vec<Raw>(g_v);
          grad[0] = static_cast<A>(g_v.val[e]);
          s_dy += grad[0];
          s_dyx += grad[0] * centred[0];
          s_x += centred[0];
        }
        store_sums(tid * V + e, s_dy, s_dyx, s_x);
      }
    } else {  // vector by vector, V sums a thread
      A s_dy[V], s_dyx[V];
#pragma unroll
      for (int e = 0; e < V; ++e) s_dy[e] = s_dyx[e] = 0;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (tid + k * step >= nvec) continue;
        add_lane_sums(as_vec<VecT>(held_dy[k]), as_vec<VecT>(held_x[k]), mu, s_dy, s_dyx);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) store_sums(tid * V + e, s_dy[e], s_dyx[e], A(0));
    }
    __syncthreads();  // the table is written

    // Warp w adds channels w, w + warps, ...; lane 0 keeps the gamma-weighted
    // group sums of those it added.
    const int count = channels_last ? step / cols : HxW / V;  // entries a channel
    const int first_stride = channels_last ? 1 : HxW / V;
    const int entry_stride = channels_last ? D : 1;
    A s1 = 0, s2 = 0;
    for (int d = warp; d < D; d += warps) {
      A t_dy = 0, t_dyx = 0, t_x = 0;
      for (int j = lane; j < count; j += kWarp) {
        const A* sums = entries + kSums * (d * first_stride + j * entry_stride);
        t_dy += sums[0];
        t_dyx += sums[1];
        if (kFused && x_sums) t_x += sums[2];
      }
      t_dy = warp_sum(t_dy);
      t_dyx = warp_sum(t_dyx);
      if (kFused && x_sums) t_x = warp_sum(t_x);
      if (lane == 0) {
        const int64_t c = c_first + d;
        const int64_t nc = n * C + c;
        if constexpr (kFused) {  // as unit_coefficients (backward_passes.cuh)
          const A m = store_scale_shift_gradients(ep, n, c, weight(c), rs, t_dy, t_dyx);
          t_dy *= m;
          t_dyx *= m;
          if (x_sums) store_pair(ep.channel_sums + nc * 2, weight(c) * t_dy, t_x);
        }
        if (affine_pairs != nullptr) store_pair(affine_pairs + nc * 2, t_dy, t_dyx * rs);
        s1 += weight(c) * t_dy;
        s2 += weight(c) * t_dyx;
      }
    }
    if (dx != nullptr || x_sums) {  // the same in every thread
      block_sums(scratch, s1, s2);  // its barriers also publish the channel sums stored above
      const A M = A(L);
      const A k1 = rs * s1 / M;
      const A k2 = rs * rs * rs * s2 / M;
      if constexpr (kFused) {
        if (x_sums) {
          for (int d = tid; d < D; d += step) {
            const int64_t nc = n * C + c_first + d;
            const A* sums = ep.channel_sums + nc * 2;
            ep.dadd[nc] = static_cast<scalar_t>(rs * sums[0] - A(HxW) * k1 - k2 * sums[1]);
          }
        }
      }
      if (dx != nullptr) {
        if constexpr (kFused) {
          // g is held in place of dy: dx = alpha * g - k1 - (s - mean) * k2,
          // alpha the folded affine's scale rstd * gamma * (1 + scale), s
          // formed again from x and add; the lanes' values read once a
          // thread (channels-last: a channel each) or a vector (contiguous:
          // one channel for all)
          A alpha[V], lane_add[V];
          const auto lanes_of = [&](int64_t c, bool one_channel) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
              if (one_channel && e > 0) {
                alpha[e] = alpha[0];
                lane_add[e] = lane_add[0];
                continue;
              }
              const Recompute<A> r = recompute(c + e);
              alpha[e] = r.f.scale;
              lane_add[e] = r.add;
            }
          };
          if (channels_last) lanes_of(channel(tid), false);
#pragma unroll
          for (int k = 0; k < K; ++k) {
            const int i = tid + k * step;
            if (i >= nvec) continue;
            if (!channels_last) lanes_of(channel(i), true);
            const VecT x_v = as_vec<VecT>(held_x[k]);
            VecT s_v = x_v;
            if (ep.forward.add != nullptr) {
#pragma unroll
              for (int e = 0; e < V; ++e) {
                s_v.val[e] = static_cast<scalar_t>(static_cast<A>(x_v.val[e]) + lane_add[e]);
              }
            }
            store_vec_streaming<scalar_t, V>(
                dx + base + offset(i),
                dx_vec<scalar_t, V>(as_vec<VecT>(held_dy[k]), s_v,
                                    [&](int e) { return Coef<A>{alpha[e], mu, k1, k2}; }));
          }
        } else {
#pragma unroll
          for (int k = 0; k < K; ++k) {
            const int i = tid + k * step;
            if (i >= nvec) continue;
            const int64_t c = channel(i);
            const auto coef = [&](int e) {
              return Coef<A>{rs * weight(channels_last ? c + e : c), mu, k1, k2};
            };
            store_vec_streaming<scalar_t, V>(
                dx + base + offset(i),
                dx_vec<scalar_t, V>(as_vec<VecT>(held_dy[k]), as_vec<VecT>(held_x[k]), coef));
          }
        }
      }
    }
    __syncthreads();  // the table is read: the next unit may write it
  }
}

}  // namespace groupnorm
