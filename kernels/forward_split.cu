// GroupNorm forward for contiguous (N, C, *) input in three streaming
// launches, for groups so large that the team kernel would spend hundreds of
// rounds waiting at its team barrier (KernelBench L1-35: 896 groups of 8 MiB):
//   1. statistics: each unit (sample, group) is cut into `chunks` pieces, one
//      CTA each. A CTA walks its piece in tiles of kSplitThreads * kSplitItems
//      vectors held in registers: exact centred (mean, M2) per tile, merged
//      into the piece's running statistics (Chan) in tile order;
//   2. combine: one CTA per unit merges its pieces in order -> mean, rstd;
//   3. normalise: the same pieces in reverse order (the first hit what L2
//      still holds from step 1), y = (x - mean) * rstd * gamma + beta.
// Bytes: x read twice, y written once (3 passes against the 2-pass floor),
// but no CTA ever waits on another, so each pass streams at the copy rate:
// for groups needing many rounds this beats the team kernel (measured in
// benchmarks/README.md). Extra memory: (mean, M2) per piece, at most
// kMaxSplitChunks per unit: O(N * G).
#include "common.cuh"

namespace groupnorm {

constexpr int kSplitThreads = 256;
constexpr int kSplitItems = 8;  // vectors per thread per tile, in registers
constexpr int kSplitTileVecs = kSplitThreads * kSplitItems;
constexpr int64_t kMaxSplitChunks = 64;

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kSplitThreads)
    groupnorm_split_stats_kernel(const scalar_t* __restrict__ x,         // [units, L]
                                 acc_t<scalar_t>* __restrict__ partial,  // [units, chunks, 2]
                                 int64_t units, int64_t L, int64_t chunk_vecs, int64_t chunks) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  __shared__ A scratch[kSplitThreads / kWarp];
  const int64_t nvec_unit = L / V;
  for (int64_t b = blockIdx.x; b < units * chunks; b += gridDim.x) {
    const int64_t unit = b / chunks;
    const int64_t begin = (b % chunks) * chunk_vecs;
    const int64_t end = min(nvec_unit, begin + chunk_vecs);
    const VecT* xs = reinterpret_cast<const VecT*>(x + unit * L);
    Stats<A> piece{0, 0, 0};  // meaningful in thread 0
    for (int64_t t0 = begin; t0 < end; t0 += kSplitTileVecs) {
      const int64_t count = min(int64_t(kSplitTileVecs), end - t0);
      // The tile's first element as a shift keeps the float sum small for
      // inputs far from zero (1000 + randn).
      const A shift = static_cast<A>(xs[t0].val[0]);
      VecT v[kSplitItems];
      A sum = 0;
#pragma unroll
      for (int u = 0; u < kSplitItems; ++u) {
        const int64_t i = int64_t(u) * kSplitThreads + threadIdx.x;
        if (i < count) {
          v[u] = xs[t0 + i];
#pragma unroll
          for (int e = 0; e < V; ++e) sum += static_cast<A>(v[u].val[e]) - shift;
        }
      }
      const A n_tile = A(count * V);
      const A mean = shift + block_sum(sum, scratch) / n_tile;
      A m2 = 0;
#pragma unroll
      for (int u = 0; u < kSplitItems; ++u) {
        if (int64_t(u) * kSplitThreads + threadIdx.x < count) {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const A d = static_cast<A>(v[u].val[e]) - mean;
            m2 += d * d;
          }
        }
      }
      m2 = block_sum(m2, scratch);
      if (threadIdx.x == 0) piece.merge(n_tile, mean, m2);
    }
    if (threadIdx.x == 0) {
      partial[b * 2 + 0] = piece.mean;
      partial[b * 2 + 1] = piece.m2;
    }
  }
}

template <typename A>
__global__ void __launch_bounds__(kSplitThreads)
    groupnorm_split_combine_kernel(const A* __restrict__ partial,  // [units, chunks, 2]
                                   A* __restrict__ mean,           // [units]
                                   A* __restrict__ rstd,           // [units]
                                   int64_t units, int64_t L, int64_t chunk_elems, int64_t chunks,
                                   A eps) {
  __shared__ A scratch[3 * kSplitThreads / kWarp];
  const SliceCounts<A> count_of{chunk_elems, L, 1};
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    merge_partials(partial + unit * chunks * 2, int(chunks), 1, 0, 1, count_of, scratch,
                   [&](int, const Stats<A>& st) {
                     mean[unit] = st.mean;
                     rstd[unit] = rsqrt(st.m2 / A(L) + eps);
                   });
    __syncthreads();  // scratch is reused by the next unit
  }
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kSplitThreads)
    groupnorm_split_normalize_kernel(const scalar_t* __restrict__ x,            // [units, L]
                                     const scalar_t* __restrict__ gamma,        // [C] or nullptr
                                     const scalar_t* __restrict__ beta,         // [C] or nullptr
                                     const acc_t<scalar_t>* __restrict__ mean,  // [units]
                                     const acc_t<scalar_t>* __restrict__ rstd,  // [units]
                                     scalar_t* __restrict__ y,                  // [units, L]
                                     int64_t units, int64_t L, int64_t HxW, int G, int D,
                                     int64_t chunk_vecs, int64_t chunks, FastDivider hxw_div,
                                     bool fast_div) {
  using A = acc_t<scalar_t>;
  using VecT = Vec<scalar_t, V>;
  const int64_t nvec_unit = L / V;
  const int64_t pieces = units * chunks;
  for (int64_t i = blockIdx.x; i < pieces; i += gridDim.x) {
    const int64_t b = pieces - 1 - i;  // reverse: step 1's last pieces are in L2
    const int64_t unit = b / chunks;
    const int64_t begin = (b % chunks) * chunk_vecs;
    const int64_t end = min(nvec_unit, begin + chunk_vecs);
    const VecT* xs = reinterpret_cast<const VecT*>(x + unit * L);
    VecT* ys = reinterpret_cast<VecT*>(y + unit * L);
    const A mu = mean[unit];
    const A rs = rstd[unit];
    const int64_t c0 = int64_t(unit % G) * D;
    // A vector never straddles two channels (host: HxW % V == 0). Units
    // under 2^31 elements find the channel with a multiply and a shift.
    for (int64_t t0 = begin; t0 < end; t0 += kSplitTileVecs) {
      const int64_t count = min(int64_t(kSplitTileVecs), end - t0);
      VecT v[kSplitItems];
#pragma unroll
      for (int u = 0; u < kSplitItems; ++u) {
        const int64_t j = int64_t(u) * kSplitThreads + threadIdx.x;
        if (j < count) v[u] = xs[t0 + j];
      }
#pragma unroll
      for (int u = 0; u < kSplitItems; ++u) {
        const int64_t j = int64_t(u) * kSplitThreads + threadIdx.x;
        if (j < count) {
          const int64_t within = (t0 + j) * V;
          const int64_t c = c0 + (fast_div ? int64_t(hxw_div.div(uint32_t(within))) : within / HxW);
          const A a = gamma != nullptr ? rs * static_cast<A>(gamma[c]) : rs;
          const A sh = beta != nullptr ? static_cast<A>(beta[c]) : A(0);
          VecT out;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            out.val[e] = static_cast<scalar_t>((static_cast<A>(v[u].val[e]) - mu) * a + sh);
          }
          store_vec_streaming<scalar_t, V>(reinterpret_cast<scalar_t*>(ys + t0 + j), out);
        }
      }
    }
  }
}

}  // namespace groupnorm
