// KernelBench level-2 #92: conv2d -> GroupNorm -> tanh -> hardswish -> + the
// conv output -> logsumexp over channels, in three kernels that never leave
// the conv output to a library:
//   conv_partials    the convolution in float32 FMAs (no TF32), written once,
//                    and each tile's per-channel (mean, M2), centred on a
//                    value of the tile so that shifted inputs keep precision;
//   coefficients     per sample, Chan merges of the tiles and then of each
//                    group's channels in a fixed order, in double: the
//                    per-channel a = gamma * rstd and b = beta - mean * a;
//   logsumexp        one read of the conv output: r = c + hardswish(tanh(a c
//                    + b)), an online logsumexp over the channels per pixel.
// Napkin math for the problem (128 x 8 x 128^2 in, 64 channels out, K = 3):
// 9.4 G FMAs (about 0.32 ms of an H100's float32 pipes), 520 MB written and
// read back once (about 0.35 ms of HBM3); docs/DESIGN.md has the measurements.
#include "kernelbench_92.h"

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>

namespace kernelbench_92 {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kPixels = 4;                     // output columns a lane computes, 32 apart
constexpr int kTileCols = kWarp * kPixels;     // a warp's output columns
constexpr int kChunk = 16;                     // output channels a warp computes
constexpr int kChunks = 4;                     // warps side by side over the channels
constexpr int kBlockChannels = kChunk * kChunks;
constexpr int kRows = 2;                       // output rows a CTA computes, a warp each
constexpr int kConvThreads = kWarp * kChunks * kRows;
constexpr int kLogsumexpThreads = 256;

struct ConvShape {
  int C_in, C, H, W, OH, OW;
  int col_tiles, row_tiles, channel_blocks;
};

// Sums the first 2 * kHalf values of v over the lanes whose bits below
// 2 * kHalf differ, keeping the lane's half (by its kHalf bit) in
// v[0, kHalf); 32 values and kHalf = 16 end with lane l holding the warp's
// total of value l, in 31 shuffles.
template <int kHalf>
__device__ __forceinline__ float transpose_sum(float (&v)[kWarp], int lane) {
  const bool upper = lane & kHalf;
#pragma unroll
  for (int k = 0; k < kHalf; ++k) {
    const float keep = upper ? v[k + kHalf] : v[k];
    const float send = upper ? v[k] : v[k + kHalf];
    v[k] = keep + __shfl_xor_sync(kFull, send, kHalf);
  }
  if constexpr (kHalf > 1) {
    return transpose_sum<kHalf / 2>(v, lane);
  } else {
    return v[0];
  }
}

// Chan's merge of (count, mean, M2) b into a.
template <typename A>
__device__ __forceinline__ void chan_merge(A& count, A& mean, A& m2, A count_b, A mean_b, A m2_b) {
  if (count_b == 0) return;
  if (count == 0) {  // a copy: no 0 * inf where b holds an infinity
    count = count_b, mean = mean_b, m2 = m2_b;
    return;
  }
  const A total = count + count_b;
  const A delta = mean_b - mean;
  mean += delta * (count_b / total);
  m2 += m2_b + delta * delta * (count * count_b / total);
  count = total;
}

// Dynamic shared memory of conv_partials_kernel<K>, in floats: the weights,
// two input tiles, the rows' statistics (64-bit: the host refuses too much).
constexpr int64_t conv_shared_floats(int64_t C_in, int64_t K) {
  return C_in * K * K * kBlockChannels + 2 * C_in * (kRows + K - 1) * (kTileCols + K - 1) +
         2 * kRows * kBlockChannels;
}

// A 4-byte global-to-shared copy that does not block; zeros where !valid.
__device__ __forceinline__ void copy_async(float* dst, const float* src, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(src),
               "r"(valid ? 4 : 0));
}

// A work item: kRows output rows by kTileCols columns by kBlockChannels
// channels of one sample; the channel block outermost, so that a CTA's items
// share their weights.
struct Item {
  int n, channel_block, row_tile, col_tile;
  __device__ Item(int w, const ConvShape& s, int N) {
    col_tile = w % s.col_tiles;
    w /= s.col_tiles;
    row_tile = w % s.row_tiles;
    w /= s.row_tiles;
    n = w % N;
    channel_block = w / N;
  }
};

