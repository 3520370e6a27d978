// GroupNorm backward. With xhat = (x - mean) * rstd, g = dy * gamma[c] and
// M = D * HxW elements per (sample, group):
//   dx        = rstd * (g - sum(g) / M - xhat * sum(g * xhat) / M)
//   dgamma[c] = sum over samples and positions of dy * xhat
//   dbeta[c]  = sum over samples and positions of dy
// Four launches, each spread over the whole GPU whatever N and G are (a few
// large groups, as in a VAE decoder, must not leave SMs idle):
//   1. sums:         per (sample, channel, chunk of positions): sum(dy) and
//                    sum(dy * (x - mean)) -> partial pairs
//   2. coefficients: one CTA per (sample, group) adds the chunks in a fixed
//                    order, writes the per-(sample, channel) affine partials
//                    and the dx coefficients of every channel:
//                    dx = alpha * dy - k1 - (x - mean) * k2
//   3. affine:       dgamma, dbeta = sums over samples, in sample order
//   4. dx:           elementwise over the same tiles as step 1, read x and dy,
//                    write dx.
// x and dy are read twice and dx written once: 5 passes against the 3-pass
// floor, so at the copy rate this reaches 60 % of it. Step 4 walks the tiles
// in reverse, so its first reads hit what step 1 left in L2; inputs that fit
// in L2 are read from DRAM about once. Inputs larger than L2 take, on the
// terms of choose_backward (dx wanted, 16-byte vectors, and for channels-last
// units of at most half the grid), backward_stream.cuh (contiguous) or
// backward_stream_channels_last.cuh instead, which do steps 1, 2 and 4 in one
// launch and read each tile the second time soon after the first. mean and
// rstd come from the forward: nothing else is saved. No atomics: results do
// not depend on timing. Inputs smaller than L2 whose groups fit one CTA
// take the registers kernel (backward_registers.cuh) instead, in one launch
// (fused ones with 16-byte vectors, unless the chain kernel runs first).
// With kFused the passes are the backward of the fused forward as well
// (backward_epilogue.cuh), as the registers kernel is; the stream kernels
// are not.
//
// Tiles (chosen by choose_backward on the host):
//   contiguous    rows of HxW (one per (sample, channel)); a row of at most
//                 kWarpRowVecs vectors goes to one warp (8 rows per CTA),
//                 a longer one is cut into `chunks` pieces of `chunk` vectors,
//                 one CTA each.
//   channels-last per sample, `chunks` runs of `chunk` rows (positions) by
//                 `cblocks` blocks of up to kBackwardThreads vector columns;
//                 each thread keeps V channels for its whole run.
#pragma once

#include "backward_epilogue.cuh"
#include "plan.h"
#include "reduce.cuh"
#include "sync.cuh"

