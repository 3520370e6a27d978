// GroupNorm backward for contiguous (N, C, *) input in one launch that reads
// x and dy from DRAM about once, for inputs larger than L2.
//
// The four-launch backward (backward_passes.cuh) reads x and dy twice: 5 passes over
// the input's size against the 3-pass floor (read x and dy, write dx), so at
// most 60 % of it. Here the two reads of a tile come close together, in the
// ticket order of stream.cuh:
//   first read  (sums)  the tile's sum(dy) and sum(dy * (x - mean)) -> its
//                       partial pair, then the unit's (sample, group)
//                       arrival count;
//   second read (dx)    `lag` tiles later, while L2 should still hold the
//                       tile: loads x and dy, waits until every tile of the
//                       unit has arrived (rarely: the lag covers a unit and
//                       most items in flight, choose_backward), adds the
//                       unit's pairs weighted by gamma into its coefficients
//                       and writes dx.
// Each dx item adding its unit's pairs (D x chunks of them, at most one a
// thread on the suite's shapes) keeps the path from a unit's last sums item
// to its dx items to one arrival and one read.
// The CTA whose tile completes a unit writes its affine partials
// (unit_coefficients); no dx item waits for that. A tile is `chunk` vectors
// of one channel row (a row is cut into `chunks` tiles),
// kStreamBackwardItems vectors of x and of dy per thread, held in registers
// between the loads and their use. dgamma and dbeta are added over the
// samples by the affine kernel afterwards, as in the four-launch path. Extra
// memory: the pair of every tile and the arrival counters (no ring: a sums
// item never waits).
#pragma once

#include "backward_passes.cuh"
#include "stream.cuh"