// Starts copying an item's input rows (zeros past the image) into x_tile.
template <int K>
__device__ __forceinline__ void load_tile_async(float* x_tile, const float* x, const Item& item,
                                                const ConvShape& s) {
  constexpr int in_rows = kRows + K - 1, in_cols = kTileCols + K - 1;
  const float* x_n = x + int64_t(item.n) * s.C_in * s.H * s.W;
  const int h0 = item.row_tile * kRows, w0 = item.col_tile * kTileCols;
  for (int i = threadIdx.x; i < s.C_in * in_rows * in_cols; i += blockDim.x) {
    const int col = i % in_cols, row = i / in_cols % in_rows, ci = i / (in_cols * in_rows);
    const int h = h0 + row, w = w0 + col;
    const bool inside = h < s.H && w < s.W;
    copy_async(x_tile + i, inside ? x_n + (int64_t(ci) * s.H + h) * s.W + w : x, inside);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// A persistent CTA walks items gridDim.x apart; the next item's input tile
// arrives (cp.async) while this one computes, and the weights are loaded
// once per channel block. Warp (row, chunk) computes its row's 4 x 32
// columns for 16 channels (64 accumulators a lane); the weights of a tap are
// a broadcast float4 per 4 channels, the inputs a conflict-free row of
// shared memory. Two CTAs an SM: 16 warps hide the FMA and shared-memory
// latencies.
template <int K>
__global__ void __launch_bounds__(kConvThreads, 2)
    conv_partials_kernel(const float* __restrict__ x,       // [N, C_in, H, W]
                         const float* __restrict__ weight,  // [C, C_in, K, K]
                         const float* __restrict__ bias,    // [C]
                         float* __restrict__ conv,          // [N, C, OH, OW]
                         float2* __restrict__ partials,     // [N, tiles, C]: (mean, M2)
                         ConvShape s, int N) {
  constexpr int in_rows = kRows + K - 1;
  constexpr int in_cols = kTileCols + K - 1;
  extern __shared__ float4 shared4[];
  const int taps = s.C_in * K * K;
  const int tile_floats = s.C_in * in_rows * in_cols;
  float* w_tile = reinterpret_cast<float*>(shared4);                // [C_in, K, K, 64]
  float* x_tiles = w_tile + taps * kBlockChannels;                 // 2 x [C_in, in_rows, in_cols]
  float2* row_stats = reinterpret_cast<float2*>(x_tiles + 2 * tile_floats);  // [kRows, 64]
  const int items = N * s.channel_blocks * s.row_tiles * s.col_tiles;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int chunk = warp % kChunks, row = warp / kChunks;

  if (blockIdx.x < items) load_tile_async<K>(x_tiles, x, Item(blockIdx.x, s, N), s);
  int loaded_block = -1, buffer = 0;
  for (int w = blockIdx.x; w < items; w += gridDim.x, buffer ^= 1) {
    // the other buffer was last read before the previous item's last barrier
    if (w + gridDim.x < items) {
      load_tile_async<K>(x_tiles + (buffer ^ 1) * tile_floats, x, Item(w + gridDim.x, s, N), s);
    } else {
      asm volatile("cp.async.commit_group;\n" ::);
    }
    const Item item(w, s, N);
    const int c0 = item.channel_block * kBlockChannels;
    if (item.channel_block != loaded_block) {  // the same for the whole CTA
      __syncthreads();
      for (int i = threadIdx.x; i < taps * kBlockChannels; i += blockDim.x) {
        const int tap = i / kBlockChannels, c = c0 + i % kBlockChannels;
        w_tile[i] = c < s.C ? weight[int64_t(c) * taps + tap] : 0.f;
      }
      loaded_block = item.channel_block;
    }
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
    const float* x_tile = x_tiles + buffer * tile_floats;
    const int n = item.n;
    const int oh0 = item.row_tile * kRows, ow0 = item.col_tile * kTileCols;

    float acc[kChunk][kPixels];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int c = c0 + chunk * kChunk + i;
      const float b = c < s.C ? bias[c] : 0.f;
#pragma unroll
      for (int j = 0; j < kPixels; ++j) acc[i][j] = b;
    }
    for (int ci = 0; ci < s.C_in; ++ci) {
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const float* in_row = x_tile + (ci * in_rows + row + kh) * in_cols + lane;
#pragma unroll
        for (int kw = 0; kw < K; ++kw) {
          float in[kPixels];
#pragma unroll
          for (int j = 0; j < kPixels; ++j) in[j] = in_row[kw + kWarp * j];
          const float4* w4 = reinterpret_cast<const float4*>(
              w_tile + ((ci * K + kh) * K + kw) * kBlockChannels + chunk * kChunk);
#pragma unroll
          for (int q = 0; q < kChunk / 4; ++q) {
            const float4 w = w4[q];
#pragma unroll
            for (int j = 0; j < kPixels; ++j) {
              acc[4 * q + 0][j] = fmaf(w.x, in[j], acc[4 * q + 0][j]);
              acc[4 * q + 1][j] = fmaf(w.y, in[j], acc[4 * q + 1][j]);
              acc[4 * q + 2][j] = fmaf(w.z, in[j], acc[4 * q + 2][j]);
              acc[4 * q + 3][j] = fmaf(w.w, in[j], acc[4 * q + 3][j]);
            }
          }
        }
      }
    }

    const int oh = oh0 + row;
    const bool row_valid = oh < s.OH;
    const int cols = min(kTileCols, s.OW - ow0);
    if (row_valid) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const int c = c0 + chunk * kChunk + i;
        if (c >= s.C) break;
        float* out = conv + (int64_t(n) * s.C + c) * s.OH * s.OW + int64_t(oh) * s.OW + ow0;
#pragma unroll
        for (int j = 0; j < kPixels; ++j) {
          if (lane + kWarp * j < cols) out[lane + kWarp * j] = acc[i][j];
        }
      }
    }

    // The row's statistics per channel, centred on its first value (lane 0's
    // first column): sums of deviations stay small, so M2 keeps its digits.
    float sums[kWarp];
    float my_centre = 0.f;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float centre = __shfl_sync(kFull, acc[i][0], 0);
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int j = 0; j < kPixels; ++j) {
        if (row_valid && lane + kWarp * j < cols) {
          const float d = acc[i][j] - centre;
          s1 += d;
          s2 = fmaf(d, d, s2);
        }
      }
      sums[2 * i] = s1;
      sums[2 * i + 1] = s2;
      if (i == lane / 2) my_centre = centre;
    }
    // lane l: channel l / 2's sum (l even) or sum of squares (l odd)
    const float total = transpose_sum<kWarp / 2>(sums, lane);
    const float squares = __shfl_down_sync(kFull, total, 1);
    if (lane % 2 == 0) {
      const float count = row_valid ? cols : 0;
      const float mean_offset = count > 0 ? total / count : 0.f;
      row_stats[row * kBlockChannels + chunk * kChunk + lane / 2] =
          count > 0 ? make_float2(my_centre + mean_offset, squares - total * mean_offset)
                    : make_float2(0.f, 0.f);
    }
    __syncthreads();
    if (threadIdx.x < kBlockChannels && c0 + int(threadIdx.x) < s.C) {
      float count = 0.f, mean = 0.f, m2 = 0.f;
      for (int r = 0; r < kRows; ++r) {
        const float2 p = row_stats[r * kBlockChannels + threadIdx.x];
        chan_merge(count, mean, m2, float(oh0 + r < s.OH ? cols : 0), p.x, p.y);
      }
      const int tile = item.row_tile * s.col_tiles + item.col_tile;
      partials[(int64_t(n) * s.row_tiles * s.col_tiles + tile) * s.C + c0 + threadIdx.x] =
          make_float2(mean, m2);
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
}

