// GroupNorm backward for large channels-last input ((N, HxW, C) in memory) in
// one launch: the stream backward of backward_stream.cuh with the unit of the
// channels-last forward stream (forward_stream_channels_last.cuh), a sample or
// a block of whole groups of a sample.
//
// A tile is `chunk` consecutive rows (positions) of a unit's channels. The
// unit's C / blocks channels are cols vectors of V channels, one thread each,
// and the CTA's threads cover rows_per_step rows side by side, each thread
// holding kItems rows of its column of x and of dy in registers:
//   first read  (sums)  per group of the unit, the tile's sum(g) and
//                       sum(g * (x - mean)) with g = dy * gamma -> the
//                       tile's group pairs; per channel, sum(dy) and
//                       sum(dy * (x - mean)) -> its channel pairs (only for
//                       dgamma and dbeta). Then the unit's arrival count.
//   second read (dx)    `lag` tiles later, in the ticket order of
//                       stream.cuh: loads x and dy, waits until every
//                       tile of the unit has arrived, adds the unit's group
//                       pairs itself and writes dx.
// Each dx item adding the group pairs (tiles x groups of the unit, a few per
// thread, read from L2 while its own loads are in flight) keeps the path from
// a unit's last sums item to its dx items short: one arrival and one read.
// The CTA whose tile completes a unit adds the unit's channel pairs in tile
// order into the affine partials; no dx item waits for that. V divides C / G,
// so a thread's channels lie in one group: one mean per thread. Every
// addition goes in a fixed order: results do not depend on timing. dgamma
// and dbeta are added over the samples by the affine kernel, as in the other
// paths. Extra memory: the pairs of every tile and group (and channel, for
// dgamma and dbeta) and the arrival counters.
#pragma once

#include "backward_stream.cuh"