namespace groupnorm {

constexpr int kBackwardUnroll = 4;
// The fused passes' loads in flight: half as many, for half the registers
// (twice the resident CTAs) of the recompute.
template <bool kFused>
__host__ __device__ constexpr int backward_unroll() {
  return kFused ? kBackwardUnroll / 2 : kBackwardUnroll;
}
// Register budgets, as resident CTAs per SM, for the kernels that read 16-bit
// elements 8 to a vector, so that kBackwardUnroll loads of x and of dy per
// thread are in flight from enough CTAs to keep DRAM busy: contiguous sums
// and dx 64 registers, channels-last sums (V sums and means a thread) 80.
// 0 = the compiler's choice for every other kernel, and for the fused
// backward's, which recompute the forward's value per element.
template <typename scalar_t, int V, bool kFused>
constexpr int backward_contiguous_blocks_per_sm() {
  return sizeof(scalar_t) == 2 && V == 8 && !kFused ? 4 : 0;
}
template <typename scalar_t, int V, bool kFused>
constexpr int backward_channels_last_sums_blocks_per_sm() {
  return sizeof(scalar_t) == 2 && V == 8 && !kFused ? 3 : 0;
}

// ---------------------------------------------------------------------------
// Contiguous (N, C, HxW).
// ---------------------------------------------------------------------------

// Sums of dy and dy * (x - mu) over vectors [begin, end) of one row; `lane`
// of `width` threads takes every width-th vector. With kFused, of g and g *
// (s - mu) (backward_epilogue.cuh) and, in s_x, of s - mu; r is the row's.
template <typename scalar_t, int V, bool kFused>
__device__ __forceinline__ void row_sums(const scalar_t* dy, const scalar_t* x, int64_t begin,
                                         int64_t end, int lane, int width,
                                         const Recompute<acc_t<scalar_t>>& r,
                                         const BackwardEpilogue<scalar_t, kFused>& ep,
                                         acc_t<scalar_t>& s_dy, acc_t<scalar_t>& s_dyx,
                                         acc_t<scalar_t>& s_x) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  load_each<backward_unroll<kFused>(), scalar_t, V>(
      begin + lane, end, width, V,
      [&](int64_t, const VecT& g, const VecT& v) {
        if constexpr (kFused) {
          A centred[V], grad[V];
          recompute_lanes<scalar_t, V>(g, v, ep, [&](int) { return r; }, centred, grad);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            s_dy += grad[e];
            s_dyx += grad[e] * centred[e];
            s_x += centred[e];
          }
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const A d = static_cast<A>(g.val[e]);
            s_dy += d;
            s_dyx += d * (static_cast<A>(v.val[e]) - r.mu);
          }
        }
      },
      dy, x);
}

// What row_sums and the dx kernels need of channel c of sample n: the mean
// alone, or with kFused everything the forward computed z from.
template <typename scalar_t, bool kFused>
__device__ __forceinline__ Recompute<acc_t<scalar_t>> channel_recompute(
    int64_t n, int64_t c, int G, int D, const acc_t<scalar_t>* __restrict__ mean,
    const scalar_t* __restrict__ gamma, const BackwardEpilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    return recompute_of(n, c, G, mean, gamma, ep);
  } else {
    return {0, mean[n * G + c / D], {}};
  }
}

// The sum of s - mu of partial pair `at` (kFused, add's gradient wanted).
template <typename scalar_t, bool kFused>
__device__ __forceinline__ void store_x_sum(const BackwardEpilogue<scalar_t, kFused>& ep,
                                            int64_t at, acc_t<scalar_t> s_x) {
  if constexpr (kFused) {
    if (ep.x_partial != nullptr) ep.x_partial[at] = s_x;
  }
}