// One CTA a sample, a thread a channel at a time: the channel's tiles
// merged in order, then its group's channels in order (every thread of a
// group merges the same values in the same order, so they agree), in double.
__global__ void coefficients_kernel(const float2* __restrict__ partials,  // [N, tiles, C]
                                    const float* __restrict__ gamma,      // [C]
                                    const float* __restrict__ beta,       // [C]
                                    float2* __restrict__ coef,            // [N, C]: (a, b)
                                    ConvShape s, int G, double eps) {
  extern __shared__ double2 channel_stats[];  // [C]: (mean, M2)
  const int n = blockIdx.x;
  const int tiles = s.row_tiles * s.col_tiles;
  for (int c = threadIdx.x; c < s.C; c += blockDim.x) {
    // loads a batch ahead of the merges: each is a trip to L2
    constexpr int kBatch = 8;
    double count = 0, mean = 0, m2 = 0;
    for (int t0 = 0; t0 < tiles; t0 += kBatch) {
      float2 batch[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        batch[k] = t0 + k < tiles ? partials[(int64_t(n) * tiles + t0 + k) * s.C + c]
                                  : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int t = t0 + k;
        if (t < tiles) {
          const int rows = min(kRows, s.OH - t / s.col_tiles * kRows);
          const int cols = min(kTileCols, s.OW - t % s.col_tiles * kTileCols);
          chan_merge(count, mean, m2, double(rows) * cols, double(batch[k].x), double(batch[k].y));
        }
      }
    }
    channel_stats[c] = make_double2(mean, m2);
  }
  __syncthreads();
  const int D = s.C / G;
  const double per_channel = double(s.OH) * s.OW;
  for (int c = threadIdx.x; c < s.C; c += blockDim.x) {
    const int first = c / D * D;
    double count = 0, mean = 0, m2 = 0;
    for (int k = first; k < first + D; ++k) {
      chan_merge(count, mean, m2, per_channel, channel_stats[k].x, channel_stats[k].y);
    }
    const double var = m2 / count;
    const double rstd = 1.0 / sqrt((var < 0 ? 0.0 : var) + eps);  // NaN stays NaN
    const double a = double(gamma[c]) * rstd;
    coef[int64_t(n) * s.C + c] = make_float2(float(a), float(double(beta[c]) - mean * a));
  }
}

