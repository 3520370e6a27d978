// GroupNorm forward for channels-last input: (N, HxW, C) in memory, the layout
// of torch.channels_last / channels_last_3d (and of (N, C, L) with C
// innermost).
//
// A unit is one sample, HxW rows of C contiguous channels holding all G
// groups, or a block of whole groups of one sample (`blocks` per sample,
// C / blocks channels each): small samples cut by channels give the grid
// enough units for one CTA each, with no team barrier. T CTAs (a team)
// split the rows; each thread owns one column of V
// channels for the whole launch, so its per-channel statistics, scale and
// shift stay in registers, and rows are read with coalesced accesses of up to
// 16 bytes whatever C / G is (a column may straddle groups). A CTA keeps the
// first `kept` rows of its slice in shared memory between the sweeps: with
// the whole slice kept, x is read from DRAM once and y written once; a sample
// larger than the on-chip memory of all CTAs together reads the rest twice
// (statistics from a running update in the first sweep, then normalise).
//
// Thread layout: cols = C / V threads cover a unit's row, rows_per_step rows go in
// parallel; threads beyond cols * rows_per_step (the block is rounded up to
// whole warps) only help with the reductions.
#pragma once

#include "epilogue.cuh"
#include "team.cuh"

namespace groupnorm {

constexpr int kRowUnroll = 4;  // independent row loads in flight per thread

// 1 / n rounded to nearest (IEEE), for the running mean's update.
__device__ __forceinline__ float reciprocal(float n) { return __frcp_rn(n); }
__device__ __forceinline__ double reciprocal(double n) { return __drcp_rn(n); }

// Issues the asynchronous copies of a slice's first `rows` rows (C elements
// each, ldc apart; shared memory holds them C apart) 16 bytes a copy, spread
// over every thread of the block, when rows are whole 16-byte pieces that fit
// the block: then returns true, and a barrier must come between
// copy_to_shared_wait() and the reads. Else issues nothing and returns false.
// Against each thread's own V-element column: as many copies or fewer (a
// half or a quarter at 8- and 4-byte vectors), from every warp, with no
// per-row multiply.
template <typename scalar_t>
__device__ __forceinline__ bool copy_rows_whole_block(const scalar_t* first, int rows, int C,
                                                      int ldc, scalar_t* on_chip) {
  constexpr int kPiece = 16;
  const int row_bytes = C * int(sizeof(scalar_t));
  const int pieces = row_bytes / kPiece;  // a row's
  const bool aligned = row_bytes % kPiece == 0 && (ldc * sizeof(scalar_t)) % kPiece == 0 &&
                       reinterpret_cast<uintptr_t>(first) % kPiece == 0;
  if (!aligned || pieces == 0 || pieces > int(blockDim.x)) return false;
  const int rows_at_once = blockDim.x / pieces;
  const int tid = threadIdx.x;
  if (tid < rows_at_once * pieces) {
    const int r0 = tid / pieces;
    const uint4* from = reinterpret_cast<const uint4*>(first + int64_t(r0) * ldc) + tid % pieces;
    uint4* to = reinterpret_cast<uint4*>(on_chip + r0 * C) + tid % pieces;
    const int64_t from_step = int64_t(rows_at_once) * ldc * sizeof(scalar_t) / kPiece;
    const int to_step = rows_at_once * pieces;
    for (int r = r0; r < rows; r += rows_at_once, from += from_step, to += to_step) {
      copy_to_shared_async(to, from);
    }
  }
  return true;
}

template <typename scalar_t, int V, bool kFused, Store kStore>
__global__ void __launch_bounds__(kChannelsLastMaxThreads, 1)
    groupnorm_forward_channels_last_kernel(
        const scalar_t* __restrict__ x,       // [N, HxW, C]
        const scalar_t* __restrict__ gamma,   // [C] or nullptr
        const scalar_t* __restrict__ beta,    // [C] or nullptr
        scalar_t* __restrict__ y,             // [N, HxW, C]
        acc_t<scalar_t>* __restrict__ mean,   // [N, G]
        acc_t<scalar_t>* __restrict__ rstd,   // [N, G]
        const Epilogue<scalar_t, kFused> ep,  // scale, shift [N, ldc]
        TeamWorkspace<acc_t<scalar_t>> ws, int64_t units, int64_t HxW, int ldc, int blocks, int C,
        int G, int D, int rows_per_step, int T, int64_t rows_per_slice, int64_t kept,
        acc_t<scalar_t> eps) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  // The reduction table holds one entry per (row lane, channel): [rows_per_step][C].
  SharedLayout<A> sh(smem, kept * C * sizeof(scalar_t), G, rows_per_step * C);
  scalar_t* on_chip = reinterpret_cast<scalar_t*>(sh.slice);

