// Launcher of the contiguous stream forward (forward_stream.cuh): the
// counters (left zeroed by the kernels), the ring of piece partials, then
// one plain launch.
#include "errors.h"
#include "forward_stream.cuh"
#include "launch.cuh"

namespace groupnorm {

// The kernel of width V, merge mode and store kind (its copies: with_store).
template <typename scalar_t, int V, bool kFused>
auto stream_kernel_of(bool each_merges, Store store) {
  return with_store<scalar_t, V, false, kFused>(store, [&](auto k) {
    constexpr Store kStore = decltype(k)::value;
    return each_merges ? &groupnorm_stream_kernel<scalar_t, V, true, kFused, kStore>
                       : &groupnorm_stream_kernel<scalar_t, V, false, kFused, kStore>;
  });
}

template <typename scalar_t, bool kFused>
const void* stream_kernel(int vec, Store store) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    kernel = reinterpret_cast<const void*>(
        stream_kernel_of<scalar_t, decltype(v)::value, kFused>(false, store));
  });
  return kernel;
}

template <typename scalar_t, bool kFused>
void launch_stream(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
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
  const int64_t L = int64_t(D) * p.HxW;
  const StreamCounters counters(plan.units, 1);
  const StreamWorkspace ws = counters.bind(alloc.counters(counters.bytes));
  A* partial = reinterpret_cast<A*>(alloc.allocate(s.slots * s.pieces * 2 * int64_t(sizeof(A))));
  const bool fast_div = L < (int64_t(1) << 31);
  const FastDivider hxw_div(fast_div ? uint32_t(p.HxW) : 1u);
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    launch_kernel(stream_kernel_of<scalar_t, decltype(v)::value, kFused>(s.each_merges, plan.store),
                  shape, stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                  f.template epilogue_for<kFused>(), partial, ws, L, p.HxW, p.G, D, s.pieces,
                  s.slots, order, hxw_div, fast_div, f.eps);
  });
}

#define GROUPNORM_INSTANTIATE_STREAM(T, F)                                                  \
  template const void* stream_kernel<T, F>(int, Store);                                     \
  template void launch_stream<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                    WorkspaceAllocator&, cudaStream_t);
#define GROUPNORM_INSTANTIATE_STREAMS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_STREAM, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_STREAMS)
#undef GROUPNORM_INSTANTIATE_STREAMS
#undef GROUPNORM_INSTANTIATE_STREAM

}  // namespace groupnorm
