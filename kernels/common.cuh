// Device helpers shared by every GroupNorm kernel: accumulation types, vector
// access, the deterministic reductions, and the team barrier that lets several
// CTAs share one group's statistics.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace groupnorm {

constexpr int kWarp = 32;

// Statistics are accumulated in float for half, bfloat16 and float, in double
// for double, as PyTorch's acc_type does.
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

// V consecutive elements moved as one access of V * sizeof(T) bytes (at most
// 16). Callers guarantee the alignment; the host checks it before picking V.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T val[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

// Output is written once and not read again by this kernel: evict-first keeps
// L2 for the input.
template <typename T, int V>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T, V>& v) {
  if constexpr (sizeof(T) * V == 16) {
    __stcs(reinterpret_cast<float4*>(p), *reinterpret_cast<const float4*>(&v));
  } else if constexpr (sizeof(T) * V == 8) {
    __stcs(reinterpret_cast<float2*>(p), *reinterpret_cast<const float2*>(&v));
  } else {
    store_vec<T, V>(p, v);
  }
}

// Starts copying one vector from global to shared memory without passing
// through registers (cp.async, sm_80 and later), so that a CTA can put its
// whole kept slice in flight at once rather than the few vectors its
// registers hold. Plain copies on older devices and for 2-byte vectors,
// which cp.async does not move. No L2 eviction hint: marking the copied
// lines evict-first made KernelBench L2-92 slower on an H100 (80 -> 75 % of
// the floor; 82 % without the hint, benchmarks/README.md, run AD).
// copy_to_shared_wait() completes this thread's copies; each thread reads
// back only what it copied, so no barrier is needed before it does.
template <typename VecT>
__device__ __forceinline__ void copy_to_shared_async(VecT* dst, const VecT* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(VecT) == 4 || sizeof(VecT) == 8 || sizeof(VecT) == 16) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    if constexpr (sizeof(VecT) == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" : : "r"(to), "l"(src) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;"
                   :
                   : "r"(to), "l"(src), "n"(int(sizeof(VecT)))
                   : "memory");
    }
    return;
  }
#endif
  *dst = *src;
}

__device__ __forceinline__ void copy_to_shared_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Calls f(v, i) (or f(v)) for the vectors at xs + i * stride, i = begin,
// begin + step, ... < end, with kInFlight loads issued before the first use:
// input not kept on chip comes from L2 or DRAM, where one load at a time
// would leave the memory pipe idle.
template <int kInFlight, typename scalar_t, int V, typename F>
__device__ __forceinline__ void load_each(const scalar_t* xs, int64_t stride, int64_t begin,
                                          int64_t end, int step, F&& f) {
  using VecT = Vec<scalar_t, V>;
  for (int64_t i0 = begin; i0 < end; i0 += int64_t(kInFlight) * step) {
    VecT v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = i0 + int64_t(u) * step;
      if (i < end) v[u] = load_vec<scalar_t, V>(xs + i * stride);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = i0 + int64_t(u) * step;
      if (i < end) {
        if constexpr (std::is_invocable_v<F, const VecT&, int64_t>) {
          f(v[u], i);
        } else {
          f(v[u]);
        }
      }
    }
  }
}