template <typename scalar_t, int V, bool kFused>
__global__ void __launch_bounds__(kBackwardThreads,
                                  backward_contiguous_blocks_per_sm<scalar_t, V, kFused>())
    groupnorm_backward_sums_contiguous_kernel(
        const scalar_t* __restrict__ dy,           // [N * C, HxW]
        const scalar_t* __restrict__ x,            // [N * C, HxW]
        const acc_t<scalar_t>* __restrict__ mean,  // [N, G]
        const scalar_t* __restrict__ gamma,        // [C] or nullptr (kFused reads it)
        acc_t<scalar_t>* __restrict__ partial,     // [N * C, chunks, 2]
        BackwardTiles t, int C, int D, const BackwardEpilogue<scalar_t, kFused> ep) {
  using A = acc_t<scalar_t>;
  __shared__ A scratch[3 * kBackwardWarps];
  griddep_release();  // the coefficients kernel may launch
  const int G = C / D;
  const bool x_sums = wants_x_sums(ep);
  const auto recompute = [&](int64_t row) {
    return channel_recompute<scalar_t>(row / C, row % C, G, D, mean, gamma, ep);
  };
  for (int64_t b = blockIdx.x; b < t.tiles; b += gridDim.x) {
    if (t.warp_rows) {
      const int64_t row = b * kBackwardWarps + threadIdx.x / kWarp;
      if (row >= t.rows) continue;  // no block barrier in this branch
      const int lane = threadIdx.x % kWarp;
      A s_dy = 0, s_dyx = 0, s_x = 0;
      row_sums<scalar_t, V>(dy + row * t.row_items * V, x + row * t.row_items * V, 0, t.row_items,
                            lane, kWarp, recompute(row), ep, s_dy, s_dyx, s_x);
      s_dy = warp_sum(s_dy);
      s_dyx = warp_sum(s_dyx);
      if (x_sums) s_x = warp_sum(s_x);
      if (lane == 0) {
        store_pair(partial + row * 2, s_dy, s_dyx);
        store_x_sum(ep, row, s_x);
      }
    } else {
      const int64_t row = b / t.chunks;
      const int64_t k = b % t.chunks;
      const int64_t begin = k * t.chunk;
      A s_dy = 0, s_dyx = 0, s_x = 0;
      row_sums<scalar_t, V>(dy + row * t.row_items * V, x + row * t.row_items * V, begin,
                            min(t.row_items, begin + t.chunk), threadIdx.x, blockDim.x,
                            recompute(row), ep, s_dy, s_dyx, s_x);
      if (x_sums) {
        block_sums(scratch, s_dy, s_dyx, s_x);
      } else {
        block_sums(scratch, s_dy, s_dyx);
      }
      if (threadIdx.x == 0) {
        store_pair(partial + b * 2, s_dy, s_dyx);
        store_x_sum(ep, b, s_x);
      }
    }
  }
}

// dx of V lanes from the lanes' coefficients and, with kFused, the values
// they recompute g and s from (r(e): lane e's Recompute).
template <typename scalar_t, int V, bool kFused, typename CoefOf, typename RecomputeOf>
__device__ __forceinline__ Vec<scalar_t, V> fused_dx_vec(const Vec<scalar_t, V>& g,
                                                         const Vec<scalar_t, V>& v, CoefOf coef,
                                                         RecomputeOf r,
                                                         const BackwardEpilogue<scalar_t, kFused>& ep) {
  if constexpr (kFused) {
    using A = acc_t<scalar_t>;
    A centred[V], grad[V];
    recompute_lanes<scalar_t, V>(g, v, ep, r, centred, grad);
    Vec<scalar_t, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const Coef<A> c = coef(e);
      out.val[e] = static_cast<scalar_t>(c.alpha * grad[e] - c.k1 - centred[e] * c.k2);
    }
    return out;
  } else {
    return dx_vec<scalar_t, V>(g, v, coef);
  }
}

template <typename scalar_t, int V, bool kFused>
__global__ void __launch_bounds__(kBackwardThreads,
                                  backward_contiguous_blocks_per_sm<scalar_t, V, kFused>())
    groupnorm_backward_dx_contiguous_kernel(
        const scalar_t* __restrict__ dy,                 // [N * C, HxW]
        const scalar_t* __restrict__ x,                  // [N * C, HxW]
        const Coef<acc_t<scalar_t>>* __restrict__ coef,  // [N*C]
        scalar_t* __restrict__ dx,                       // [N * C, HxW]
        BackwardTiles t, const acc_t<scalar_t>* __restrict__ mean,
        const scalar_t* __restrict__ gamma, int C, int D,
        const BackwardEpilogue<scalar_t, kFused> ep) {  // mean, gamma, C, D: kFused reads them
  using VecT = Vec<scalar_t, V>;
  using A = acc_t<scalar_t>;
  griddep_wait();  // the coefficients (through the affine kernel, when it runs between)
  for (int64_t i = blockIdx.x; i < t.tiles; i += gridDim.x) {
    const int64_t b = t.tiles - 1 - i;  // reverse: the sums kernel's last tiles are in L2
    int64_t row, begin = 0, end = t.row_items;
    int lane = threadIdx.x, width = blockDim.x;
    if (t.warp_rows) {
      row = b * kBackwardWarps + threadIdx.x / kWarp;
      if (row >= t.rows) continue;
      lane = threadIdx.x % kWarp;
      width = kWarp;
    } else {
      row = b / t.chunks;
      begin = (b % t.chunks) * t.chunk;
      end = min(t.row_items, begin + t.chunk);
    }
    const int64_t offset = row * t.row_items * V;
    const Coef<A> k = coef[row];
    const Recompute<A> r = channel_recompute<scalar_t>(row / C, row % C, C / D, D, mean, gamma, ep);
    load_each<backward_unroll<kFused>(), scalar_t, V>(
        begin + lane, end, width, V,
        [&](int64_t j, const VecT& g, const VecT& v) {
          store_vec_streaming<scalar_t, V>(
              dx + offset + j * V,
              fused_dx_vec<scalar_t, V>(g, v, [&](int) { return k; }, [&](int) { return r; }, ep));
        },
        dy + offset, x + offset);
  }
}

