// Synthetic kernels with the backward's memory traffic and none (or part) of
// its arithmetic, to measure how fast the stream backward's access pattern
// can go on a card (benchmarks/backward_ceiling.py). The input is cut into
// flat tiles of kTileVecs 16-byte vectors of x and of dy, kItems a thread:
// the size of backward_stream.cu's tiles, whose own stop at row ends. The
// caller passes the grid (two 256-thread CTAs per SM, as the stream kernel).
//   kOneRead         each tile read once, dx written: the floor's own pattern.
//   kTwoReadsStatic  the stream order of stream_order.cuh (a first read with
//                    evict_last, a second `lag` tiles later with evict_first
//                    and dx written), CTA b taking items b, b + grid, ...:
//                    no atomics, no barriers.
//   kTwoReadsTickets the same order, items claimed from an atomic ticket as
//                    the stream kernel claims them (next ticket stored at the
//                    item's end).
//   kTwoReadsSynced  as kTwoReadsTickets, plus most of the stream kernel's
//                    synchronisation: two block sums and an arrival count per
//                    first read; a wait for every tile of its `unit` and one
//                    block sum per second read. The arrivals and the wait are
//                    relaxed, cheaper than the stream kernel's release and
//                    acquire (benchmarks/HISTORY.md, run AI).
// Results are meaningless numbers; only the time is read.
//
// The ticket order, the hinted loads and block_sum come from kernels/ (on the
// include path).
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "stream_order.cuh"

namespace {

using groupnorm::block_sum;
using groupnorm::load_with_l2_priority;
using groupnorm::StreamOrder;

enum Mode { kOneRead = 0, kTwoReadsStatic = 1, kTwoReadsTickets = 2, kTwoReadsSynced = 3 };

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr int64_t kTileVecs = int64_t(kThreads) * kItems;

// T: float or c10::BFloat16 (which converts to and from float on the device).
template <typename T, int kMode>
__global__ void __launch_bounds__(kThreads, 2)
    pattern_kernel(const uint4* dy,           // [vecs]
                   const uint4* x,            // [vecs]
                   uint4* dx,                 // [vecs]
                   float* pairs,              // [tiles, 2]
                   unsigned long long* next,  // [1] ticket counter, zeroed
                   int* arrived,              // [tiles / unit + 1], zeroed
                   int64_t vecs, int64_t tiles, int64_t lag, int unit, bool hints) {
  constexpr int E = 16 / sizeof(T);
  __shared__ long long ticket[2];
  __shared__ float scratch[kThreads / groupnorm::kWarp];
  __shared__ bool completes_unit;
  const int tid = threadIdx.x;
  const int64_t items = kMode == kOneRead ? tiles : 2 * tiles;
  const auto unit_size = [&](int64_t b) {
    return int(min(int64_t(unit), tiles - b / unit * unit));
  };
  float keep_alive = 0;  // stops the compiler from dropping the first reads
  long long next_ticket = 0;
  constexpr bool kTickets = kMode >= kTwoReadsTickets;
  if (kTickets) {
    if (tid == 0) ticket[0] = (long long)atomicAdd(next, 1ull);
    __syncthreads();
  }
  int64_t static_item = blockIdx.x;
  for (int cur = 0;; cur ^= 1) {
    const int64_t tk = kTickets ? ticket[cur] : static_item;
    if (tk >= items) break;
    if (kTickets && tid == 0) next_ticket = (long long)atomicAdd(next, 1ull);
    int64_t b = tk;
    const bool first = kMode != kOneRead && StreamOrder{tiles, lag}.item(tk, b);
    const int64_t base = b * kTileVecs;
    const int64_t count = min(kTileVecs, vecs - base);
    const bool hinted = hints && kMode != kOneRead;
    uint4 g[kItems], v[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t i = int64_t(u) * kThreads + tid;
      if (i < count) {
        g[u] = hinted ? load_with_l2_priority(dy + base + i, first) : dy[base + i];
        v[u] = hinted ? load_with_l2_priority(x + base + i, first) : x[base + i];
      }
    }
    if (first) {
      float s1 = 0, s2 = 0;
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        if (int64_t(u) * kThreads + tid < count) {
          const T* gp = reinterpret_cast<const T*>(&g[u]);
          const T* xp = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            s1 += float(gp[e]);
            s2 += float(gp[e]) * float(xp[e]);
          }
        }
      }
      if (kMode == kTwoReadsSynced) {
        s1 = block_sum(s1, scratch);
        s2 = block_sum(s2, scratch);
        if (tid == 0) {
          pairs[2 * b] = s1;
          pairs[2 * b + 1] = s2;
          completes_unit = atomicAdd(&arrived[b / unit], 1) == unit_size(b) - 1;
        }
        __syncthreads();
        keep_alive += completes_unit;
      } else {
        keep_alive += s1 + s2;
      }
    } else {
      if (kMode == kTwoReadsSynced) {
        if (tid == 0) {
          while (*reinterpret_cast<volatile int*>(&arrived[b / unit]) < unit_size(b)) {
            __nanosleep(64);
          }
        }
        __syncthreads();
        keep_alive += 1e-30f * block_sum(pairs[2 * b + (tid & 1)], scratch);
      }
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int64_t i = int64_t(u) * kThreads + tid;
        if (i < count) {
          const T* gp = reinterpret_cast<const T*>(&g[u]);
          const T* xp = reinterpret_cast<const T*>(&v[u]);
          uint4 out;
          T* op = reinterpret_cast<T*>(&out);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            op[e] = T(1.5f * float(gp[e]) - 0.25f - (float(xp[e]) - 0.5f) * 0.125f);
          }
          __stcs(dx + base + i, out);
        }
      }
    }
    if (kTickets) {
      if (tid == 0) ticket[cur ^ 1] = next_ticket;
      __syncthreads();
    } else {
      static_item += gridDim.x;
    }
  }
  if (keep_alive == 1234567.f) pairs[0] = keep_alive;
}

