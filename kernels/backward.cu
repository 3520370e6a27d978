// GroupNorm backward. With xhat = (x - mean) * rstd, g = dy * gamma[c] and
// M = D * HxW elements per (sample, group):
//   dx        = rstd * (g - sum(g) / M - xhat * sum(g * xhat) / M)
//   dgamma[c] = sum over samples and positions of dy * xhat
//   dbeta[c]  = sum over samples and positions of dy
// One CTA per (sample, group) (grid-stride): sweep 1 reduces per channel
// sum(dy) and sum(dy * xhat) (written as [N, C] partials, and folded into the
// two group sums), sweep 2 writes dx. A second small kernel adds the partials
// over samples in a fixed order. x and dy are read twice, dx written once;
// mean and rstd come from the forward, so nothing else is saved.
//
// Layouts, with no copy: contiguous walks each channel's HxW run (one
// block-wide reduction per channel); channels-last walks the group's rows of
// D channels with a block of a multiple of D threads, so each thread keeps
// one channel for the whole sweep.
#include "common.cuh"

namespace groupnorm {

constexpr int kBackwardThreads = 256;

template <typename scalar_t, bool kChannelsLast>
__global__ void __launch_bounds__(kBackwardThreads)
    groupnorm_backward_kernel(const scalar_t* __restrict__ dy,  // like x
                              const scalar_t* __restrict__ x,   // [N, C, HxW] or [N, HxW, C]
                              const acc_t<scalar_t>* __restrict__ mean,   // [N, G]
                              const acc_t<scalar_t>* __restrict__ rstd,   // [N, G]
                              const scalar_t* __restrict__ gamma,         // [C] or nullptr
                              scalar_t* __restrict__ dx,                  // like x, or nullptr
                              acc_t<scalar_t>* __restrict__ dgamma_part,  // [N, C] or nullptr
                              acc_t<scalar_t>* __restrict__ dbeta_part,   // [N, C] or nullptr
                              int64_t N, int64_t HxW, int C, int G) {
  using A = acc_t<scalar_t>;
  __shared__ A red[kBackwardThreads];
  __shared__ A sums[2][kBackwardThreads];  // channels-last: per-channel sums
  const int D = C / G;
  const int64_t M = int64_t(D) * HxW;
  const int tid = threadIdx.x;
  // Channels-last: the block is a whole number of rows of D channels.
  const int active = kChannelsLast ? (int(blockDim.x) / D) * D : int(blockDim.x);

  for (int64_t unit = blockIdx.x; unit < N * G; unit += gridDim.x) {
    const int64_t n = unit / G;
    const int c0 = int(unit % G) * D;
    const A mu = mean[unit];
    const A rs = rstd[unit];
    A sum_g = 0, sum_gx = 0;  // over the group: g and g * xhat (same in every thread)

    if constexpr (!kChannelsLast) {
      for (int d = 0; d < D; ++d) {
        const int64_t base = (n * C + c0 + d) * HxW;
        A s_dy = 0, s_dyx = 0;
        for (int64_t s = tid; s < HxW; s += blockDim.x) {
          const A g = static_cast<A>(dy[base + s]);
          s_dy += g;
          s_dyx += g * (static_cast<A>(x[base + s]) - mu) * rs;
        }
        s_dy = block_sum(s_dy, red);
        s_dyx = block_sum(s_dyx, red);
        if (tid == 0 && dgamma_part != nullptr) {
          dgamma_part[n * C + c0 + d] = s_dyx;
          dbeta_part[n * C + c0 + d] = s_dy;
        }
        const A w = gamma != nullptr ? static_cast<A>(gamma[c0 + d]) : A(1);
        sum_g += w * s_dy;
        sum_gx += w * s_dyx;
      }
    } else {
      const int d = tid % D;
      A s_dy = 0, s_dyx = 0;
      if (tid < active) {
        const int64_t base = n * HxW * C + c0 + d;
        for (int64_t r = tid / D; r < HxW; r += active / D) {
          const A g = static_cast<A>(dy[base + r * C]);
          s_dy += g;
          s_dyx += g * (static_cast<A>(x[base + r * C]) - mu) * rs;
        }
        red[tid] = s_dy;
        sums[1][tid] = s_dyx;
      }
      __syncthreads();
      // Column d of the [active / D][D] tables, one warp per channel.
      reduce_groups(red, active / D, D, D, 1, sums[0] + 0);
      __syncthreads();
      reduce_groups(sums[1], active / D, D, D, 1, red);  // red[d] = sum dy * xhat
      for (int e = 0; e < D; ++e) {
        const A w = gamma != nullptr ? static_cast<A>(gamma[c0 + e]) : A(1);
        sum_g += w * sums[0][e];
        sum_gx += w * red[e];
      }
      if (dgamma_part != nullptr) {
        for (int e = tid; e < D; e += blockDim.x) {
          dgamma_part[n * C + c0 + e] = red[e];
          dbeta_part[n * C + c0 + e] = sums[0][e];
        }
      }
    }

    if (dx != nullptr) {
      const A mean_g = sum_g / A(M);
      const A mean_gx = sum_gx / A(M);
      for (int64_t e = tid; e < M; e += blockDim.x) {
        int c;
        int64_t offset;
        if constexpr (kChannelsLast) {
          c = c0 + int(e % D);
          offset = n * HxW * C + (e / D) * C + c;
        } else {
          c = c0 + int(e / HxW);
          offset = (n * C + c0) * HxW + e;
        }
        const A w = gamma != nullptr ? static_cast<A>(gamma[c]) : A(1);
        const A xhat = (static_cast<A>(x[offset]) - mu) * rs;
        const A g = static_cast<A>(dy[offset]) * w;
        dx[offset] = static_cast<scalar_t>(rs * (g - mean_g - xhat * mean_gx));
      }
    }
    __syncthreads();  // shared tables are reused by the next unit
  }
}

// dgamma[c] = sum_n dgamma_part[n, c] (and the same for dbeta), in sample order.
template <typename scalar_t>
__global__ void groupnorm_backward_affine_kernel(const acc_t<scalar_t>* __restrict__ dgamma_part,
                                                 const acc_t<scalar_t>* __restrict__ dbeta_part,
                                                 scalar_t* __restrict__ dgamma,  // [C]
                                                 scalar_t* __restrict__ dbeta,   // [C]
                                                 int64_t N, int C) {
  using A = acc_t<scalar_t>;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  A sg = 0, sb = 0;
  for (int64_t n = 0; n < N; ++n) {
    sg += dgamma_part[n * C + c];
    sb += dbeta_part[n * C + c];
  }
  dgamma[c] = static_cast<scalar_t>(sg);
  dbeta[c] = static_cast<scalar_t>(sb);
}

}  // namespace groupnorm