// ---------------------------------------------------------------------------
// Channels-last (N, HxW, C). Thread (trow, col) of a CTA walks rows
// first + trow, first + trow + trows, ... of its chunk at vector column
// cb * block_cols + col.
// ---------------------------------------------------------------------------
struct ChannelsLastTile {
  int64_t n, first_row, end_row;
  int col;      // vector column of this thread (valid if active)
  int trow;     // row lane of this thread
  int trows;    // row lanes of the CTA
  bool active;  // has a column and a row lane
  int col_in_block, cols_here;

  __device__ ChannelsLastTile(const BackwardTiles& t, int64_t b, int C, int V) {
    n = b / (t.chunks * t.cblocks);
    const int64_t rest = b % (t.chunks * t.cblocks);
    const int64_t k = rest / t.cblocks;
    const int cb = int(rest % t.cblocks);
    first_row = k * t.chunk;
    end_row = min(t.row_items, first_row + t.chunk);
    trows = kBackwardThreads / t.block_cols;
    col_in_block = threadIdx.x % t.block_cols;
    trow = threadIdx.x / t.block_cols;
    col = cb * t.block_cols + col_in_block;
    cols_here = min(t.block_cols, C / V - cb * t.block_cols);
    active = trow < trows && col_in_block < cols_here;
  }
};

