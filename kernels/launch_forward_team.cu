// Launchers of the team kernels (forward_contiguous.cuh,
// forward_channels_last.cuh): one cooperative launch when a unit is shared by
// several CTAs, with the team workspace: counters the kernels leave zeroed,
// and the partials and results of every team in one temporary.
#include "forward_channels_last.cuh"
#include "forward_contiguous.cuh"
#include "launch.cuh"

namespace groupnorm {

// The kernels of width V and a store kind (their copies: with_store; the
// channels-last planner prefers 8-byte vectors).
template <typename scalar_t, int V, bool kFused>
auto channels_last_kernel_of(Store store) {
  return with_store<scalar_t, V, true, kFused>(store, [&](auto k) {
    return &groupnorm_forward_channels_last_kernel<scalar_t, V, kFused, decltype(k)::value>;
  });
}

template <typename scalar_t, int V, bool kFused>
auto contiguous_kernel_of(Store store) {
  return with_store<scalar_t, V, false, kFused>(store, [&](auto k) {
    return &groupnorm_forward_contiguous_kernel<scalar_t, V, kFused, decltype(k)::value>;
  });
}

template <typename scalar_t, bool kFused>
const void* team_kernel(bool channels_last, int vec, Store store) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    kernel =
        channels_last
            ? reinterpret_cast<const void*>(channels_last_kernel_of<scalar_t, V, kFused>(store))
            : reinterpret_cast<const void*>(contiguous_kernel_of<scalar_t, V, kFused>(store));
  });
  return kernel;
}

// The workspace of a team of T > 1 CTAs sharing `groups` groups a unit; none
// for T == 1.
template <typename A>
TeamWorkspace<A> team_workspace(const ForwardPlan& plan, int groups, WorkspaceAllocator& alloc) {
  TeamWorkspace<A> ws{nullptr, nullptr, nullptr, nullptr, nullptr};
  const int64_t T = plan.team.team;
  if (T == 1) return ws;
  const int64_t teams = plan.grid / T;
  ws.arrived = reinterpret_cast<int*>(alloc.counters(kTeamCounters * teams * int64_t(sizeof(int))));
  ws.published = ws.arrived + teams;
  ws.left = ws.published + teams;
  WorkspaceLayout layout;
  const int64_t partial = layout.add<A>(teams * 2 * T * groups * 2);
  const int64_t result = layout.add<A>(teams * 2 * groups * 2);
  uint8_t* base = alloc.allocate(layout.bytes);
  ws.partial = reinterpret_cast<A*>(base + partial);
  ws.result = reinterpret_cast<A*>(base + result);
  return ws;
}

template <typename scalar_t, bool kFused>
void launch_team(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                 WorkspaceAllocator& alloc, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const TeamConfig& t = plan.team;
  const TypedForward<scalar_t> f(a);
  LaunchShape shape{plan.grid, plan.threads, plan.smem};
  shape.cooperative = t.team > 1;
  const int D = int(p.D());
  if (plan.kernel == ForwardKernel::ChannelsLast) {
    const int unit_groups = p.G / t.blocks;
    const auto ws = team_workspace<A>(plan, unit_groups, alloc);
    with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
      launch_kernel(channels_last_kernel_of<scalar_t, decltype(v)::value, kFused>(plan.store),
                    shape, stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                    f.template epilogue_for<kFused>(), ws, plan.units, p.HxW, int(p.C), t.blocks,
                    int(p.C / t.blocks), unit_groups, D, t.rows_per_step, t.team, t.slice, t.kept,
                    f.eps);
    });
    return;
  }
  const auto ws = team_workspace<A>(plan, 1, alloc);
  const int64_t slice_elems = t.slice * plan.vec;
  const bool fast_div = p.HxW + slice_elems < (int64_t(1) << 31);
  const FastDivider hxw_div(fast_div ? uint32_t(p.HxW) : 1u);
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    launch_kernel(contiguous_kernel_of<scalar_t, decltype(v)::value, kFused>(plan.store), shape,
                  stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                  f.template epilogue_for<kFused>(), ws, plan.units, int64_t(D) * p.HxW, p.HxW, p.G,
                  D, t.team, slice_elems, t.kept, hxw_div, fast_div, f.eps);
  });
}

#define GROUPNORM_INSTANTIATE_TEAM(T, F)                                                  \
  template const void* team_kernel<T, F>(bool, int, Store);                               \
  template void launch_team<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                  WorkspaceAllocator&, cudaStream_t);
#define GROUPNORM_INSTANTIATE_TEAMS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_TEAM, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_TEAMS)
#undef GROUPNORM_INSTANTIATE_TEAMS
#undef GROUPNORM_INSTANTIATE_TEAM

}  // namespace groupnorm