  const int team = blockIdx.x / T;
  const int rank = blockIdx.x % T;
  const int teams = gridDim.x / T;
  const int tid = threadIdx.x;
  const int cols = C / V;
  const int col = tid % cols;
  const int row_lane = tid / cols;  // >= rows_per_step: reductions only
  const bool sweeps = row_lane < rows_per_step;
  const int c0 = col * V;
  int group[V];  // group of each of this thread's channels
#pragma unroll
  for (int e = 0; e < V; ++e) group[e] = (c0 + e) / D;
  const int64_t first_row = int64_t(rank) * rows_per_slice;
  const int64_t rows = first_row < HxW ? min(rows_per_slice, HxW - first_row) : 0;
  const int nkept = int(min(rows, kept));  // rows in shared memory: far below 2^31
  const SliceCounts<A> count_of{rows_per_slice, HxW, D};
  const A local_count = A(rows * D);

  int round = 0;
  // C and G are the unit's channels and groups; rows are ldc channels apart.
  for (int64_t unit = team; unit < units; unit += teams, ++round) {
    const int64_t n = unit / blocks;
    const int64_t c_unit = (unit % blocks) * C;  // the unit's first channel
    const int64_t offset = (n * HxW + first_row) * ldc + c_unit;
    const scalar_t* first = x + offset;  // this slice's first row
    const scalar_t* xs = first + c0;
    const int64_t y_at = offset + c0;  // this thread's column of the slice's first row in y
    scalar_t* ks = on_chip + c0;
    // with the prologue, s = x + add of a kept row's vector (the host gives
    // a call with an add this kernel only when its whole slice is kept)
    const auto value = [&](const VecT& v) {
      if constexpr (kFused) {
        if (ep.add != nullptr) {  // read again a row: nothing held across the sweeps
          VecT a;
#pragma unroll
          for (int e = 0; e < V; ++e) a.val[e] = ep.add[n * ldc + c_unit + c0 + e];
          return rounded_sum(v, a);
        }
      }
      return v;
    };
    // the slice's first element of channel cc of the unit, the centring constant
    const auto first_of = [&](int cc) {
      return static_cast<A>(pre_norm(first[cc], n * ldc + c_unit + cc, ep));
    };

    // Sweep 1: sum x - shift per channel. The shift, the group's first
    // element in this slice, keeps the float sum small for inputs far from
    // zero. Kept rows go to shared memory by asynchronous copies, all issued
    // before the first is summed. The other rows are loaded while those
    // copies are in flight, and read only once more (sweep 3): a running
    // mean and M2 per channel of them (Welford's update, as torch's own
    // kernel uses) gives sweep 2 their M2 about the group mean as
    // M2 + n (mean - m)^2, a sum of non-negative terms.
    A shift[V], sum[V], run_mean[V], run_m2[V];
    int run_n = 0;  // rows not kept, this thread's: under 2^31
#pragma unroll
    for (int e = 0; e < V; ++e) {
      shift[e] = rows > 0 ? first_of(group[e] * D) : A(0);
      sum[e] = 0;
      run_mean[e] = 0;
      run_m2[e] = 0;
    }
    // Every thread of the block copies 16 bytes at a time where the rows
    // allow it (a barrier then comes before the reads); else each sweeping
    // thread copies its own column, and reads back only what it copied.
    const bool whole_block_copies = copy_rows_whole_block(first, nkept, C, ldc, on_chip);
    if (!whole_block_copies && sweeps) {
      const scalar_t* src = xs + int64_t(row_lane) * ldc;
      for (int r = row_lane; r < nkept; r += rows_per_step, src += int64_t(rows_per_step) * ldc) {
        copy_to_shared_async(reinterpret_cast<VecT*>(ks + r * C),
                             reinterpret_cast<const VecT*>(src));
      }
    }
    if (sweeps) {
      load_each<kRowUnroll, scalar_t, V>(
          nkept + row_lane, rows, rows_per_step, ldc,
          [&](int64_t, const VecT& v) {
            const A inv = reciprocal(A(++run_n));
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const A xe = static_cast<A>(v.val[e]);
              const A d = xe - run_mean[e];
              run_mean[e] += d * inv;
              run_m2[e] += d * (xe - run_mean[e]);
            }
          },
          xs);
#pragma unroll
      for (int e = 0; e < V; ++e) sum[e] = A(run_n) * (run_mean[e] - shift[e]);
    }
    copy_to_shared_wait();
    if (whole_block_copies) __syncthreads();
    if (sweeps) {
      scalar_t* kp = ks + row_lane * C;  // row r's vector; r * C stays far below 2^31
      for (int r = row_lane; r < nkept; r += rows_per_step, kp += rows_per_step * C) {
        VecT v = load_vec<scalar_t, V>(kp);
        if (has_add(ep)) {  // s kept in place of x: read back by this thread only
          v = value(v);
          *reinterpret_cast<VecT*>(kp) = v;
        }
#pragma unroll
        for (int e = 0; e < V; ++e) sum[e] += static_cast<A>(v.val[e]) - shift[e];
      }
#pragma unroll
      for (int e = 0; e < V; ++e) sh.red[row_lane * C + c0 + e] = sum[e];
    }
    __syncthreads();
    reduce_groups(sh.red, rows_per_step, C, G, D, sh.local_mean);
    for (int g = tid; g < G; g += blockDim.x) {
      sh.local_mean[g] = rows > 0 ? first_of(g * D) + sh.local_mean[g] / local_count : A(0);
    }
    __syncthreads();