namespace groupnorm {

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBackwardThreads, kStreamBackwardBlocksPerSm)
    groupnorm_backward_stream_channels_last_kernel(
        const scalar_t* __restrict__ dy,           // [N, HxW, C]
        const scalar_t* __restrict__ x,            // [N, HxW, C]
        const acc_t<scalar_t>* __restrict__ mean,  // [N, G]
        const acc_t<scalar_t>* __restrict__ rstd,  // [N, G]
        const scalar_t* __restrict__ gamma,        // [C] or nullptr
        acc_t<scalar_t>* group_pairs,              // [N, chunks, G, 2]
        acc_t<scalar_t>* channel_pairs,            // [N, chunks, C, 2] or nullptr
        acc_t<scalar_t>* affine_pairs,             // [N, C, 2] or nullptr (with channel_pairs)
        scalar_t* __restrict__ dx,                 // [N, HxW, C]
        StreamWorkspace ws, BackwardTiles t, int C, int G, StreamOrder order, bool l2_hints) {
  // t: rows = N, row_items = HxW, chunk = rows per tile, chunks = tiles per
  // unit, cblocks = units per sample, block_cols = vector columns of a unit.
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  constexpr int kItems = kStreamBackwardItems;  // rows of a thread's column
  // red_*: [rows, unit_C] per-thread (or per-warp) sums of a tile, or the
  // lanes of add_pair_sets. sum_*: in a sums item the tile's weighted sums
  // per channel of the unit, in a dx item the unit's per group.
  __shared__ A red_dy[kBackwardThreads * V], red_dyx[kBackwardThreads * V];
  __shared__ A sum_dy[kBackwardThreads * V], sum_dyx[kBackwardThreads * V];
  __shared__ long long ticket[2];  // the current and the next item
  __shared__ bool completes_unit;
  const int tid = threadIdx.x;
  const int cols = t.block_cols;
  const int unit_C = cols * V;
  const int rows_per_step = kBackwardThreads / cols;
  const int col = tid % cols;
  const int row_lane = tid / cols;  // >= rows_per_step: reductions only
  const bool sweeps = row_lane < rows_per_step;
  // With a power-of-two row of at most a warp, every thread sweeps and the
  // row lanes of a warp are added by shuffles first: the table then has a row
  // per warp, not per row lane (32 serial shared loads a channel -> 8).
  const bool warp_rows = (cols & (cols - 1)) == 0 && cols <= kWarp;
  const int table_rows = warp_rows ? kBackwardWarps : rows_per_step;
  const int D = C / G;
  const int unit_G = unit_C / D;
  const int warp = tid / kWarp, wlane = tid % kWarp;
  const int64_t tiles = t.chunks;
  const int64_t tickets = 2 * order.total;
  const auto weight = [&](int c) { return gamma != nullptr ? static_cast<A>(gamma[c]) : A(1); };

  // The ticket loop of groupnorm_stream_kernel, written out here as there
  // (forward_stream_channels_last.cuh says why).
  if (tid == 0) ticket[0] = (long long)atomicAdd(ws.next, 1ull);
  __syncthreads();
  for (int cur = 0;; cur ^= 1) {
    const int64_t tk = ticket[cur];
    if (tk >= tickets) break;
    if (tid == 0) ticket[cur ^ 1] = (long long)atomicAdd(ws.next, 1ull);
    int64_t b;
    const bool sums = order.item(tk, b);
    const int64_t unit = b / tiles;
    const int64_t tile = b - unit * tiles;
    const int64_t n = unit / t.cblocks;
    const int c_first = int(unit - n * t.cblocks) * unit_C;  // the unit's first channel
    const int g_first = c_first / D;                         // and group
    const int64_t row0 = tile * t.chunk;
    const int rows = int(min(t.chunk, t.row_items - row0));
    const int64_t offset = (n * t.row_items + row0) * C + c_first + col * V;
    const scalar_t* dys = dy + offset;
    const scalar_t* xs = x + offset;
    Raw g[kItems], v[kItems];
    if (sweeps) {
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int r = row_lane + u * rows_per_step;
        if (r < rows) {
          const Raw* pg = reinterpret_cast<const Raw*>(dys + int64_t(r) * C);
          const Raw* px = reinterpret_cast<const Raw*>(xs + int64_t(r) * C);
          g[u] = l2_hints ? load_with_l2_priority(pg, sums) : *pg;
          v[u] = l2_hints ? load_with_l2_priority(px, sums) : *px;
        }
      }
    }
    if (sums) {
      A s_dy[V], s_dyx[V];
#pragma unroll
      for (int e = 0; e < V; ++e) s_dy[e] = s_dyx[e] = 0;
      if (sweeps) {
        const A mu = mean[n * G + (c_first + col * V) / D];
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          if (row_lane + u * rows_per_step < rows) {
            add_lane_sums(as_vec<VecT>(g[u]), as_vec<VecT>(v[u]), mu, s_dy, s_dyx);
          }
        }
      }
      int table_row = row_lane;
      if (warp_rows) {  // the same in every thread
#pragma unroll
        for (int e = 0; e < V; ++e) {
          for (int lanes = cols; lanes < kWarp; lanes *= 2) {
            s_dy[e] += __shfl_xor_sync(0xffffffffu, s_dy[e], lanes);
            s_dyx[e] += __shfl_xor_sync(0xffffffffu, s_dyx[e], lanes);
          }
        }
        table_row = tid % kWarp < cols ? tid / kWarp : table_rows;
      }
      if (table_row < table_rows) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          red_dy[table_row * unit_C + col * V + e] = s_dy[e];
          red_dyx[table_row * unit_C + col * V + e] = s_dyx[e];
        }
      }
      __syncthreads();
      // Per channel: the tile's sums (table-row order: fixed), kept for
      // dgamma and dbeta, and weighted by gamma for the group pairs.
      for (int j = tid; j < unit_C; j += kBackwardThreads) {
        A a = 0, q = 0;
        for (int r = 0; r < table_rows; ++r) {
          a += red_dy[r * unit_C + j];
          q += red_dyx[r * unit_C + j];
        }
        if (channel_pairs != nullptr) {
          store_pair(channel_pairs + ((n * tiles + tile) * C + c_first + j) * 2, a, q);
        }
        const A w = weight(c_first + j);
        sum_dy[j] = w * a;
        sum_dyx[j] = w * q;
      }
      __syncthreads();
      // Per group: a warp adds its channels (lane order, then shuffles).
      for (int gb = warp; gb < unit_G; gb += kBackwardWarps) {
        A a = 0, q = 0;
        for (int d = wlane; d < D; d += kWarp) {
          a += sum_dy[gb * D + d];
          q += sum_dyx[gb * D + d];
        }
        a = warp_sum(a);
        q = warp_sum(q);
        if (wlane == 0) store_pair(group_pairs + ((n * tiles + tile) * G + g_first + gb) * 2, a, q);
      }
      __syncthreads();
      if (tid == 0) {
        completes_unit = add_acq_rel(&ws.arrived[unit], 1) == int(tiles) - 1;
      }
      __syncthreads();
      if (completes_unit && channel_pairs != nullptr) {
        add_pair_sets<kStreamPairsInFlight<A>>(channel_pairs + (n * tiles * C + c_first) * 2, tiles,
                                               1, C, unit_C, red_dy, red_dyx, [&](int j, A a, A q) {
                                                 const int c = c_first + j;
                                                 store_pair(affine_pairs + (n * C + c) * 2, a,
                                                            q * rstd[n * G + c / D]);
                                               });
      }
    } else {
      // The loads above are in flight while thread 0 waits for the unit's
      // last tile and the block adds its group pairs.
      if (tid == 0) {
        while (load_acquire(&ws.arrived[unit]) < int(tiles)) __nanosleep(64);
      }
      __syncthreads();
      add_pair_sets<kStreamPairsInFlight<A>>(group_pairs + (n * tiles * G + g_first) * 2, tiles, 1,
                                             G, unit_G, red_dy, red_dyx, [&](int j, A a, A q) {
                                               sum_dy[j] = a;
                                               sum_dyx[j] = q;
                                             });
      __syncthreads();
      if (sweeps) {
        const int c = c_first + col * V;
        const int gb = c / D - g_first;
        const A mu = mean[n * G + g_first + gb];
        const A rs = rstd[n * G + g_first + gb];
        const A M = A(D) * A(t.row_items);
        const A k1 = rs * sum_dy[gb] / M;
        const A k2 = rs * rs * rs * sum_dyx[gb] / M;
        A alpha[V];
#pragma unroll
        for (int e = 0; e < V; ++e) alpha[e] = rs * weight(c + e);
        const auto coef = [&](int e) { return Coef<A>{alpha[e], mu, k1, k2}; };
        scalar_t* out = dx + offset;
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          const int r = row_lane + u * rows_per_step;
          if (r < rows) {
            store_vec_streaming<scalar_t, V>(
                out + int64_t(r) * C,
                dx_vec<scalar_t, V>(as_vec<VecT>(g[u]), as_vec<VecT>(v[u]), coef));
          }
        }
      }
    }
    __syncthreads();  // the next ticket is visible; shared values may be reused
  }
  stream_leave(ws);
}

}  // namespace groupnorm
