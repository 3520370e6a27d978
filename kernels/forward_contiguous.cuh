// GroupNorm forward for contiguous (N, C, *) input.
//
// Every (sample, group) is one contiguous run of L = D * HxW elements: a unit.
// T CTAs (a team) split each unit into slices of at most `slice` elements.
// A CTA holds the first `kept` vectors of its slice in shared memory between
// the three sweeps (sum, centred sum of squares, normalise). When the whole
// slice is kept (the usual case), x is read from DRAM once and y written once:
// 2 * numel * sizeof(T) bytes, the floor for this op. A group larger than the
// on-chip memory of all CTAs together keeps what fits and re-reads the rest,
// which L2 often still holds.
// Teams loop over units (unit = team, team + teams, ...), so the grid is
// persistent and, for T > 1, co-resident.
#pragma once

#include "epilogue.cuh"
#include "team.cuh"

namespace groupnorm {

constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread

template <typename scalar_t, int V, bool kFused, Store kStore>
__global__ void __launch_bounds__(kContiguousThreads, 4)
    groupnorm_forward_contiguous_kernel(const scalar_t* __restrict__ x,       // [N * G, L]
                                        const scalar_t* __restrict__ gamma,   // [C] or nullptr
                                        const scalar_t* __restrict__ beta,    // [C] or nullptr
                                        scalar_t* __restrict__ y,             // [N * G, L]
                                        acc_t<scalar_t>* __restrict__ mean,   // [N * G]
                                        acc_t<scalar_t>* __restrict__ rstd,   // [N * G]
                                        const Epilogue<scalar_t, kFused> ep,  // scale, shift [N, C]
                                        TeamWorkspace<acc_t<scalar_t>> ws, int64_t units, int64_t L,
                                        int64_t HxW, int G, int D, int T, int64_t slice,
                                        int64_t kept, FastDivider hxw_div, bool fast_div,
                                        acc_t<scalar_t> eps) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  SharedLayout<A> sh(smem, kept * V * sizeof(scalar_t), 1, blockDim.x);
  VecT* on_chip = reinterpret_cast<VecT*>(sh.slice);

  const int team = blockIdx.x / T;
  const int rank = blockIdx.x % T;
  const int teams = gridDim.x / T;
  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  const int64_t begin = int64_t(rank) * slice;
  const int64_t count = begin < L ? min(slice, L - begin) : 0;
  const int64_t nvec = count / V;          // host guarantees L % V == 0, slice % V == 0
  const int nkept = int(min(nvec, kept));  // vectors in shared memory: far below 2^31
  const SliceCounts<A> count_of{slice, L, 1};
  int round = 0;
  for (int64_t unit = team; unit < units; unit += teams, ++round) {
    const scalar_t* xs = x + unit * L + begin;
    const int64_t y_at = unit * L + begin;  // of the slice in y (and the residual)
    // Kept vector i of the slice with the prologue: s = x + add of its
    // channel, unit * D + the channel within the group (a vector never
    // straddles two). Only kept vectors: the host gives a call with an add
    // this kernel only when its whole slice is kept.
    const auto value = [&](int64_t i, const VecT& v) {
      if constexpr (kFused) {
        if (ep.add != nullptr) {
          const int64_t e = begin + i * V;  // the vector's first element in the unit
          const int64_t ch =
              fast_div && e < (int64_t(1) << 31) ? int64_t(hxw_div.div(uint32_t(e))) : e / HxW;
          return pre_norm_vec<scalar_t, V>(v, unit * D + ch, ep);
        }
      }
      return v;
    };

    // Sweep 1: sum x - shift. The shift (the slice's first element) keeps
    // the float sum small for inputs far from zero, such as 1000 + randn.
    // Kept vectors go to shared memory by asynchronous copies, all issued
    // before the first is summed (with the prologue, turned into s there);
    // the rest are loaded and summed while those copies are in flight.
    const A shift = count > 0 ? static_cast<A>(pre_norm(xs[0], unit * D + begin / HxW, ep)) : A(0);
    A sum = 0;
    const auto accumulate = [&](const VecT& v) {
#pragma unroll
      for (int e = 0; e < V; ++e) sum += static_cast<A>(v.val[e]) - shift;
    };
    for (int i = tid; i < nkept; i += threads) {
      copy_to_shared_async(&on_chip[i], reinterpret_cast<const VecT*>(xs + i * V));
    }
    load_each<kUnroll, scalar_t, V>(
        nkept + tid, nvec, threads, V, [&](int64_t, const VecT& v) { accumulate(v); }, xs);
    copy_to_shared_wait();
    for (int i = tid; i < nkept; i += threads) {
      if (has_add(ep)) on_chip[i] = value(i, on_chip[i]);  // s kept; read back by this thread only
      accumulate(on_chip[i]);
    }
    const A local_mean = count > 0 ? shift + block_sum(sum, sh.red) / A(count) : A(0);

    // Sweep 2: sum of squares about the slice mean (exact centring, so
    // 1000 + randn keeps its digits).
    A m2 = 0;
    const auto add_squares = [&](int64_t, const VecT& v) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A d = static_cast<A>(v.val[e]) - local_mean;
        m2 += d * d;
      }
    };
    for (int i = tid; i < nkept; i += threads) add_squares(i, on_chip[i]);
    load_each<kUnroll, scalar_t, V>(nkept + tid, nvec, threads, V, add_squares, xs);
    m2 = block_sum(m2, sh.red);
    if (tid == 0) {
      sh.local_mean[0] = local_mean;
      sh.local_m2[0] = m2;
    }
    __syncthreads();

    team_combine(ws, team, rank, T, round, 1, count_of, A(L), eps, sh.local_mean, sh.local_m2,
                 sh.mean, sh.rstd, sh.red, mean + unit, rstd + unit);
    const A mu = sh.mean[0];
    const A rs = sh.rstd[0];

    // Sweep 3: y = (x - mean) * rstd * gamma[c] + beta[c], then the
    // epilogue. A vector never straddles two channels (host: HxW % V == 0).
    const int64_t n = unit / G;
    const int64_t c0 = (unit - n * G) * D;
    const int64_t start_channel = begin / HxW;
    const int64_t start_offset = begin - start_channel * HxW;
    const auto normalise_at = [&](int64_t i, const VecT& v) {
      const int64_t within = start_offset + i * V;
      const int64_t ch =
          start_channel + (fast_div ? int64_t(hxw_div.div(uint32_t(within))) : within / HxW);
      normalise_store<scalar_t, V, true, kStore>(
          y, y_at + i * V, v, mu, channel_affine(n, c0 + ch, rs, gamma, beta, ep), ep);
    };
    for (int i = tid; i < nkept; i += threads) normalise_at(i, on_chip[i]);
    load_each<kUnroll, scalar_t, V>(nkept + tid, nvec, threads, V, normalise_at, xs);
    __syncthreads();  // the kept slice and shared statistics are reused
  }
  team_leave(ws, team, T);
}

}  // namespace groupnorm