    // Sweep 2: sum of squares about this slice's group means.
    if (sweeps) {
      A m[V], m2[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        m[e] = sh.local_mean[group[e]];
        const A d = run_mean[e] - m[e];
        m2[e] = run_m2[e] + A(run_n) * d * d;
      }
      const scalar_t* kp = ks + row_lane * C;
      for (int r = row_lane; r < nkept; r += rows_per_step, kp += rows_per_step * C) {
        const VecT v = load_vec<scalar_t, V>(kp);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const A d = static_cast<A>(v.val[e]) - m[e];
          m2[e] += d * d;
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) sh.red[row_lane * C + c0 + e] = m2[e];
    }
    __syncthreads();
    reduce_groups(sh.red, rows_per_step, C, G, D, sh.local_m2);

    team_combine(ws, team, rank, T, round, G, count_of, A(HxW * D), eps, sh.local_mean, sh.local_m2,
                 sh.mean, sh.rstd, sh.red, mean + unit * G, rstd + unit * G);

    // Sweep 3: y = (x - mean) * a + b per channel (channel_affine: a = rstd
    // * gamma, b = beta, and the epilogue's scale and shift), then the
    // epilogue. The rows not kept go first, while L2 still holds what sweep 1
    // read of them.
    if (sweeps) {
      A mu[V];
      ChannelAffine<A> f[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        mu[e] = sh.mean[group[e]];
        f[e] = channel_affine(n, c_unit + c0 + e, sh.rstd[group[e]], gamma, beta, ep);
      }
      const auto normalise_to = [&](int64_t at, const VecT& v) {  // y + at
        A out[V];
#pragma unroll
        for (int e = 0; e < V; ++e) out[e] = affine_value(v.val[e], mu[e], f[e]);
        store_output<scalar_t, V, kFused, true, true, kStore>(y, at, out, ep);
      };
      load_each<kRowUnroll, scalar_t, V>(
          nkept + row_lane, rows, rows_per_step, ldc,
          [&](int64_t r, const VecT& v) { normalise_to(y_at + r * ldc, v); }, xs);
      // the kept rows: their offsets in y stepped, not multiplied, a row at a time
      const scalar_t* kp = ks + row_lane * C;
      int64_t at = y_at + int64_t(row_lane) * ldc;
      for (int r = row_lane; r < nkept;
           r += rows_per_step, kp += rows_per_step * C, at += int64_t(rows_per_step) * ldc) {
        normalise_to(at, load_vec<scalar_t, V>(kp));
      }
    }
    __syncthreads();  // the kept rows and shared statistics are reused
  }
  team_leave(ws, team, T);
}

}  // namespace groupnorm
