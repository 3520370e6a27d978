// Deterministic reductions shared by every kernel: warp and block sums, the
// per-group sum of a per-thread table, Chan merges of (count, mean, M2)
// partials, and sums of (a, b) pair sets. Every order is fixed, so results
// never depend on timing.
#pragma once

#include "vec.cuh"

namespace groupnorm {

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

namespace detail {
template <typename A>
__device__ __forceinline__ A column_sum(const A* scratch, int k, int warps) {
  A total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[k * warps + w];
  return total;
}
}  // namespace detail

// Sums each of the values over the block, in a fixed order, with one pair of
// barriers for all of them; every thread gets the totals. `scratch` holds
// (number of values) * blockDim.x / 32 values. The values are references,
// not an array: an array argument made the stream backward spill.
template <typename A, typename... Values>
__device__ __forceinline__ void block_sums(A* scratch, A& first, Values&... rest) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  first = warp_sum(first);
  ((rest = warp_sum(rest)), ...);
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) {
    int k = 0;
    scratch[k++ * warps + warp] = first;
    ((scratch[k++ * warps + warp] = rest), ...);
  }
  __syncthreads();
  if constexpr (sizeof...(rest) == 1) {  // both columns in one loop: fewer live registers
    A total_first = 0, total_rest = 0;
    for (int w = 0; w < warps; ++w) {
      total_first += scratch[w];
      total_rest += scratch[warps + w];
    }
    first = total_first;
    ((rest = total_rest), ...);
  } else {
    int k = 0;
    first = detail::column_sum(scratch, k++, warps);
    ((rest = detail::column_sum(scratch, k++, warps)), ...);
  }
}

template <typename A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
  block_sums(scratch, v);
  return v;
}

// Sums a per-thread table red[rows][cols] into one value per group, where
// group g owns columns [g * cols_per_group, (g + 1) * cols_per_group). One warp
// per group. Ends with a barrier so out[] is visible to the whole block.
template <typename A>
__device__ void reduce_groups(const A* red, int rows, int cols, int groups, int cols_per_group,
                              A* out) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int entries = rows * cols_per_group;
  for (int g = warp; g < groups; g += warps) {
    A s = 0;
    for (int e = lane; e < entries; e += kWarp) {
      const int r = e / cols_per_group;
      const int c = e - r * cols_per_group;
      s += red[r * cols + g * cols_per_group + c];
    }
    s = warp_sum(s);
    if (lane == 0) out[g] = s;
  }
  __syncthreads();
}

// A long serial sum with Kahan's compensation: its error stays a few ulps
// of the total instead of growing with the number of terms. Once the sum is
// inf or NaN it stays what a plain sum would be (the carry would be NaN).
template <typename A>
struct CompensatedSum {
  A sum = 0, carry = 0;
  __device__ __forceinline__ void add(A v) {
    const A y = v - carry;
    const A t = sum + y;
    if (!isfinite(t)) {
      sum = t;
      carry = 0;
      return;
    }
    carry = (t - sum) - y;
    sum = t;
  }
};

// Running statistics of a set of values: count, mean, sum of squared
// deviations. merge() is Chan et al.'s pairwise update.
template <typename A>
struct Stats {
  A n, mean, m2;
  __device__ __forceinline__ void merge(A n_b, A mean_b, A m2_b) {
    const A total = n + n_b;
    if (n_b == A(0)) return;
    const A delta = mean_b - mean;
    const A share = n_b / total;
    mean += delta * share;
    m2 += m2_b + delta * delta * n * share;
    n = total;
  }
};

// Elements per group that slice `rank` covers: `per_slice` items of
// `multiplier` elements each, out of `total_items`; the last slices may be
// short or empty.
template <typename A>
struct SliceCounts {
  int64_t per_slice, total_items, multiplier;
  __device__ __forceinline__ A operator()(int rank) const {
    const int64_t first = int64_t(rank) * per_slice;
    const int64_t items = first < total_items ? min(per_slice, total_items - first) : 0;
    return A(items * multiplier);
  }
};