template <typename scalar_t, int V, bool kFused>
__global__ void __launch_bounds__(kBackwardThreads,
                                  backward_channels_last_sums_blocks_per_sm<scalar_t, V, kFused>())
    groupnorm_backward_sums_channels_last_kernel(
        const scalar_t* __restrict__ dy,           // [N, HxW, C]
        const scalar_t* __restrict__ x,            // [N, HxW, C]
        const acc_t<scalar_t>* __restrict__ mean,  // [N, G]
        const scalar_t* __restrict__ gamma,        // [C] or nullptr (kFused reads it)
        acc_t<scalar_t>* __restrict__ partial,     // [N, chunks, C, 2]
        BackwardTiles t, int C, int D, const BackwardEpilogue<scalar_t, kFused> ep) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  // [trows][block_cols * V] per-thread sums, then added down each column.
  __shared__ A red_dy[kBackwardThreads * V], red_dyx[kBackwardThreads * V];
  __shared__ A red_x[kFused ? kBackwardThreads * V : 1];
  griddep_release();  // the coefficients kernel may launch
  const int G = C / D;
  const bool x_sums = wants_x_sums(ep);
  for (int64_t b = blockIdx.x; b < t.tiles; b += gridDim.x) {
    const ChannelsLastTile tile(t, b, C, V);
    // per lane: the mean, or with kFused the channel's Recompute and sum of s - mean
    std::conditional_t<kFused, Recompute<A>, A> r[V];
    A s_dy[V], s_dyx[V], s_x[kFused ? V : 1];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      s_dy[e] = s_dyx[e] = 0;
      if constexpr (kFused) {
        s_x[e] = 0;
        r[e] = tile.active ? recompute_of(tile.n, tile.col * V + e, G, mean, gamma, ep)
                           : Recompute<A>{};
      } else {
        r[e] = tile.active ? mean[tile.n * G + (tile.col * V + e) / D] : A(0);
      }
    }
    if (tile.active) {
      const int64_t base = tile.n * t.row_items * C + int64_t(tile.col) * V;
      load_each<backward_unroll<kFused>(), scalar_t, V>(
          tile.first_row + tile.trow, tile.end_row, tile.trows, C,
          [&](int64_t, const VecT& g, const VecT& v) {
            if constexpr (kFused) {
              A centred[V], grad[V];
              recompute_lanes<scalar_t, V>(g, v, ep, [&](int e) { return r[e]; }, centred, grad);
#pragma unroll
              for (int e = 0; e < V; ++e) {
                s_dy[e] += grad[e];
                s_dyx[e] += grad[e] * centred[e];
                s_x[e] += centred[e];
              }
            } else {
#pragma unroll
              for (int e = 0; e < V; ++e) {
                const A d = static_cast<A>(g.val[e]);
                s_dy[e] += d;
                s_dyx[e] += d * (static_cast<A>(v.val[e]) - r[e]);
              }
            }
          },
          dy + base, x + base);
    }
    __syncthreads();  // the tables may still be read for the previous tile
    if (tile.trow < tile.trows) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int entry = tile.trow * t.block_cols * V + tile.col_in_block * V + e;
        red_dy[entry] = s_dy[e];
        red_dyx[entry] = s_dyx[e];
        if constexpr (kFused) {
          if (x_sums) red_x[entry] = s_x[e];
        }
      }
    }
    __syncthreads();
    const int width = tile.cols_here * V;
    const int64_t k = (b % (t.chunks * t.cblocks)) / t.cblocks;
    const int64_t c_first = int64_t(tile.col - tile.col_in_block) * V;
    const int64_t first_pair = (tile.n * t.chunks + k) * C + c_first;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
      A a = 0, q = 0, sx = 0;
      for (int lane_row = 0; lane_row < tile.trows; ++lane_row) {  // row-lane order: fixed
        const int entry = lane_row * t.block_cols * V + j;
        a += red_dy[entry];
        q += red_dyx[entry];
        if (x_sums) sx += red_x[entry];
      }
      store_pair(partial + (first_pair + j) * 2, a, q);
      store_x_sum(ep, first_pair + j, sx);
    }
  }
}

template <typename scalar_t, int V, bool kFused>
__global__ void __launch_bounds__(kBackwardThreads) groupnorm_backward_dx_channels_last_kernel(
    const scalar_t* __restrict__ dy,                 // [N, HxW, C]
    const scalar_t* __restrict__ x,                  // [N, HxW, C]
    const Coef<acc_t<scalar_t>>* __restrict__ coef,  // [N, C]
    scalar_t* __restrict__ dx,                       // [N, HxW, C]
    BackwardTiles t, int C, const acc_t<scalar_t>* __restrict__ mean,
    const scalar_t* __restrict__ gamma, int D,
    const BackwardEpilogue<scalar_t, kFused> ep) {  // mean, gamma, D: kFused reads them
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  griddep_wait();  // the coefficients (through the affine kernel, when it runs between)
  for (int64_t i = blockIdx.x; i < t.tiles; i += gridDim.x) {
    const ChannelsLastTile tile(t, t.tiles - 1 - i, C, V);  // reverse, as the contiguous one
    if (!tile.active) continue;
    Coef<A> k[V];
    Recompute<A> r[V]{};  // read by kFused alone
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t c = int64_t(tile.col) * V + e;
      k[e] = coef[tile.n * C + c];
      if constexpr (kFused) r[e] = recompute_of(tile.n, c, C / D, mean, gamma, ep);
    }
    const int64_t base = tile.n * t.row_items * C + int64_t(tile.col) * V;
    load_each<backward_unroll<kFused>(), scalar_t, V>(
        tile.first_row + tile.trow, tile.end_row, tile.trows, C,
        [&](int64_t row, const VecT& g, const VecT& v) {
          store_vec_streaming<scalar_t, V>(
              dx + base + row * C,
              fused_dx_vec<scalar_t, V>(g, v, [&](int e) { return k[e]; },
                                        [&](int e) { return r[e]; }, ep));
        },
        dy + base, x + base);
  }
}

