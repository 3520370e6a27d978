// Launchers of the backward: the four-launch passes (backward_passes.cuh)
// and the registers kernel (backward_registers.cuh), plain or fused
// (backward_epilogue.cuh), and the stream kernels (backward_stream*.cuh,
// plain), each followed, when dgamma and dbeta are wanted, by the affine
// kernel. Every temporary of a backward comes from one allocation, but the
// chain kernel's g (a second) and the stream kernels' counters (left zeroed
// by the kernels).
#include <string>

#include "backward_registers.cuh"
#include "backward_stream.cuh"
#include "backward_stream_channels_last.cuh"
#include "errors.h"
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
  const auto kernel = &groupnorm_backward_affine_kernel<scalar_t>;
  LaunchShape shape{(p.C + 255) / 256, 256};
  shape.after_previous = dependent_launch(reinterpret_cast<const void*>(kernel), p.device);
  launch_kernel(kernel, shape, stream, affine_pairs, g.dgamma, g.dbeta, p.N, int(p.C));
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
  const StreamCounters counters(units, 1);
  WorkspaceLayout layout;
  const int64_t pairs_at =
      layout.add<A>(channels_last ? 2 * p.N * t.chunks * p.G : 2 * NC * t.chunks);
  const int64_t channel_at =
      layout.add<A>(channels_last && need_affine ? 2 * p.N * t.chunks * p.C : 0);
  const int64_t affine_at = layout.add<A>(need_affine ? 2 * NC : 0);
  uint8_t* base = alloc.allocate(layout.bytes);
  const StreamWorkspace ws = counters.bind(alloc.counters(counters.bytes));
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
                    ws, t, int(p.C), p.G, order, l2_hints);
    } else {
      launch_kernel(&groupnorm_backward_stream_kernel<scalar_t, V>, shape, stream, g.dy, g.x,
                    g.mean, g.rstd, g.gamma, pairs, affine_pairs, g.dx, ws, t, int(p.C), p.G, order,
                    l2_hints);
    }
  });
  if (need_affine) launch_affine<scalar_t>(affine_pairs, p, a, stream);
}

// The fused kernels' epilogue argument: the fused backward's tensors and the
// workspace it sums into, or nothing.
template <typename scalar_t, bool kFused>
BackwardEpilogue<scalar_t, kFused> backward_epilogue(const BackwardArgs& a,
                                                     acc_t<scalar_t>* x_partial,
                                                     acc_t<scalar_t>* channel_sums) {
  if constexpr (kFused) {
    using A = acc_t<scalar_t>;
    BackwardEpilogue<scalar_t, true> ep;
    ep.forward = typed_epilogue<scalar_t>(a.epilogue);
    ep.beta = static_cast<const scalar_t*>(a.beta);
    ep.rstd = static_cast<const A*>(a.rstd);
    ep.x_partial = x_partial;
    ep.channel_sums = channel_sums;
    ep.dscale = static_cast<scalar_t*>(a.dscale);
    ep.dshift = static_cast<scalar_t*>(a.dshift);
    ep.dadd = static_cast<scalar_t*>(a.dadd);
    return ep;
  } else {
    return {};
  }
}

// f(std::integral_constant<int, V>) for the passes' vector width: any width
// up to 16 bytes for the plain passes; 16 bytes or one element for the
// fused ones, which choose_backward plans so, each width costing the
// build a set of heavier kernels.
template <typename scalar_t, bool kFused, typename F>
void with_passes_vec(int v, F&& f) {
  if constexpr (kFused) {
    constexpr int kWidest = int(16 / sizeof(scalar_t));
    if (v == kWidest) return f(std::integral_constant<int, kWidest>{});
    GROUPNORM_CHECK(v == 1, "groupnorm backward: the fused passes take " + std::to_string(kWidest) +
                                " elements a vector or one, got " + std::to_string(v));
    return f(std::integral_constant<int, 1>{});
  } else {
    with_vec<scalar_t, 16>(v, std::forward<F>(f));
  }
}

// The chain kernel's g = dy * act'(z) in a temporary of x's size, and the
// arguments that have the fused passes or registers kernel read it as dy,
// with no activation of their own.
template <typename scalar_t>
BackwardArgs with_chain_taken_back(const BackwardPlan& plan, const Problem& p, BackwardArgs a,
                                   WorkspaceAllocator& alloc, cudaStream_t stream) {
  const int64_t elements = p.N * p.C * p.HxW;
  scalar_t* g = reinterpret_cast<scalar_t*>(alloc.allocate(elements * p.elem));
  const TypedBackward<scalar_t> t(a);
  const auto ep = backward_epilogue<scalar_t, true>(a, nullptr, nullptr);
  with_passes_vec<scalar_t, true>(plan.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    const int64_t vectors = elements / V;
    launch_kernel(&groupnorm_backward_chain_kernel<scalar_t, V>,
                  {std::min<int64_t>((vectors + 255) / 256, kMaxGrid), 256}, stream, t.dy, t.x,
                  t.mean, t.gamma, g, vectors, p.HxW, p.G, p.channels_last, ep);
  });
  a.dy = g;
  a.epilogue.activations = 0;
  return a;
}