// Merges the T (mean, M2) partials of groups [g_begin, g_end) (partial
// [T, groups, 2], read through L2) with the whole block: `per_group` threads
// (a power of two) share a group, each merging every per_group-th partial,
// then a fixed tree (shuffles within a warp, `scratch` across warps) brings
// them to the group's first thread, which calls done(g, stats).
template <typename A, typename CountOf, typename Done>
__device__ void merge_partials(const A* partial, int T, int groups, int g_begin, int g_end,
                               CountOf count_of, A* scratch, Done done) {
  const int span = g_end - g_begin;
  int per_group = 1;
  while (per_group < T && per_group * 2 * span <= int(blockDim.x)) per_group *= 2;
  const int width = min(per_group, kWarp);
  const int sub = threadIdx.x % per_group;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps_per_group = per_group / width;
  const int slots = blockDim.x / per_group;
  const int warps = blockDim.x / kWarp;
  for (int base = g_begin; base < g_end; base += slots) {  // same trip count in every thread
    const int g = base + int(threadIdx.x) / per_group;
    Stats<A> acc{0, 0, 0};
    if (g < g_end && threadIdx.x < slots * per_group) {
      int r = sub;
      for (; r + 3 * per_group < T; r += 4 * per_group) {  // four loads in flight
        A m[4], q[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          m[u] = __ldcg(&partial[(int64_t(r + u * per_group) * groups + g) * 2]);
          q[u] = __ldcg(&partial[(int64_t(r + u * per_group) * groups + g) * 2 + 1]);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) acc.merge(count_of(r + u * per_group), m[u], q[u]);
      }
      for (; r < T; r += per_group) {
        acc.merge(count_of(r), __ldcg(&partial[(int64_t(r) * groups + g) * 2]),
                  __ldcg(&partial[(int64_t(r) * groups + g) * 2 + 1]));
      }
    }
    for (int offset = 1; offset < width; offset *= 2) {  // lane absorbs lane + offset
      const A n_b = __shfl_down_sync(0xffffffffu, acc.n, offset, width);
      const A mean_b = __shfl_down_sync(0xffffffffu, acc.mean, offset, width);
      const A m2_b = __shfl_down_sync(0xffffffffu, acc.m2, offset, width);
      if (lane % (2 * offset) == 0) acc.merge(n_b, mean_b, m2_b);
    }
    if (warps_per_group > 1) {  // then the warps of a group, in warp order
      __syncthreads();
      if (lane == 0) {
        scratch[warp] = acc.n;
        scratch[warps + warp] = acc.mean;
        scratch[2 * warps + warp] = acc.m2;
      }
      __syncthreads();
      if (sub == 0) {
        for (int w = 1; w < warps_per_group; ++w) {
          acc.merge(scratch[warp + w], scratch[warps + warp + w], scratch[2 * warps + warp + w]);
        }
      }
    }
    if (g < g_end && sub == 0 && threadIdx.x < slots * per_group) done(g, acc);
  }
}

// One (a, b) pair, read through L2 in one load: pairs are written by the
// same launch (stream kernels) or the launch before (coefficients).
template <typename A>
__device__ __forceinline__ void load_pair_l2(const A* p, A& first, A& second) {
  if constexpr (sizeof(A) == 4) {
    const float2 q = __ldcg(reinterpret_cast<const float2*>(p));
    first = q.x;
    second = q.y;
  } else {
    const double2 q = __ldcg(reinterpret_cast<const double2*>(p));
    first = q.x;
    second = q.y;
  }
}

template <typename A>
__device__ __forceinline__ void store_pair(A* p, A a, A b) {
  p[0] = a;
  p[1] = b;
}

