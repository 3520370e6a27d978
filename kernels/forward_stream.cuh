// GroupNorm forward for contiguous (N, C, *) input in one launch that reads x
// from DRAM about once, for groups too large to keep on chip (KernelBench
// L1-35: 896 groups of 8 MiB).
//
// Every unit (sample, group) is cut into pieces of kStreamPieceVecs vectors.
// Each piece is visited twice: a statistics item (exact centred mean and M2
// of the piece) and, `lag` pieces later in the ticket order of stream.cuh,
// a normalise item, which should find the piece still in L2.
// A normalise item loads its piece, then learns its
// unit's mean and rstd in one of two ways (kEachMerges, host's choice):
//  - once: the CTA whose statistics item completes the unit merges the unit's
//    pieces in piece order (deterministic), writes mean and rstd and raises
//    the unit's ready flag, which the normalise items wait for;
//  - each: every normalise item waits until all statistics items of its unit
//    have arrived, then merges the unit's pieces itself, in the same order
//    (the same values: the same result); piece 0's item writes mean and rstd.
//    No item waits on another CTA's merge, which is what a normalise item
//    starting soon after its unit's last statistics item would do.
// No deadlock (stream.cuh): a statistics item waits only for its ring slot,
// freed by readers of an earlier unit that hold smaller tickets.
// Extra memory: three counters per unit (`ready` counts the readers done with
// its slot), and (mean, M2) per piece for `slots` units in a ring: unit u
// writes slot u % slots once unit u - slots has been read by all (slots cover
// the lag and the items in flight, so that wait is nearly always over before
// it starts). The ring holds about
// lag + 2 * grid + 2 * pieces pairs: O(N * G) plus a few pairs per piece
// (2048 vectors: 8192 float or 16384 half elements) of one group
// (KernelBench L1-35: 7 slots of 256 pairs).
#pragma once

#include "epilogue.cuh"
#include "reduce.cuh"
#include "stream.cuh"

namespace groupnorm {

// The channel of element `within` of a unit whose first channel is c0. A
// vector never straddles two channels (host: HxW % V == 0). Units under 2^31
// elements find it with a multiply and a shift.
__device__ __forceinline__ int64_t channel_at(int64_t within, int64_t c0, int64_t HxW,
                                              bool fast_div, const FastDivider& hxw_div) {
  return c0 + (fast_div ? int64_t(hxw_div.div(uint32_t(within))) : within / HxW);
}

// kEachMerges is a template argument: as a run-time flag, the unused merge
// costs the other mode registers.
template <typename scalar_t, int V, bool kEachMerges, bool kFused, Store kStore>
__global__ void __launch_bounds__(kStreamThreads, kStreamBlocksPerSm)
    groupnorm_stream_kernel(const scalar_t* __restrict__ x,         // [units, L]
                            const scalar_t* __restrict__ gamma,     // [C] or nullptr
                            const scalar_t* __restrict__ beta,      // [C] or nullptr
                            scalar_t* __restrict__ y,               // [units, L]
                            acc_t<scalar_t>* __restrict__ mean,     // [units]
                            acc_t<scalar_t>* __restrict__ rstd,     // [units]
                            const Epilogue<scalar_t, kFused> ep,    // scale, shift [N, C]
                            acc_t<scalar_t>* __restrict__ partial,  // [slots, pieces, 2]
                            StreamWorkspace ws, int64_t L, int64_t HxW, int G, int D,
                            int64_t pieces, int64_t slots, StreamOrder order, FastDivider hxw_div,
                            bool fast_div, acc_t<scalar_t> eps) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  constexpr int kItems = kStreamItems;
  constexpr int kPieceVecs = kStreamPieceVecs;
  __shared__ A scratch[3 * kStreamThreads / kWarp];
  __shared__ long long ticket[2];  // the current and the next item
  __shared__ A unit_mean, unit_rstd;
  __shared__ bool completes_unit;
  const int tid = threadIdx.x;
  const int64_t nvec_unit = L / V;  // host: HxW % V == 0
  const int64_t tickets = 2 * order.total;
  const SliceCounts<A> count_of{int64_t(kPieceVecs) * V, L, 1};
  const int readers = kEachMerges ? int(pieces) : 1;  // of a unit's ring slot

  if (tid == 0) ticket[0] = (long long)atomicAdd(ws.next, 1ull);
  // Thread 0's claim of the next ticket, stored for the block only at the
  // item's end: stored at once, warp 0 (and so the block, at its first
  // barrier) would wait for the atomic before the item's loads went out.
  long long next_ticket = 0;
  __syncthreads();
  for (int cur = 0;; cur ^= 1) {
    const int64_t t = ticket[cur];
    if (t >= tickets) break;
    // The next ticket's latency hides behind this item; it is read after
    // this item's last barrier.
    if (tid == 0) next_ticket = (long long)atomicAdd(ws.next, 1ull);
    int64_t b;
    const bool stats = order.item(t, b);
    const int64_t unit = b / pieces;
    const int64_t begin = (b % pieces) * kPieceVecs;
    const int64_t count = min(int64_t(kPieceVecs), nvec_unit - begin);
    const VecT* xs = reinterpret_cast<const VecT*>(x + unit * L) + begin;
    const Raw* xr = reinterpret_cast<const Raw*>(xs);
    Raw v[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t i = int64_t(u) * kStreamThreads + tid;
      if (i < count) {
        v[u] = load_with_l2_priority(xr + i, stats);
      }
    }
    // Whether this unit's ring slot is free (every reader is done with the
    // unit that used it), asked while the loads fly.
    bool slot_free = true;
    if (stats && tid == 0 && unit >= slots)
      slot_free = load_acquire(&ws.ready[unit - slots]) == readers;
    // The prologue: s = x + add of the vector's channel, rounded to scalar_t
    // as torch's add rounds, replaces x in both items of the piece.
    if constexpr (kFused) {
      if (ep.add != nullptr) {
        const int64_t n = unit / G;
        const int64_t c0 = (unit - n * G) * D;
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          const int64_t i = int64_t(u) * kStreamThreads + tid;
          if (i < count) {
            const int64_t c = channel_at((begin + i) * V, c0, HxW, fast_div, hxw_div);
            const VecT s = pre_norm_vec<scalar_t, V>(as_vec<VecT>(v[u]), n * ep.C + c, ep);
            memcpy(&v[u], &s, sizeof(VecT));
          }
        }
      }
    }