// The registers kernel, plain or fused (after the chain kernel, for a chain
// it does not take back inline), on the plan's vectors: any width for the
// plain kernel, 16 bytes for the fused one (registers_backward).
template <typename scalar_t, bool kFused>
void launch_backward_registers(const BackwardPlan& plan, const Problem& p,
                               const BackwardArgs& given, WorkspaceAllocator& alloc,
                               cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  BackwardArgs a = given;
  if constexpr (kFused) {
    if (!a.epilogue.inline_chain()) a = with_chain_taken_back<scalar_t>(plan, p, a, alloc, stream);
  }
  const bool need_affine = a.dgamma != nullptr;
  const bool need_add = kFused && a.dadd != nullptr;
  WorkspaceLayout layout;
  const int64_t affine_at = layout.add<A>(need_affine ? 2 * p.N * p.C : 0);
  const int64_t channel_sums_at = layout.add<A>(need_add ? 2 * p.N * p.C : 0);
  uint8_t* base = layout.bytes > 0 ? alloc.allocate(layout.bytes) : nullptr;
  A* affine_pairs = need_affine ? reinterpret_cast<A*>(base + affine_at) : nullptr;
  const auto ep = backward_epilogue<scalar_t, kFused>(
      a, nullptr, need_add ? reinterpret_cast<A*>(base + channel_sums_at) : nullptr);
  const TypedBackward<scalar_t> g(a);
  LaunchShape shape{plan.grid, plan.threads};
  shape.smem = plan.smem;
  const auto launch = [&](auto v) {
    launch_kernel(&groupnorm_backward_registers_kernel<scalar_t, decltype(v)::value, kFused>, shape,
                  stream, g.dy, g.x, g.mean, g.rstd, g.gamma, affine_pairs, g.dx, p.N, int(p.HxW),
                  p.C, p.G, int(p.D()), p.channels_last, ep);
  };
  if constexpr (kFused) {
    constexpr int kWidest = int(16 / sizeof(scalar_t));
    GROUPNORM_CHECK(plan.vec == kWidest, "groupnorm backward: the fused registers kernel takes " +
                                             std::to_string(kWidest) + " elements a vector, got " +
                                             std::to_string(plan.vec));
    launch(std::integral_constant<int, kWidest>{});
  } else {
    with_vec<scalar_t, 16>(plan.vec, launch);
  }
  if (need_affine) launch_affine<scalar_t>(affine_pairs, p, a, stream);
}

