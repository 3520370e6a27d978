// Launchers of the backward: the four-launch passes (backward_passes.cuh)
// and the stream kernels (backward_stream*.cuh), each followed, when dgamma
// and dbeta are wanted, by the affine kernel. Every temporary of a backward
// comes from one allocation.
#include "backward_stream.cuh"
#include "backward_stream_channels_last.cuh"
#include "launch.cuh"

namespace groupnorm {

template <typename scalar_t>
const void* backward_stream_kernel(bool channels_last, int vec) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    kernel = channels_last
                 ? reinterpret_cast<const void*>(
                       &groupnorm_backward_stream_channels_last_kernel<scalar_t, V>)
                 : reinterpret_cast<const void*>(&groupnorm_backward_stream_kernel<scalar_t, V>);
  });
  return kernel;
}

// dgamma and dbeta from the per-sample affine pairs.
template <typename scalar_t>
void launch_affine(const acc_t<scalar_t>* affine_pairs, const Problem& p, const BackwardArgs& a,
                   cudaStream_t stream) {
  const TypedBackward<scalar_t> g(a);
  launch_kernel(&groupnorm_backward_affine_kernel<scalar_t>, {(p.C + 255) / 256, 256}, stream,
                affine_pairs, g.dgamma, g.dbeta, p.N, int(p.C));
}

template <typename scalar_t>
void launch_backward_stream(const BackwardPlan& plan, const Problem& p, const BackwardArgs& a,
                            WorkspaceAllocator& alloc, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const BackwardTiles& t = plan.tiles;
  const bool channels_last = plan.kernel == BackwardKernel::StreamChannelsLast;
  const bool need_affine = a.dgamma != nullptr;
  const int64_t NC = p.N * p.C;
  const int64_t units = channels_last ? p.N * t.cblocks : p.N * p.G;
  // Contiguous: tile pairs [N, C, chunks]. Channels-last: group pairs
  // [N, chunks, G] and, for the affine partials, channel pairs [N, chunks, C].
  WorkspaceLayout layout;
  const StreamCounters counters(layout, units, 1);
  const int64_t pairs_at =
      layout.add<A>(channels_last ? 2 * p.N * t.chunks * p.G : 2 * NC * t.chunks);
  const int64_t channel_at =
      layout.add<A>(channels_last && need_affine ? 2 * p.N * t.chunks * p.C : 0);
  const int64_t affine_at = layout.add<A>(need_affine ? 2 * NC : 0);
  uint8_t* base = alloc.allocate(layout.bytes, counters.bytes);
  A* pairs = reinterpret_cast<A*>(base + pairs_at);
  A* affine_pairs = need_affine ? reinterpret_cast<A*>(base + affine_at) : nullptr;
  const StreamOrder order{t.tiles, plan.lag};
  // L2 priorities on 16-byte loads: evict_last at the first read, evict_first at the second.
  const bool l2_hints = plan.vec * sizeof(scalar_t) == 16;
  const TypedBackward<scalar_t> g(a);
  const LaunchShape shape{plan.grid, kBackwardThreads};
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (channels_last) {
      A* channel_pairs = need_affine ? reinterpret_cast<A*>(base + channel_at) : nullptr;
      launch_kernel(&groupnorm_backward_stream_channels_last_kernel<scalar_t, V>, shape, stream,
                    g.dy, g.x, g.mean, g.rstd, g.gamma, pairs, channel_pairs, affine_pairs, g.dx,
                    counters.bind(base), t, int(p.C), p.G, order, l2_hints);
    } else {
      launch_kernel(&groupnorm_backward_stream_kernel<scalar_t, V>, shape, stream, g.dy, g.x,
                    g.mean, g.rstd, g.gamma, pairs, affine_pairs, g.dx, counters.bind(base), t,
                    int(p.C), p.G, order, l2_hints);
    }
  });
  if (need_affine) launch_affine<scalar_t>(affine_pairs, p, a, stream);
}

template <typename scalar_t>
void launch_backward_passes(const BackwardPlan& plan, const Problem& p, const BackwardArgs& a,
                            WorkspaceAllocator& alloc, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const BackwardTiles& t = plan.tiles;
  const bool channels_last = plan.kernel == BackwardKernel::PassesChannelsLast;
  const int C = int(p.C), G = p.G, D = C / G;
  const int64_t NC = p.N * p.C;
  const bool need_dx = a.dx != nullptr;
  const bool need_affine = a.dgamma != nullptr;
  // Chunk partials, the coefficient table and the per-sample affine partials.
  WorkspaceLayout layout;
  const int64_t coef_at = layout.add<Coef<A>>(need_dx ? NC : 0);
  const int64_t partial_at = layout.add<A>(2 * NC * t.chunks);
  const int64_t affine_at = layout.add<A>(need_affine ? 2 * NC : 0);
  uint8_t* base = alloc.allocate(layout.bytes, 0);
  Coef<A>* coef = need_dx ? reinterpret_cast<Coef<A>*>(base + coef_at) : nullptr;
  A* partial = reinterpret_cast<A*>(base + partial_at);
  A* affine_pairs = need_affine ? reinterpret_cast<A*>(base + affine_at) : nullptr;
  const TypedBackward<scalar_t> g(a);
  const LaunchShape tiles{plan.grid, kBackwardThreads};
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (channels_last) {
      launch_kernel(&groupnorm_backward_sums_channels_last_kernel<scalar_t, V>, tiles, stream, g.dy,
                    g.x, g.mean, partial, t, C, D);
    } else {
      launch_kernel(&groupnorm_backward_sums_contiguous_kernel<scalar_t, V>, tiles, stream, g.dy,
                    g.x, g.mean, partial, t, C, D);
    }
  });
  const PartialLayout at{t.chunks, p.C * t.chunks, channels_last ? 1 : t.chunks,
                         channels_last ? p.C : 1};
  launch_kernel(&groupnorm_backward_coefficients_kernel<scalar_t>,
                {std::min<int64_t>(p.N * G, kMaxGrid), kBackwardThreads}, stream,
                static_cast<const A*>(partial), g.mean, g.rstd, g.gamma, affine_pairs, coef, p.N, C,
                G, p.HxW, at);
  if (need_affine) launch_affine<scalar_t>(affine_pairs, p, a, stream);
  if (!need_dx) return;
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (channels_last) {
      launch_kernel(&groupnorm_backward_dx_channels_last_kernel<scalar_t, V>, tiles, stream, g.dy,
                    g.x, static_cast<const Coef<A>*>(coef), g.dx, t, C);
    } else {
      launch_kernel(&groupnorm_backward_dx_contiguous_kernel<scalar_t, V>, tiles, stream, g.dy, g.x,
                    static_cast<const Coef<A>*>(coef), g.dx, t);
    }
  });
}

#define GROUPNORM_INSTANTIATE_BACKWARD(T)                                                          \
  template const void* backward_stream_kernel<T>(bool, int);                                       \
  template void launch_backward_stream<T>(const BackwardPlan&, const Problem&,                     \
                                          const BackwardArgs&, WorkspaceAllocator&, cudaStream_t); \
  template void launch_backward_passes<T>(const BackwardPlan&, const Problem&,                     \
                                          const BackwardArgs&, WorkspaceAllocator&, cudaStream_t);
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_BACKWARD)
#undef GROUPNORM_INSTANTIATE_BACKWARD

}  // namespace groupnorm