// ---------------------------------------------------------------------------
// Both layouts.
// ---------------------------------------------------------------------------

// Where the partial pairs of one launch lie: pair (n, c, k) is at
// partial + (n * stride_n + c * stride_c + k * stride_k) * 2.
struct PartialLayout {
  int64_t chunks, stride_n, stride_c, stride_k;
};

// The coefficients of one (sample, group) `unit`, with the whole block: its
// channels' pairs added over the chunks (add_pair_sets, fixed order), then
// over the group. kPairsInFlight: pairs a thread has in flight when it has at
// least 4 a channel; fewer take 2. Writes the per-(sample, channel) affine
// pairs (sum(dy), sum(dy * xhat)), unless affine_pairs is null, and the dx
// coefficients of every channel of the group, unless coef is null. With
// kFused the channel sums are of g (backward_epilogue.cuh): it writes dshift
// and dscale from them, scales them by (1 + scale), and writes dadd once the
// coefficients are known (coef must not be null then).
template <typename scalar_t, int kPairsInFlight, bool kFused = false>
__device__ void unit_coefficients(const acc_t<scalar_t>* partial,            // see PartialLayout
                                  const acc_t<scalar_t>* __restrict__ mean,  // [N, G]
                                  const acc_t<scalar_t>* __restrict__ rstd,  // [N, G]
                                  const scalar_t* __restrict__ gamma,        // [C] or nullptr
                                  acc_t<scalar_t>* affine_pairs,             // [N, C, 2] or nullptr
                                  Coef<acc_t<scalar_t>>* coef,               // [N, C] or nullptr
                                  int64_t unit, int C, int G, int64_t HxW, PartialLayout at,
                                  acc_t<scalar_t>* red_dy,    // [blockDim.x] shared
                                  acc_t<scalar_t>* red_dyx,   // [blockDim.x] shared
                                  acc_t<scalar_t>* scratch,   // [2 * warps] shared
                                  const BackwardEpilogue<scalar_t, kFused>& ep = {}) {
  using A = acc_t<scalar_t>;
  const int D = C / G;
  const auto weight = [&](int c) { return gamma != nullptr ? static_cast<A>(gamma[c]) : A(1); };
  const int64_t n = unit / G;
  const int c0 = int(unit % G) * D;
  const A mu = mean[unit];
  const A rs = rstd[unit];
  // (1 + scale[n, c]) with kFused: what the channel's sums of g are multiplied by
  const auto modulation = [&](int c) {
    if constexpr (kFused) {
      if (ep.forward.scale != nullptr) return A(1) + static_cast<A>(ep.forward.scale[n * C + c]);
    }
    return A(1);
  };
  const A* channels = partial + (n * at.stride_n + int64_t(c0) * at.stride_c) * 2;
  A s1 = 0, s2 = 0;  // sum(g) and sum(g * (x - mu)) over the group: per-thread parts
  const auto store = [&](int d, A t_dy, A t_dyx) {
    const int c = c0 + d;
    if constexpr (kFused) {
      const A m = store_scale_shift_gradients(ep, n, c, weight(c), rs, t_dy, t_dyx);
      t_dy *= m;
      t_dyx *= m;
      if (ep.channel_sums != nullptr) ep.channel_sums[(n * C + c) * 2] = weight(c) * t_dy;
    }
    if (affine_pairs != nullptr) store_pair(affine_pairs + (n * C + c) * 2, t_dy, t_dyx * rs);
    s1 += weight(c) * t_dy;
    s2 += weight(c) * t_dyx;
  };
  add_pair_sets<kPairsInFlight, 2>(channels, at.chunks, at.stride_c, at.stride_k, D, red_dy,
                                   red_dyx, store);
  if constexpr (kFused) {
    if (ep.x_partial != nullptr) {  // each channel's sum(s - mu) over its chunks, the block's lanes
      const A* x_sums = ep.x_partial + n * at.stride_n + int64_t(c0) * at.stride_c;
      add_sets<kPairsInFlight, 2>(
          at.chunks, D, red_dy, red_dyx,
          [&](int d, int64_t k, A& s_x, A& none) {
            s_x = x_sums[int64_t(d) * at.stride_c + k * at.stride_k];
            none = 0;
          },
          [&](int d, A s_x, A) { ep.channel_sums[(n * C + c0 + d) * 2 + 1] = s_x; });
    }
  }
  if (coef == nullptr) return;  // the same in every thread
  block_sums(scratch, s1, s2);  // its barriers also publish the channel sums stored above
  const A M = A(D) * A(HxW);
  const A k1 = rs * s1 / M;
  const A k2 = rs * rs * rs * s2 / M;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const int c = c0 + d;
    const A alpha = rs * weight(c) * modulation(c);
    coef[n * C + c] = Coef<A>{alpha, mu, k1, k2};
    if constexpr (kFused) {
      if (ep.dadd != nullptr) {
        const A* sums = ep.channel_sums + (n * C + c) * 2;
        ep.dadd[n * C + c] = static_cast<scalar_t>(rs * sums[0] - A(HxW) * k1 - k2 * sums[1]);
      }
    }
  }
}

