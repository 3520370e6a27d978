// GroupNorm forward for large channels-last input ((N, HxW, C) in memory):
// the ticket-ordered stream of forward_stream.cuh with a sample, or a block of
// whole groups of a sample, as the unit.
//
// A sample's rows each hold all G groups. The channels are cut into `blocks`
// blocks of whole groups, each at least kMinBlockRowBytes of a row (so reads
// stay coalesced), and a unit (sample, block) into pieces of its rows: the
// smaller the unit, the sooner a piece is read again, so the likelier L2
// still holds it. A statistics item computes the piece's (mean, M2) for every
// group of the unit; a normalise item, `lag` pieces later in ticket order,
// loads the piece again and writes y. Ticket order, ring of slots and the
// deadlock argument are those of forward_stream.cuh, with a unit's G partials
// per piece instead of one. L2 still holds a piece at its second read when a
// unit is smaller than about a quarter of L2 (lag >= pieces per unit); larger
// units read much of x twice, as every other kernel must once a unit no
// longer fits on chip.
//
// Merging, in one of two ways (kEachMerges, host's choice):
//  - each: when a unit's partials are few next to a piece's bytes, every
//    normalise item waits until all the unit's statistics items have arrived
//    and merges the unit's partials itself, in piece order (as in
//    forward_stream.cuh; piece 0's item writes mean and rstd);
//  - once: one CTA merging every partial of a large unit (a 64 MiB sample
//    without blocks: 4096 pieces x 32 groups) would hold up each normalise
//    item of that unit, so the merge is two-level: the CTA that finishes the
//    last piece of a chunk (chunk_pieces consecutive pieces, about
//    kChunkPartials partials) merges the chunk, and the CTA that merges a
//    unit's last chunk merges the chunks, writes mean and rstd, and raises
//    the unit's ready flag, which the normalise items wait for.
// Every merge goes in piece order, so the result does not depend on timing.
// Extra memory: (mean, M2) per group for every piece and chunk of the
// `slots` units in the ring (the host keeps a piece's partials under 1/16 of
// its bytes), and two counters per unit plus one per chunk.
//
// Threads: cols = C / blocks / V threads cover a unit's part of a row, V
// channels each, rows_per_step rows side by side; each thread holds
// kStreamItems rows of its column in registers (16-bit elements packed as
// words until used, as in the contiguous kernel). V divides C / G, so a
// thread's channels lie in one group and it keeps one sum, like the
// contiguous kernel: per-channel sums (V of each) spilled and made the kernel
// bound by instructions, not memory.
//
// Every 16-byte load carries an L2 priority (load_with_l2_priority).
#pragma once

#include "epilogue.cuh"
#include "reduce.cuh"
#include "stream.cuh"