// n / d for 0 <= n < 2^31 with a multiply and a shift (as c10's IntDivider).
struct FastDivider {
  uint32_t magic, shift;
  __host__ explicit FastDivider(uint32_t d) {
    for (shift = 0; shift < 32; ++shift) {
      if ((1ull << shift) >= d) break;
    }
    const uint64_t one = 1;
    magic = uint32_t(((one << 32) * ((one << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    const uint32_t t = __umulhi(n, magic);
    return (t + n) >> shift;
  }
};

// y = (x - mean) * scale + shift for one channel, with scale = rstd * gamma[c]
// and shift = beta[c]. Subtracting the mean first keeps shifted inputs
// accurate (x * scale + (shift - mean * scale) would cancel).
template <typename A>
struct ChannelAffine {
  A scale, shift;
};

template <typename scalar_t, typename A>
__device__ __forceinline__ ChannelAffine<A> channel_affine(int64_t c, A rstd,
                                                           const scalar_t* __restrict__ gamma,
                                                           const scalar_t* __restrict__ beta) {
  return {gamma != nullptr ? rstd * static_cast<A>(gamma[c]) : rstd,
          beta != nullptr ? static_cast<A>(beta[c]) : A(0)};
}

template <typename scalar_t, int V, typename A>
__device__ __forceinline__ Vec<scalar_t, V> normalise_vec(const Vec<scalar_t, V>& v, A mean,
                                                          ChannelAffine<A> f) {
  Vec<scalar_t, V> out;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    out.val[e] = static_cast<scalar_t>((static_cast<A>(v.val[e]) - mean) * f.scale + f.shift);
  }
  return out;
}

// Bytes of a vector held as 32-bit words (or one 16-bit word for a 2-byte
// vector), and read back as the vector type at its use. Read-only inputs
// only: the words alias the elements' storage, which nothing writes while they are held.
template <int kBytes>
struct alignas(kBytes) Words {
  using Word = std::conditional_t<(kBytes >= 4), uint32_t, uint16_t>;
  Word w[kBytes / sizeof(Word)];
};
template <typename VecT, typename Raw>
__device__ __forceinline__ VecT as_vec(const Raw& raw) {
  if constexpr (std::is_same_v<Raw, VecT>) {
    return raw;
  } else {
    static_assert(sizeof(Raw) == sizeof(VecT), "a vector's words are its bytes");
    VecT v;
    memcpy(&v, &raw, sizeof(VecT));
    return v;
  }
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sums a per-thread table red[rows][cols] into one value per group, where
// group g owns columns [g * cols_per_group, (g + 1) * cols_per_group). One warp
// per group, fixed order: the result does not depend on timing. Ends with a
// barrier so out[] is visible to the whole block.
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

// Sum over the block of one value per thread, in a fixed order; every thread
// gets the result. `scratch` holds blockDim.x / 32 values.
template <typename A>
__device__ A block_sum(A v, A* scratch) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  A total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// block_sum of a and of b, each in block_sum's order, with one pair of
// barriers for both; `scratch` holds 2 * blockDim.x / 32 values. In the
// contiguous stream backward, which sums two values per item: 0.3-2.0
// points of the floor faster on an H200 than two block_sum calls
// (benchmarks/README.md, run AI).
template <typename A>
__device__ void block_sum2(A& a, A& b, A* scratch) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) {
    scratch[warp] = a;
    scratch[warps + warp] = b;
  }
  __syncthreads();
  A total_a = 0, total_b = 0;
  for (int w = 0; w < warps; ++w) {
    total_a += scratch[w];
    total_b += scratch[warps + w];
  }
  a = total_a;
  b = total_b;
}

// ---------------------------------------------------------------------------
// Team barrier. A team is T co-resident CTAs (a cooperative launch guarantees
// residency) that split every unit (one group, or one sample in channels-last)
// between them. In each round k:
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
// ---------------------------------------------------------------------------
constexpr int kRedundantCombine = 2048;

template <typename A>
struct TeamWorkspace {
  int* arrived;    // [teams]                   partials published, all rounds
  int* published;  // [teams]                   combiners done, all rounds
  A* partial;      // [teams, 2, T, groups, 2]  per-CTA (mean, M2)
  A* result;       // [teams, 2, groups, 2]     combined (mean, rstd)
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Adds v to *p with acquire and release semantics at GPU scope; returns the
// old value. A stream kernel's arrival count: its release publishes the
// partials written before it (by this thread, or by the block before a
// barrier), and its acquire, for the CTA that completes a unit, every other
// CTA's. In place of a fence on each side of a relaxed atomic: 0.5-2.5
// points of the floor faster on 8 of 9 stream shapes measured on an H100,
// forward, and up to 0.7 backward (run AF).
__device__ __forceinline__ int add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Makes this block's earlier global writes visible, adds one to *counter,
// and waits until it reaches target. Ends with a block-wide barrier.
// No fences: the barrier orders the block's writes before thread 0's release,
// the other CTAs' releases before its acquire, and that acquire before the
// block's later reads, and the PTX memory model's causality order is
// transitive through all three. The two fences this had (and the two of
// team_combine's second wait) cost 0.6-4.3 points of the floor on every team
// shape measured on an H100 (KernelBench L2-92: 82.6 -> 86.9 %; run AF).
__device__ __forceinline__ void arrive_and_wait(int* counter, int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    add_release(counter, 1);
    while (load_acquire(counter) < target) __nanosleep(32);
  }
  __syncthreads();
}

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
  __device__ __forceinline__ void merge(const Stats& b) { merge(b.n, b.mean, b.m2); }
};

// Elements per group that team member `rank` covers: `per_slice` items of
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

// Merges the T partials of groups [g_begin, g_end) with the whole block:
// `per_group` threads (a power of two) share a group, each merging every
// per_group-th partial, then a fixed tree (shuffles within a warp, `scratch`
// across warps) brings them to the group's first thread, which calls
// done(g, stats). The order never depends on timing.
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

// Bytes rounded up to 16, so that what is laid out after them stays aligned
// for 16-byte vectors: shared-memory slices (SharedLayout and the host's
// shared_bytes) and the counters at the head of a workspace.
__host__ __device__ constexpr int64_t round_up_to_16(int64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// Carves the dynamic shared memory of a team kernel: the kept slice first
// (16-byte aligned), then the reduction table and the per-group statistics.
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

// Dynamic shared memory of a SharedLayout.
inline size_t shared_bytes(size_t slice_bytes, int red_entries, int groups, size_t acc_size) {
  return size_t(round_up_to_16(int64_t(slice_bytes))) +
         (size_t(red_entries) + 4 * size_t(groups)) * acc_size;
}

}  // namespace groupnorm
