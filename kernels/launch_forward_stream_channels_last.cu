// Launcher of the channels-last stream forward
// (forward_stream_channels_last.cuh): the counters (left zeroed by the
// kernels), the rings of piece and chunk partials in one allocation, then one
// plain launch.
#include "errors.h"
#include "forward_stream_channels_last.cuh"
#include "launch.cuh"

namespace groupnorm {

// The kernel of width V, merge mode and store kind (its copies: with_store).
template <typename scalar_t, int V, bool kFused>
auto stream_channels_last_kernel_of(bool each_merges, Store store) {
  return with_store<scalar_t, V, false, kFused>(store, [&](auto k) {
    constexpr Store kStore = decltype(k)::value;
    return each_merges ? &groupnorm_stream_channels_last_kernel<scalar_t, V, true, kFused, kStore>
                       : &groupnorm_stream_channels_last_kernel<scalar_t, V, false, kFused, kStore>;
  });
}

template <typename scalar_t, bool kFused>
const void* stream_channels_last_kernel(int vec, Store store) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    kernel = reinterpret_cast<const void*>(
        stream_channels_last_kernel_of<scalar_t, decltype(v)::value, kFused>(false, store));
  });
  return kernel;
}

template <typename scalar_t, bool kFused>
void launch_stream_channels_last(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                                 WorkspaceAllocator& alloc, cudaStream_t stream) {
  // Built without a residual before the activations (store_output's
  // kResidualFirst): forward_fused splits such a call.
  GROUPNORM_CHECK(!a.epilogue.residual_first,
                  "groupnorm: a stream kernel launched with a residual before the activations "
                  "(an internal error)");
  using A = acc_t<scalar_t>;
  const StreamConfig& s = plan.stream;
  const TypedForward<scalar_t> f(a);
  const int D = int(p.D());
  const StreamOrder order{plan.units * s.pieces, s.lag};
  const LaunchShape shape{plan.grid, plan.threads, plan.smem};
  WorkspaceLayout layout;
  const int64_t chunks = (s.pieces + s.chunk - 1) / s.chunk;
  const int unit_groups = p.G / s.blocks;
  const StreamCounters counters(plan.units, chunks);
  const int64_t piece_at = layout.add<A>(s.slots * s.pieces * unit_groups * 2);
  const int64_t chunk_at = layout.add<A>(s.slots * chunks * unit_groups * 2);
  uint8_t* base = alloc.allocate(layout.bytes);
  const StreamWorkspace ws = counters.bind(alloc.counters(counters.bytes));
  const auto piece_partial = reinterpret_cast<A*>(base + piece_at);
  const auto chunk_partial = reinterpret_cast<A*>(base + chunk_at);
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    launch_kernel(stream_channels_last_kernel_of<scalar_t, decltype(v)::value, kFused>(
                      s.each_merges, plan.store),
                  shape, stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                  f.template epilogue_for<kFused>(), piece_partial, chunk_partial, ws, p.HxW,
                  int(p.C), s.blocks, unit_groups, D, s.rows_per_step, s.pieces, s.chunk, s.slots,
                  order, f.eps);
  });
}

#define GROUPNORM_INSTANTIATE_STREAM_ROWS(T, F)                       \
  template const void* stream_channels_last_kernel<T, F>(int, Store); \
  template void launch_stream_channels_last<T, F>(                    \
      const ForwardPlan&, const Problem&, const ForwardArgs&, WorkspaceAllocator&, cudaStream_t);
#define GROUPNORM_INSTANTIATE_STREAMS_ROWS(T) \
  GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_STREAM_ROWS, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_STREAMS_ROWS)
#undef GROUPNORM_INSTANTIATE_STREAMS_ROWS
#undef GROUPNORM_INSTANTIATE_STREAM_ROWS

}  // namespace groupnorm
