// Teams: T co-resident CTAs (a cooperative launch guarantees residency) that
// split every unit (one group, or a block of groups of a sample) and share
// its statistics. In each round k:
//   1. every CTA publishes its partial (mean, M2) per group and arrives;
//   2. once all T have arrived, the group statistics are combined with Chan's
//      formula in rank order (deterministic, so every CTA normalises with
//      bit-identical numbers):
//      - few partials (T * groups <= kRedundantCombine): every CTA combines
//        all of them itself, with no second wait;
//      - many: CTA r combines its share of the groups and publishes (mean,
//        rstd); the others wait for those and read them.
// Partials and results are double-buffered by round parity: a CTA can only
// reach round k + 2 after every CTA of its team has arrived at round k + 1,
// that is, after each has finished reading round k.
#pragma once

#include "layout.h"
#include "reduce.cuh"
#include "sync.cuh"

namespace groupnorm {

constexpr int kRedundantCombine = 2048;

// Counters (zero when a launch starts and when it ends: team_leave) and
// the exchanged statistics of every team.
constexpr int kTeamCounters = 3;  // ints a team: arrived, published, left

template <typename A>
struct TeamWorkspace {
  int* arrived;    // [teams]                   partials published, all rounds
  int* published;  // [teams]                   combiners done, all rounds
  int* left;       // [teams]                   CTAs done with the two above
  A* partial;      // [teams, 2, T, groups, 2]  per-CTA (mean, M2)
  A* result;       // [teams, 2, groups, 2]     combined (mean, rstd)
};

// Makes this block's earlier global writes visible, adds one to *counter,
// and waits until it reaches target. Ends with a block-wide barrier. No
// fences: the barrier orders the block's writes before thread 0's release,
// the other CTAs' releases before its acquire, and that acquire before the
// block's later reads; causality order is transitive through all three.
__device__ __forceinline__ void arrive_and_wait(int* counter, int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    add_release(counter, 1);
    while (load_acquire(counter) < target) __nanosleep(32);
  }
  __syncthreads();
}

// Combines per-CTA statistics into (mean, rstd) per group, written to
// mean_s/rstd_s (shared) and to mean_out/rstd_out (global, by one CTA).
//   local_mean/local_m2: this CTA's statistics per group (shared)
//   count_of(rank):      elements per group that CTA `rank` covered
//   scratch:             3 * blockDim.x / 32 values of shared memory
// With T == 1 no other CTA takes part and no memory outside the CTA is used.
template <typename A, typename CountOf>
__device__ void team_combine(const TeamWorkspace<A>& ws, int team, int rank, int T, int round,
                             int groups, CountOf count_of, A total_count, A eps,
                             const A* local_mean, const A* local_m2, A* mean_s, A* rstd_s,
                             A* scratch, A* mean_out, A* rstd_out) {
  if (T == 1) {
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      mean_s[g] = local_mean[g];
      rstd_s[g] = rsqrt(local_m2[g] / total_count + eps);
      mean_out[g] = mean_s[g];
      rstd_out[g] = rstd_s[g];
    }
    __syncthreads();
    return;
  }
  const int parity = round & 1;
  A* partial = ws.partial + (int64_t(team) * 2 + parity) * T * groups * 2;
  A* result = ws.result + (int64_t(team) * 2 + parity) * groups * 2;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    partial[(int64_t(rank) * groups + g) * 2 + 0] = local_mean[g];
    partial[(int64_t(rank) * groups + g) * 2 + 1] = local_m2[g];
  }
  arrive_and_wait(&ws.arrived[team], (round + 1) * T);

  const auto rstd_of = [&](const Stats<A>& st) { return rsqrt(st.m2 / total_count + eps); };
  if (int64_t(T) * groups <= kRedundantCombine) {
    merge_partials(partial, T, groups, 0, groups, count_of, scratch,
                   [&](int g, const Stats<A>& st) {
                     mean_s[g] = st.mean;
                     rstd_s[g] = rstd_of(st);
                     if (rank == 0) {
                       mean_out[g] = st.mean;
                       rstd_out[g] = rstd_s[g];
                     }
                   });
    __syncthreads();
    return;
  }
  const int share = (groups + T - 1) / T;  // groups each combiner takes
  const int combiners = (groups + share - 1) / share;
  if (rank < combiners) {
    merge_partials(partial, T, groups, rank * share, min(groups, (rank + 1) * share), count_of,
                   scratch, [&](int g, const Stats<A>& st) {
                     const A rs = rstd_of(st);
                     result[g * 2 + 0] = st.mean;
                     result[g * 2 + 1] = rs;
                     mean_out[g] = st.mean;
                     rstd_out[g] = rs;
                   });
    __syncthreads();
    if (threadIdx.x == 0) add_release(&ws.published[team], 1);
  }
  if (threadIdx.x == 0) {
    while (load_acquire(&ws.published[team]) < (round + 1) * combiners) __nanosleep(32);
  }
  __syncthreads();
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    mean_s[g] = __ldcg(&result[g * 2 + 0]);
    rstd_s[g] = __ldcg(&result[g * 2 + 1]);
  }
  __syncthreads();
}

// Called by every CTA after its last round. The last of a team to leave
// zeroes the team's counters for the next launch on the stream: the others'
// waits are over, and thread 0, which alone touches the counters, acquired
// what they did.
template <typename A>
__device__ __forceinline__ void team_leave(const TeamWorkspace<A>& ws, int team, int T) {
  if (T == 1 || threadIdx.x != 0) return;
  if (add_acq_rel(&ws.left[team], 1) == T - 1) {
    ws.arrived[team] = 0;
    ws.published[team] = 0;
    ws.left[team] = 0;
  }
}

// The dynamic shared memory of a team kernel (team_shared_bytes): the kept
// slice first (16-byte aligned), then the reduction table and the per-group
// statistics.
template <typename A>
struct SharedLayout {
  unsigned char* slice;  // kept input
  A* red;                // [red_entries] per-thread partial sums
  A* local_mean;         // [groups]
  A* local_m2;           // [groups]
  A* mean;               // [groups]
  A* rstd;               // [groups]

  __device__ SharedLayout(unsigned char* base, size_t slice_bytes, int groups, int red_entries) {
    slice = base;
    red = reinterpret_cast<A*>(base + round_up_to_16(int64_t(slice_bytes)));
    local_mean = red + red_entries;
    local_m2 = local_mean + groups;
    mean = local_m2 + groups;
    rstd = mean + groups;
  }
};

}  // namespace groupnorm