template <typename T>
void launch(int64_t mode, int grid, cudaStream_t stream, const uint4* dy, const uint4* x, uint4* dx,
            float* pairs, unsigned long long* next, int* arrived, int64_t vecs, int64_t tiles,
            int64_t lag, int unit, bool hints) {
  switch (mode) {
    case kOneRead:
      pattern_kernel<T, kOneRead><<<grid, kThreads, 0, stream>>>(dy, x, dx, pairs, next, arrived,
                                                                 vecs, tiles, lag, unit, hints);
      break;
    case kTwoReadsStatic:
      pattern_kernel<T, kTwoReadsStatic><<<grid, kThreads, 0, stream>>>(
          dy, x, dx, pairs, next, arrived, vecs, tiles, lag, unit, hints);
      break;
    case kTwoReadsTickets:
      pattern_kernel<T, kTwoReadsTickets><<<grid, kThreads, 0, stream>>>(
          dy, x, dx, pairs, next, arrived, vecs, tiles, lag, unit, hints);
      break;
    default:
      pattern_kernel<T, kTwoReadsSynced><<<grid, kThreads, 0, stream>>>(
          dy, x, dx, pairs, next, arrived, vecs, tiles, lag, unit, hints);
  }
}

}  // namespace

// One synthetic backward over dy and x (same shape, float or bfloat16,
// contiguous) into dx; lag is raised to at least `unit` (deadlock-free order).
void run_pattern(torch::Tensor dy, torch::Tensor x, torch::Tensor dx, int64_t mode, int64_t lag,
                 int64_t unit, bool hints, int64_t grid) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && dy.is_contiguous() && dx.is_contiguous() &&
                  x.sizes() == dy.sizes() && x.sizes() == dx.sizes(),
              "run_pattern: x, dy and dx must be contiguous CUDA tensors of one shape");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "run_pattern: float or bfloat16 only");
  TORCH_CHECK(x.nbytes() % 16 == 0, "run_pattern: the input must be whole 16-byte vectors");
  TORCH_CHECK(mode >= 0 && mode <= 3 && unit >= 1 && grid >= 1,
              "run_pattern: bad mode, unit or grid");
  const int64_t vecs = int64_t(x.nbytes()) / 16;
  const int64_t tiles = (vecs + kTileVecs - 1) / kTileVecs;
  lag = std::min(std::max(lag, unit), tiles);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t counters = 2 + tiles / unit + 1;  // the ticket (8 bytes), then arrivals
  at::Tensor work = at::empty({counters + 2 * tiles}, x.options().dtype(torch::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(work.data_ptr(), 0, counters * sizeof(int), stream));
  auto* next = reinterpret_cast<unsigned long long*>(work.data_ptr<int>());
  int* arrived = work.data_ptr<int>() + 2;
  float* pairs = reinterpret_cast<float*>(work.data_ptr<int>() + counters);
  const auto* dy_v = reinterpret_cast<const uint4*>(dy.data_ptr());
  const auto* x_v = reinterpret_cast<const uint4*>(x.data_ptr());
  auto* dx_v = reinterpret_cast<uint4*>(dx.data_ptr());
  if (x.scalar_type() == torch::kBFloat16) {
    launch<c10::BFloat16>(mode, int(grid), stream, dy_v, x_v, dx_v, pairs, next, arrived, vecs,
                          tiles, lag, int(unit), hints);
  } else {
    launch<float>(mode, int(grid), stream, dy_v, x_v, dx_v, pairs, next, arrived, vecs, tiles, lag,
                  int(unit), hints);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