// One CTA per (sample, group), after the sums kernel.
template <typename scalar_t, bool kFused>
__global__ void __launch_bounds__(kBackwardThreads) groupnorm_backward_coefficients_kernel(
    const acc_t<scalar_t>* __restrict__ partial,  // [N * C, chunks, 2] or [N, chunks, C, 2]
    const acc_t<scalar_t>* __restrict__ mean,     // [N, G]
    const acc_t<scalar_t>* __restrict__ rstd,     // [N, G]
    const scalar_t* __restrict__ gamma,           // [C] or nullptr
    acc_t<scalar_t>* __restrict__ affine_pairs,   // [N, C, 2] or nullptr
    Coef<acc_t<scalar_t>>* __restrict__ coef,     // [N, C] or nullptr
    int64_t N, int C, int G, int64_t HxW, PartialLayout at,
    const BackwardEpilogue<scalar_t, kFused> ep) {
  using A = acc_t<scalar_t>;
  __shared__ A red_dy[kBackwardThreads], red_dyx[kBackwardThreads], scratch[2 * kBackwardWarps];
  griddep_release();
  griddep_wait();  // the sums kernel's partials
  for (int64_t unit = blockIdx.x; unit < N * G; unit += gridDim.x) {
    unit_coefficients<scalar_t, 16, kFused>(partial, mean, rstd, gamma, affine_pairs, coef, unit,
                                            C, G, HxW, at, red_dy, red_dyx, scratch, ep);
  }
}

// dbeta[c], dgamma[c] = sums over samples of affine_pairs[n, c], in sample
// order, 16 samples' loads in flight (add_pairs).
template <typename scalar_t>
__global__ void groupnorm_backward_affine_kernel(
    const acc_t<scalar_t>* affine_pairs,  // [N, C, 2]: sum(dy), sum(dy * xhat)
    scalar_t* __restrict__ dgamma,        // [C]
    scalar_t* __restrict__ dbeta,         // [C]
    int64_t N, int C) {
  using A = acc_t<scalar_t>;
  griddep_release();
  griddep_wait();  // the pairs of the kernel before
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  A sb = 0, sg = 0;
  add_pairs<16>(affine_pairs + int64_t(c) * 2, 0, N, 1, C, sb, sg);
  dgamma[c] = static_cast<scalar_t>(sg);
  dbeta[c] = static_cast<scalar_t>(sb);
}

}  // namespace groupnorm