// tanh as 1 - 2 / (e^{2z} + 1): within a few 1e-7 of tanhf; e^{2z} = inf gives 1.
__device__ __forceinline__ float tanh_of(float z) {
  return 1.f - __fdividef(2.f, __expf(2.f * z) + 1.f);
}

__device__ __forceinline__ float hardswish_of(float t) {
  return t * fminf(fmaxf(t + 3.f, 0.f), 6.f) * (1.f / 6.f);
}

// Adds exp(r) to the running (max, sum of exp(value - max)). NaN reaches the
// sum; two equal infinities count as exp(0), not inf - inf.
__device__ __forceinline__ void logsumexp_add(float r, float& max, float& sum) {
  if (r > max) {
    sum = sum * __expf(max - r) + 1.f;
    max = r;
  } else {
    sum += r == max ? 1.f : __expf(r - max);
  }
}

// One thread: 4 pixels of one sample over every channel, reading the conv
// output once (streaming: it is several times L2). kVector: the 4 pixels are
// one aligned float4 (HxW a multiple of 4); else 4 pixels kLogsumexpThreads
// apart.
template <bool kVector>
__global__ void __launch_bounds__(kLogsumexpThreads)
    logsumexp_kernel(const float* __restrict__ conv,   // [N, C, HxW]
                     const float2* __restrict__ coef,  // [N, C]
                     float* __restrict__ out,          // [N, HxW]
                     int C, int64_t HxW) {
  extern __shared__ float2 channel_coef[];  // [C]
  const int n = blockIdx.y;
  for (int c = threadIdx.x; c < C; c += blockDim.x) channel_coef[c] = coef[int64_t(n) * C + c];
  __syncthreads();
  const int64_t base = int64_t(blockIdx.x) * kLogsumexpThreads * kPixels;
  int64_t p[kPixels];
  bool valid[kPixels];
#pragma unroll
  for (int j = 0; j < kPixels; ++j) {
    p[j] = kVector ? base + threadIdx.x * kPixels + j : base + threadIdx.x + kLogsumexpThreads * j;
    valid[j] = p[j] < HxW;
  }
  if (!valid[0]) return;
  const float* conv_n = conv + int64_t(n) * C * HxW;
  float max[kPixels], sum[kPixels];
#pragma unroll
  for (int j = 0; j < kPixels; ++j) {
    max[j] = -INFINITY;
    sum[j] = 0.f;
  }
#pragma unroll 4
  for (int c = 0; c < C; ++c) {
    const float* plane = conv_n + int64_t(c) * HxW;
    float v[kPixels];
    if constexpr (kVector) {
      const float4 q = __ldcs(reinterpret_cast<const float4*>(plane + p[0]));
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
      for (int j = 0; j < kPixels; ++j) v[j] = valid[j] ? __ldcs(plane + p[j]) : 0.f;
    }
    const float2 ab = channel_coef[c];
#pragma unroll
    for (int j = 0; j < kPixels; ++j) {
      logsumexp_add(v[j] + hardswish_of(tanh_of(fmaf(v[j], ab.x, ab.y))), max[j], sum[j]);
    }
  }
  float* out_n = out + int64_t(n) * HxW;
  float lse[kPixels];
#pragma unroll
  for (int j = 0; j < kPixels; ++j) lse[j] = max[j] + logf(sum[j]);
  if constexpr (kVector) {
    *reinterpret_cast<float4*>(out_n + p[0]) = make_float4(lse[0], lse[1], lse[2], lse[3]);
  } else {
#pragma unroll
    for (int j = 0; j < kPixels; ++j) {
      if (valid[j]) out_n[p[j]] = lse[j];
    }
  }
}