    if (stats) {
      // The piece's first element (of s, with the prologue) as a shift keeps
      // the float sum small for inputs far from zero (1000 + randn).
      A shift = static_cast<A>(xs[0].val[0]);
      if constexpr (kFused) {
        if (ep.add != nullptr) {
          const int64_t n = unit / G;
          const int64_t c = channel_at(begin * V, (unit - n * G) * D, HxW, fast_div, hxw_div);
          shift =
              static_cast<A>(static_cast<scalar_t>(shift + static_cast<A>(ep.add[n * ep.C + c])));
        }
      }
      A sum = 0;
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        if (int64_t(u) * kStreamThreads + tid < count) {
#pragma unroll
          for (int e = 0; e < V; ++e) sum += static_cast<A>(as_vec<VecT>(v[u]).val[e]) - shift;
        }
      }
      const A n_piece = A(count * V);
      const A piece_mean = shift + block_sum(sum, scratch) / n_piece;
      A m2 = 0;
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        if (int64_t(u) * kStreamThreads + tid < count) {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const A d = static_cast<A>(as_vec<VecT>(v[u]).val[e]) - piece_mean;
            m2 += d * d;
          }
        }
      }
      m2 = block_sum(m2, scratch);
      if (tid == 0) {
        while (!slot_free) {
          __nanosleep(64);
          slot_free = load_acquire(&ws.ready[unit - slots]) == readers;
        }
        A* slot = partial + (unit % slots) * pieces * 2;
        slot[(b % pieces) * 2 + 0] = piece_mean;
        slot[(b % pieces) * 2 + 1] = m2;
        completes_unit = add_acq_rel(&ws.arrived[unit], 1) == int(pieces) - 1;
      }
      __syncthreads();
      if (!kEachMerges && completes_unit) {
        merge_partials(partial + (unit % slots) * pieces * 2, int(pieces), 1, 0, 1, count_of,
                       scratch, [&](int, const Stats<A>& st) {
                         mean[unit] = st.mean;
                         rstd[unit] = rsqrt(st.m2 / A(L) + eps);
                       });
        // Released after a barrier, so that every thread's loads of the slot
        // come before it (for units of up to 32 pieces merge_partials reads
        // with lanes of one warp and no barrier of its own).
        __syncthreads();
        if (tid == 0) store_release(&ws.ready[unit], 1);  // results written, slot read
      }
    } else {
      // The loads above are in flight while thread 0 waits for the unit.
      if (tid == 0) {
        if constexpr (kEachMerges) {
          while (load_acquire(&ws.arrived[unit]) < int(pieces)) __nanosleep(64);
        } else {
          while (load_acquire(&ws.ready[unit]) == 0) __nanosleep(64);
          unit_mean = __ldcg(&mean[unit]);
          unit_rstd = __ldcg(&rstd[unit]);
        }
      }
      __syncthreads();
      if constexpr (kEachMerges) {
        merge_partials(partial + (unit % slots) * pieces * 2, int(pieces), 1, 0, 1, count_of,
                       scratch, [&](int, const Stats<A>& st) {
                         unit_mean = st.mean;
                         unit_rstd = rsqrt(st.m2 / A(L) + eps);
                         if (b % pieces == 0) {
                           mean[unit] = st.mean;
                           rstd[unit] = unit_rstd;
                         }
                       });
        __syncthreads();
        if (tid == 0) add_release(&ws.ready[unit], 1);  // this reader is done with the slot
      }
      const A mu = unit_mean;
      const A rs = unit_rstd;
      const int64_t n = unit / G;
      const int64_t c0 = (unit - n * G) * D;
      // A piece inside one channel (every piece when HxW is a multiple of
      // the piece) takes that channel's scale and shift once, not each
      // vector; not in the fused kernels, at their register bound (they
      // spilled more).
      const int64_t c_first = channel_at(begin * V, c0, HxW, fast_div, hxw_div);
      const bool one_channel =
          !kFused && c_first == channel_at((begin + count) * V - 1, c0, HxW, fast_div, hxw_div);
      const ChannelAffine<A> f_first = channel_affine(n, c_first, rs, gamma, beta, ep);
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int64_t i = int64_t(u) * kStreamThreads + tid;
        if (i < count) {
          const int64_t within = (begin + i) * V;
          ChannelAffine<A> f = f_first;
          if (!one_channel) {
            f = channel_affine(n, channel_at(within, c0, HxW, fast_div, hxw_div), rs, gamma, beta,
                               ep);
          }
          normalise_store<scalar_t, V, false, kStore>(y, unit * L + within, as_vec<VecT>(v[u]), mu,
                                                      f, ep);
        }
      }
    }
    if (tid == 0) ticket[cur ^ 1] = next_ticket;
    __syncthreads();  // the next ticket is visible; shared values may be reused
  }
  stream_leave(ws);
}

}  // namespace groupnorm