namespace groupnorm {

// Merges a finished chunk's piece partials into the chunk's partial and, if
// it is the unit's last chunk, the chunks into the unit's mean and rstd,
// then raises the unit's ready flag. Called by a whole CTA.
template <typename A>
__device__ __forceinline__ void merge_chunk(const A* piece_partial,  // [slots, pieces, G, 2]
                                            A* chunk_partial,        // [slots, chunks, G, 2]
                                            A* mean,                 // [units, G]
                                            A* rstd,                 // [units, G]
                                            const StreamWorkspace& ws, A* scratch,
                                            bool& completes_unit, int64_t unit, int64_t chunk,
                                            int64_t HxW, int G, int D, int64_t rows_per_piece,
                                            int64_t pieces, int64_t chunk_pieces, int64_t slots,
                                            A eps) {
  const int64_t chunks = (pieces + chunk_pieces - 1) / chunk_pieces;
  const int64_t chunk_first = chunk * chunk_pieces;
  const int in_chunk = int(min(chunk_pieces, pieces - chunk_first));
  const A* unit_pieces = piece_partial + (unit % slots) * pieces * G * 2;
  A* unit_chunks = chunk_partial + (unit % slots) * chunks * G * 2;
  const auto piece_count = [=](int r) {
    return A(min(rows_per_piece, HxW - (chunk_first + r) * rows_per_piece) * D);
  };
  merge_partials(unit_pieces + chunk_first * G * 2, in_chunk, G, 0, G, piece_count, scratch,
                 [=](int g, const Stats<A>& st) {
                   unit_chunks[(chunk * G + g) * 2 + 0] = st.mean;
                   unit_chunks[(chunk * G + g) * 2 + 1] = st.m2;
                 });
  __syncthreads();
  if (threadIdx.x == 0) {
    completes_unit = add_acq_rel(&ws.chunk_arrived[unit], 1) == int(chunks) - 1;
  }
  __syncthreads();
  if (!completes_unit) return;
  const SliceCounts<A> chunk_count{rows_per_piece * chunk_pieces, HxW, D};
  const A count = A(HxW * D);
  merge_partials(unit_chunks, int(chunks), G, 0, G, chunk_count, scratch,
                 [=](int g, const Stats<A>& st) {
                   mean[unit * G + g] = st.mean;
                   rstd[unit * G + g] = rsqrt(st.m2 / count + eps);
                 });
  __syncthreads();
  if (threadIdx.x == 0) {
    store_release(&ws.ready[unit], 1);
  }
}

template <typename scalar_t, int V, bool kEachMerges, bool kFused, Store kStore>
__global__ void __launch_bounds__(kStreamThreads, kStreamRowsBlocksPerSm)
    groupnorm_stream_channels_last_kernel(
        const scalar_t* __restrict__ x,               // [N, HxW, C]
        const scalar_t* __restrict__ gamma,           // [C] or nullptr
        const scalar_t* __restrict__ beta,            // [C] or nullptr
        scalar_t* __restrict__ y,                     // [N, HxW, C]
        acc_t<scalar_t>* __restrict__ mean,           // [N * blocks, G] = [N, G of the input]
        acc_t<scalar_t>* __restrict__ rstd,           // [N * blocks, G]
        const Epilogue<scalar_t, kFused> ep,          // scale, shift [N, C]
        acc_t<scalar_t>* __restrict__ piece_partial,  // [slots, pieces, G, 2]
        acc_t<scalar_t>* __restrict__ chunk_partial,  // [slots, chunks, G, 2]
        StreamWorkspace ws, int64_t HxW, int C, int blocks, int G, int D, int rows_per_step,
        int64_t pieces, int64_t chunk_pieces, int64_t slots, StreamOrder order,
        acc_t<scalar_t> eps) {
  // C: channels of a row; a unit (sample, block) holds C / blocks of them, in
  // G groups of D.
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  constexpr int kItems = kStreamItems;
  extern __shared__ __align__(16) unsigned char smem[];
  const int unit_C = C / blocks;
  const int cols = unit_C / V;
  A* red = reinterpret_cast<A*>(smem);        // [rows_per_step, cols]
  A* group_sum = red + rows_per_step * cols;  // [G] sum of x - shift over the piece
  A* group_m2 = group_sum + G;                // [G] M2 about the piece's group mean
  // merge=each normalise items reuse the same space for the unit's results.
  A* unit_mean = group_sum;  // [G]
  A* unit_rstd = group_m2;   // [G]
  __shared__ A scratch[3 * kStreamThreads / kWarp];
  __shared__ long long ticket[2];  // the current and the next item
  __shared__ bool completes_chunk, completes_unit;
  const int tid = threadIdx.x;
  const int col = tid % cols;
  const int row_lane = tid / cols;  // >= rows_per_step: reductions only
  const bool sweeps = row_lane < rows_per_step;
  const int c0 = col * V;
  const int group = c0 / D;  // of all V channels (host: D % V == 0)
  const int64_t rows_per_piece = int64_t(rows_per_step) * kItems;
  const int64_t chunks = (pieces + chunk_pieces - 1) / chunk_pieces;
  const int64_t tickets = 2 * order.total;
  const int readers = kEachMerges ? int(pieces) : 1;  // of a unit's ring slot

  // The ticket loop of groupnorm_stream_kernel: the next ticket is fetched
  // while this item runs. Written out in each stream kernel on purpose: as a
  // shared helper it made these register-capped kernels spill. The
  // channels-last kernels store it at once: held to the item's end, as the
  // contiguous kernels do, it made them spill too.
  if (tid == 0) ticket[0] = (long long)atomicAdd(ws.next, 1ull);
  __syncthreads();
  for (int cur = 0;; cur ^= 1) {
    const int64_t t = ticket[cur];
    if (t >= tickets) break;
    if (tid == 0) ticket[cur ^ 1] = (long long)atomicAdd(ws.next, 1ull);
    int64_t b;
    const bool stats = order.item(t, b);
    const int64_t unit = b / pieces;
    const int64_t piece = b % pieces;
    const int64_t row0 = piece * rows_per_piece;
    const int rows = int(min(rows_per_piece, HxW - row0));  // a piece has under 2^31 elements
    // One 64-bit division, and the unit's first channel in 32 bits: with
    // unit % blocks and 64-bit offsets kept for the store, the kernel spilled.
    const int64_t n = unit / blocks;
    const int block_c0 = int(unit - n * blocks) * unit_C;
    const scalar_t* first = x + ((n * HxW + row0) * C + block_c0);  // the piece's first row
    Raw v[kItems];
    if (sweeps) {
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int r = row_lane + u * rows_per_step;
        if (r < rows) {
          v[u] = load_with_l2_priority(reinterpret_cast<const Raw*>(first + int64_t(r) * C + c0),
                                       stats);
        }
      }
    }
    bool slot_free = true;
    if (stats && tid == 0 && unit >= slots)
      slot_free = load_acquire(&ws.ready[unit - slots]) == readers;

    if (stats) {
      // Shift: the group's first element in the piece's first row, which
      // keeps the float sum small for inputs far from zero.
      const A shift = static_cast<A>(first[group * D]);
      const A n_group = A(rows * D);
      if (sweeps) {
        A sum = 0;
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          if (row_lane + u * rows_per_step < rows) {
#pragma unroll
            for (int e = 0; e < V; ++e) sum += static_cast<A>(as_vec<VecT>(v[u]).val[e]) - shift;
          }
        }
        red[row_lane * cols + col] = sum;
      }
      __syncthreads();
      reduce_groups(red, rows_per_step, cols, G, D / V, group_sum);
      if (sweeps) {
        const A m = shift + group_sum[group] / n_group;
        A m2 = 0;
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          if (row_lane + u * rows_per_step < rows) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const A d = static_cast<A>(as_vec<VecT>(v[u]).val[e]) - m;
              m2 += d * d;
            }
          }
        }
        red[row_lane * cols + col] = m2;
      }
      if (tid == 0) {
        while (!slot_free) {
          __nanosleep(64);
          slot_free = load_acquire(&ws.ready[unit - slots]) == readers;
        }
      }
      __syncthreads();  // the table is written and the ring slot is free
      reduce_groups(red, rows_per_step, cols, G, D / V, group_m2);
      A* unit_pieces = piece_partial + (unit % slots) * pieces * G * 2;
      for (int g = tid; g < G; g += blockDim.x) {
        unit_pieces[(piece * G + g) * 2 + 0] =
            static_cast<A>(first[g * D]) + group_sum[g] / n_group;
        unit_pieces[(piece * G + g) * 2 + 1] = group_m2[g];
      }
      const int64_t chunk = piece / chunk_pieces;
      const int in_chunk = int(min(chunk_pieces, pieces - chunk * chunk_pieces));
      __syncthreads();
      if (tid == 0) {
        completes_chunk = add_acq_rel(&ws.arrived[unit * chunks + chunk], 1) == in_chunk - 1;
      }
      __syncthreads();
      if (!kEachMerges && completes_chunk) {
        merge_chunk(piece_partial, chunk_partial, mean, rstd, ws, scratch, completes_unit, unit,
                    chunk, HxW, G, D, rows_per_piece, pieces, chunk_pieces, slots, eps);
      }
    } else {
      // The loads above are in flight while thread 0 waits for the unit.
      if (tid == 0) {
        if constexpr (kEachMerges) {  // one chunk: its count is the unit's
          while (load_acquire(&ws.arrived[unit * chunks]) < int(pieces)) __nanosleep(64);
        } else {
          while (load_acquire(&ws.ready[unit]) == 0) __nanosleep(64);
        }
      }
      __syncthreads();
      if constexpr (kEachMerges) {  // the unit's mean and rstd into unit_mean, unit_rstd
        const SliceCounts<A> piece_count{rows_per_piece, HxW, D};
        const A count = A(HxW * D);
        merge_partials(piece_partial + (unit % slots) * pieces * G * 2, int(pieces), G, 0, G,
                       piece_count, scratch, [&](int g, const Stats<A>& st) {
                         unit_mean[g] = st.mean;
                         unit_rstd[g] = rsqrt(st.m2 / count + eps);
                         if (piece == 0) {
                           mean[unit * G + g] = st.mean;
                           rstd[unit * G + g] = unit_rstd[g];
                         }
                       });
        __syncthreads();
        if (tid == 0) {
          add_release(&ws.ready[unit], 1);  // this reader is done with the slot
        }
      }
      if (sweeps) {
        const A mu = kEachMerges ? unit_mean[group] : __ldcg(&mean[unit * G + group]);
        const A rs = kEachMerges ? unit_rstd[group] : __ldcg(&rstd[unit * G + group]);
        ChannelAffine<A> f[V];
#pragma unroll
        for (int e = 0; e < V; ++e)
          f[e] = channel_affine(n, block_c0 + c0 + e, rs, gamma, beta, ep);
        const int64_t y_at = (first - x) + c0;  // this thread's column in the piece's first row
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          const int r = row_lane + u * rows_per_step;
          if (r < rows) {
            A out[V];
            const VecT in = as_vec<VecT>(v[u]);
#pragma unroll
            for (int e = 0; e < V; ++e) out[e] = affine_value(in.val[e], mu, f[e]);
            store_output<scalar_t, V, kFused, true, false, kStore>(y, y_at + int64_t(r) * C, out,
                                                                   ep);
          }
        }
      }
    }
    __syncthreads();  // the next ticket is visible; shared values may be reused
  }
  stream_leave(ws);
}

}  // namespace groupnorm