template <int K>
void launch_conv(const Launch& a, const ConvShape& s, cudaStream_t stream) {
  auto kernel = conv_partials_kernel<K>;
  const size_t shared_bytes = conv_shared_bytes(a.C_in, K);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(shared_bytes)));
  // persistent: as many CTAs as fit at once, each walking the items
  int device = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kConvThreads,
                                                               shared_bytes));
  const int64_t items = int64_t(a.N) * s.channel_blocks * s.row_tiles * s.col_tiles;
  const int grid = int(std::min<int64_t>(items, int64_t(std::max(per_sm, 1)) * sms));
  kernel<<<grid, kConvThreads, shared_bytes, stream>>>(
      a.x, a.weight, a.bias, a.conv, reinterpret_cast<float2*>(a.partials), s, a.N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kernelbench_92

size_t conv_shared_bytes(int64_t C_in, int64_t K) {
  return sizeof(float) * kernelbench_92::conv_shared_floats(C_in, K);
}

int64_t conv_tiles(int OH, int OW) {
  using namespace kernelbench_92;
  return int64_t((OH + kRows - 1) / kRows) * ((OW + kTileCols - 1) / kTileCols);
}

int64_t conv_items(int N, int C, int OH, int OW) {
  using namespace kernelbench_92;
  return int64_t(N) * ((C + kBlockChannels - 1) / kBlockChannels) * conv_tiles(OH, OW);
}

void launch_conv_groupnorm_logsumexp(const Launch& a, cudaStream_t stream) {
  using namespace kernelbench_92;
  const int OH = a.H - a.K + 1, OW = a.W - a.K + 1;
  const ConvShape s{a.C_in, a.C, a.H, a.W, OH, OW, (OW + kTileCols - 1) / kTileCols,
                    (OH + kRows - 1) / kRows, (a.C + kBlockChannels - 1) / kBlockChannels};
  switch (a.K) {
    case 1: launch_conv<1>(a, s, stream); break;
    case 3: launch_conv<3>(a, s, stream); break;
    case 5: launch_conv<5>(a, s, stream); break;
    default: launch_conv<7>(a, s, stream); break;
  }
  coefficients_kernel<<<unsigned(a.N), unsigned(std::min((a.C + kWarp - 1) / kWarp * kWarp, 256)),
                        sizeof(double2) * a.C, stream>>>(
      reinterpret_cast<const float2*>(a.partials), a.gamma, a.beta,
      reinterpret_cast<float2*>(a.coef), s, a.groups, a.eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t HxW = int64_t(OH) * OW;
  const dim3 grid(unsigned((HxW + kLogsumexpThreads * kPixels - 1) / (kLogsumexpThreads * kPixels)),
                  unsigned(a.N));
  const auto logsumexp = HxW % kPixels == 0 ? logsumexp_kernel<true> : logsumexp_kernel<false>;
  logsumexp<<<grid, kLogsumexpThreads, sizeof(float2) * a.C, stream>>>(
      a.conv, reinterpret_cast<const float2*>(a.coef), a.out, a.C, HxW);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