namespace groupnorm {

// Partial pairs a thread has in flight when it adds a unit's pairs (add_pairs):
// 8 float or 2 double pairs, as many as fit the 128 registers without spills.
template <typename A>
constexpr int kStreamPairsInFlight = sizeof(A) == 4 ? 8 : 2;

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBackwardThreads, kStreamBackwardBlocksPerSm)
    groupnorm_backward_stream_kernel(const scalar_t* __restrict__ dy,           // [N * C, HxW]
                                     const scalar_t* __restrict__ x,            // [N * C, HxW]
                                     const acc_t<scalar_t>* __restrict__ mean,  // [N, G]
                                     const acc_t<scalar_t>* __restrict__ rstd,  // [N, G]
                                     const scalar_t* __restrict__ gamma,        // [C] or nullptr
                                     acc_t<scalar_t>* partial,       // [N * C, chunks, 2]
                                     acc_t<scalar_t>* affine_pairs,  // [N, C, 2] or nullptr
                                     scalar_t* __restrict__ dx,      // [N * C, HxW]
                                     StreamWorkspace ws, BackwardTiles t, int C, int G,
                                     StreamOrder order, bool l2_hints) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  __shared__ A red_dy[kBackwardThreads], red_dyx[kBackwardThreads], scratch[2 * kBackwardWarps];
  __shared__ long long ticket[2];  // the current and the next item
  __shared__ bool completes_unit;
  const int tid = threadIdx.x;
  const int D = C / G;
  const int unit_tiles = D * int(t.chunks);
  const int64_t tickets = 2 * order.total;
  const PartialLayout at{t.chunks, C * t.chunks, t.chunks, 1};
  const auto weight = [&](int c) { return gamma != nullptr ? static_cast<A>(gamma[c]) : A(1); };

  // The ticket loop of groupnorm_stream_kernel, written out here as there
  // (forward_stream_channels_last.cuh says why). The next ticket's latency
  // hides behind this item; it is read after this item's last barrier.
  if (tid == 0) ticket[0] = (long long)atomicAdd(ws.next, 1ull);
  long long next_ticket = 0;  // thread 0's claim, stored at the item's end (see there)
  __syncthreads();
  for (int cur = 0;; cur ^= 1) {
    const int64_t tk = ticket[cur];
    if (tk >= tickets) break;
    if (tid == 0) next_ticket = (long long)atomicAdd(ws.next, 1ull);
    int64_t b;
    const bool sums = order.item(tk, b);
    const int64_t row = b / t.chunks;  // n * C + c
    const int64_t unit = row / D;      // n * G + c / D
    const int64_t begin = (b % t.chunks) * t.chunk;
    const int64_t count = min(t.chunk, t.row_items - begin);
    const int64_t offset = row * t.row_items * V + begin * V;
    const Raw* dys = reinterpret_cast<const Raw*>(dy + offset);
    const Raw* xs = reinterpret_cast<const Raw*>(x + offset);
    Raw g[kStreamBackwardItems], v[kStreamBackwardItems];
#pragma unroll
    for (int u = 0; u < kStreamBackwardItems; ++u) {
      const int64_t i = int64_t(u) * kBackwardThreads + tid;
      if (i < count) {
        g[u] = l2_hints ? load_with_l2_priority(dys + i, sums) : dys[i];
        v[u] = l2_hints ? load_with_l2_priority(xs + i, sums) : xs[i];
      }
    }
    if (sums) {
      const A mu = mean[unit];
      A s_dy = 0, s_dyx = 0;
#pragma unroll
      for (int u = 0; u < kStreamBackwardItems; ++u) {
        if (int64_t(u) * kBackwardThreads + tid < count) {
          const VecT gv = as_vec<VecT>(g[u]), xv = as_vec<VecT>(v[u]);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const A d = static_cast<A>(gv.val[e]);
            s_dy += d;
            s_dyx += d * (static_cast<A>(xv.val[e]) - mu);
          }
        }
      }
      block_sums(scratch, s_dy, s_dyx);
      if (tid == 0) {
        store_pair(partial + b * 2, s_dy, s_dyx);
        completes_unit = add_acq_rel(&ws.arrived[unit], 1) == unit_tiles - 1;
      }
      __syncthreads();
      if (completes_unit && affine_pairs != nullptr) {
        unit_coefficients<scalar_t, kStreamPairsInFlight<A>>(
            partial, mean, rstd, gamma, affine_pairs, nullptr, unit, C, G, t.row_items * V, at,
            red_dy, red_dyx, scratch);
      }
    } else {
      // The loads above are in flight while thread 0 waits for the unit's
      // last tile and the block adds the unit's pairs, weighted by gamma:
      // every dx item of the unit adds the same pairs in the same order.
      if (tid == 0) {
        while (load_acquire(&ws.arrived[unit]) < unit_tiles) __nanosleep(64);
      }
      __syncthreads();
      const A* pairs = partial + unit * unit_tiles * 2;  // rows unit * D ... of t.chunks
      A s1 = 0, s2 = 0;
      for (int i = tid; i < unit_tiles; i += kBackwardThreads) {
        A a, q;
        load_pair_l2(pairs + int64_t(i) * 2, a, q);
        const A w = weight(int(unit % G) * D + i / int(t.chunks));
        s1 += w * a;
        s2 += w * q;
      }
      block_sums(scratch, s1, s2);
      const int c = int(row % C);
      const A mu = mean[unit], rs = rstd[unit];
      const A M = A(D) * A(t.row_items * V);
      const Coef<A> k{rs * weight(c), mu, rs * s1 / M, rs * rs * rs * s2 / M};
      scalar_t* out = dx + offset;
#pragma unroll
      for (int u = 0; u < kStreamBackwardItems; ++u) {
        const int64_t i = int64_t(u) * kBackwardThreads + tid;
        if (i < count) {
          store_vec_streaming<scalar_t, V>(
              out + i * V,
              dx_vec<scalar_t, V>(as_vec<VecT>(g[u]), as_vec<VecT>(v[u]), [&](int) { return k; }));
        }
      }
    }
    if (tid == 0) ticket[cur ^ 1] = next_ticket;
    __syncthreads();  // the next ticket is visible; shared values may be reused
  }
  stream_leave(ws);
}

}  // namespace groupnorm