// Adds pairs first, first + step, ... below end (load(k, a, b) reads pair k)
// into s1 and s2 in that order, kInFlight loads in flight (a plain loop
// waits for each load before issuing the next).
template <int kInFlight, typename A, typename Load>
__device__ __forceinline__ void add_loaded(Load load, int64_t first, int64_t end, int64_t step,
                                           A& s1, A& s2) {
  for (int64_t k0 = first; k0 < end; k0 += kInFlight * step) {
    A a[kInFlight], q[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (k0 + u * step < end) load(k0 + u * step, a[u], q[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (k0 + u * step < end) {
        s1 += a[u];
        s2 += q[u];
      }
    }
  }
}

// add_loaded of the pairs at p + k * stride * 2, read through L2.
template <int kInFlight, typename A>
__device__ __forceinline__ void add_pairs(const A* p, int64_t first, int64_t end, int64_t step,
                                          int64_t stride, A& s1, A& s2) {
  add_loaded<kInFlight>([&](int64_t k, A& a, A& q) { load_pair_l2(p + k * stride * 2, a, q); },
                        first, end, step, s1, s2);
}

// For each j < width, adds the `count` pairs of set j (load(j, k, a, b)
// reads pair k of set j) and calls store(j, a, b) in one thread. Threads
// take (j, lane) pairs, j fastest (coalesced where sets are adjacent), add
// their pairs in order, then the lanes of each j are added in order.
// kInFlight: pairs a thread has in flight (add_loaded), or kFewInFlight when
// the sets have fewer than 4 pairs a lane: chosen inside the one loop, which
// keeps a kernel's code small (a latency-bound kernel pays for its size).
// red_a, red_b: blockDim.x values of shared memory each.
template <int kInFlight, int kFewInFlight = kInFlight, typename A, typename Load, typename Store>
__device__ __forceinline__ void add_sets(int64_t count, int width, A* red_a, A* red_b, Load load,
                                         Store store) {
  const int tid = threadIdx.x;
  const int span = min(width, int(blockDim.x));  // sets at a time
  const int lanes = int(blockDim.x) / span;
  const int j_in = tid % span;
  const int lane = tid / span;
  const bool few = kFewInFlight != kInFlight && count < 4 * lanes;
  for (int j0 = 0; j0 < width; j0 += span) {
    A a = 0, b = 0;
    if (lane < lanes && j0 + j_in < width) {
      const int j = j0 + j_in;
      const auto load_j = [&](int64_t k, A& first, A& second) { load(j, k, first, second); };
      if constexpr (kFewInFlight != kInFlight) {
        if (few) {
          add_loaded<kFewInFlight>(load_j, lane, count, lanes, a, b);
        } else {
          add_loaded<kInFlight>(load_j, lane, count, lanes, a, b);
        }
      } else {
        add_loaded<kInFlight>(load_j, lane, count, lanes, a, b);
      }
    }
    __syncthreads();  // the tables may still be read from the last pass
    red_a[tid] = a;
    red_b[tid] = b;
    __syncthreads();
    if (tid < span && j0 + tid < width) {
      A ta = 0, tb = 0;
      for (int l = 0; l < lanes; ++l) {
        ta += red_a[l * span + tid];
        tb += red_b[l * span + tid];
      }
      store(j0 + tid, ta, tb);
    }
  }
}

// add_sets of the pairs at base + (j * set_stride + k * pair_stride) * 2,
// read through L2.
template <int kInFlight, int kFewInFlight = kInFlight, typename A, typename Store>
__device__ __forceinline__ void add_pair_sets(const A* base, int64_t count, int64_t set_stride,
                                              int64_t pair_stride, int width, A* red_a, A* red_b,
                                              Store store) {
  add_sets<kInFlight, kFewInFlight>(
      count, width, red_a, red_b,
      [&](int j, int64_t k, A& a, A& q) {
        load_pair_l2(base + (int64_t(j) * set_stride + k * pair_stride) * 2, a, q);
      },
      store);
}

}  // namespace groupnorm