template <typename scalar_t, bool kFused>
void launch_backward_passes(const BackwardPlan& plan, const Problem& p, const BackwardArgs& given,
                            WorkspaceAllocator& alloc, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  BackwardArgs a = given;
  if constexpr (kFused) {
    if (!a.epilogue.inline_chain()) a = with_chain_taken_back<scalar_t>(plan, p, a, alloc, stream);
  }
  const BackwardTiles& t = plan.tiles;
  const bool channels_last = plan.kernel == BackwardKernel::PassesChannelsLast;
  const int C = int(p.C), G = p.G, D = C / G;
  const int64_t NC = p.N * p.C;
  const bool need_dx = a.dx != nullptr;
  const bool need_affine = a.dgamma != nullptr;
  const bool need_add = kFused && a.dadd != nullptr;  // its sums of s - mean and the coefficients
  // Chunk partials, the coefficient table, the per-sample affine partials
  // and, for add's gradient, the sums of s - mean by chunk and by channel.
  WorkspaceLayout layout;
  const int64_t coef_at = layout.add<Coef<A>>(need_dx || need_add ? NC : 0);
  const int64_t partial_at = layout.add<A>(2 * NC * t.chunks);
  const int64_t affine_at = layout.add<A>(need_affine ? 2 * NC : 0);
  const int64_t x_partial_at = layout.add<A>(need_add ? NC * t.chunks : 0);
  const int64_t channel_sums_at = layout.add<A>(need_add ? 2 * NC : 0);
  uint8_t* base = alloc.allocate(layout.bytes);
  Coef<A>* coef = need_dx || need_add ? reinterpret_cast<Coef<A>*>(base + coef_at) : nullptr;
  A* partial = reinterpret_cast<A*>(base + partial_at);
  A* affine_pairs = need_affine ? reinterpret_cast<A*>(base + affine_at) : nullptr;
  const auto ep = backward_epilogue<scalar_t, kFused>(
      a, need_add ? reinterpret_cast<A*>(base + x_partial_at) : nullptr,
      need_add ? reinterpret_cast<A*>(base + channel_sums_at) : nullptr);
  const TypedBackward<scalar_t> g(a);
  const LaunchShape tiles{plan.grid, kBackwardThreads};
  with_passes_vec<scalar_t, kFused>(plan.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (channels_last) {
      launch_kernel(&groupnorm_backward_sums_channels_last_kernel<scalar_t, V, kFused>, tiles,
                    stream, g.dy, g.x, g.mean, g.gamma, partial, t, C, D, ep);
    } else {
      launch_kernel(&groupnorm_backward_sums_contiguous_kernel<scalar_t, V, kFused>, tiles, stream,
                    g.dy, g.x, g.mean, g.gamma, partial, t, C, D, ep);
    }
  });
  const PartialLayout at{t.chunks, p.C * t.chunks, channels_last ? 1 : t.chunks,
                         channels_last ? p.C : 1};
  // The kernels after the sums overlap their launch with the end of the one
  // before (sm_90+): small inputs' backward is four launches' latency.
  const auto coefficients_kernel = &groupnorm_backward_coefficients_kernel<scalar_t, kFused>;
  // Built with the kernels below, for the same architectures.
  const bool dependent =
      dependent_launch(reinterpret_cast<const void*>(coefficients_kernel), p.device);
  LaunchShape coefficients{std::min<int64_t>(p.N * G, kMaxGrid), kBackwardThreads};
  coefficients.after_previous = dependent;
  launch_kernel(coefficients_kernel, coefficients, stream, static_cast<const A*>(partial), g.mean,
                g.rstd, g.gamma, affine_pairs, coef, p.N, C, G, p.HxW, at, ep);
  if (need_affine) launch_affine<scalar_t>(affine_pairs, p, a, stream);
  if (!need_dx) return;
  LaunchShape dx_tiles = tiles;
  dx_tiles.after_previous = dependent;
  with_passes_vec<scalar_t, kFused>(plan.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (channels_last) {
      launch_kernel(&groupnorm_backward_dx_channels_last_kernel<scalar_t, V, kFused>, dx_tiles,
                    stream, g.dy, g.x, static_cast<const Coef<A>*>(coef), g.dx, t, C, g.mean,
                    g.gamma, D, ep);
    } else {
      launch_kernel(&groupnorm_backward_dx_contiguous_kernel<scalar_t, V, kFused>, dx_tiles, stream,
                    g.dy, g.x, static_cast<const Coef<A>*>(coef), g.dx, t, g.mean, g.gamma, C, D,
                    ep);
    }
  });
}

// Each translation unit builds the plain backward (its three launchers) or
// the fused one (the registers kernel and the passes), as
// GROUPNORM_EPILOGUES says.
#define GROUPNORM_INSTANTIATE_BACKWARD_false(T)                                                    \
  template const void* backward_stream_kernel<T>(bool, int);                                       \
  template void launch_backward_stream<T>(const BackwardPlan&, const Problem&,                     \
                                          const BackwardArgs&, WorkspaceAllocator&, cudaStream_t); \
  template void launch_backward_registers<T, false>(const BackwardPlan&, const Problem&,           \
                                                    const BackwardArgs&, WorkspaceAllocator&,      \
                                                    cudaStream_t);                                 \
  template void launch_backward_passes<T, false>(const BackwardPlan&, const Problem&,              \
                                                 const BackwardArgs&, WorkspaceAllocator&,         \
                                                 cudaStream_t);
#define GROUPNORM_INSTANTIATE_BACKWARD_true(T)                                               \
  template void launch_backward_registers<T, true>(const BackwardPlan&, const Problem&,      \
                                                   const BackwardArgs&, WorkspaceAllocator&, \
                                                   cudaStream_t);                            \
  template void launch_backward_passes<T, true>(const BackwardPlan&, const Problem&,         \
                                                const BackwardArgs&, WorkspaceAllocator&,    \
                                                cudaStream_t);
#define GROUPNORM_INSTANTIATE_BACKWARD(T, fused) GROUPNORM_INSTANTIATE_BACKWARD_##fused(T)
#define GROUPNORM_INSTANTIATE_BACKWARDS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_BACKWARD, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_BACKWARDS)
#undef GROUPNORM_INSTANTIATE_BACKWARDS
#undef GROUPNORM_INSTANTIATE_BACKWARD
#undef GROUPNORM_INSTANTIATE_BACKWARD_true
#undef GROUPNORM_INSTANTIATE_BACKWARD_false

}  // namespace groupnorm
