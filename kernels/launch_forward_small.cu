// Launchers of the small-problem forward kernels: the reference kernel (the
// oracle) and the registers kernel; and the separate pre-norm add.
#include <algorithm>

#include "add_per_channel.cuh"
#include "forward_reference.cuh"
#include "forward_registers.cuh"
#include "launch.cuh"

namespace groupnorm {

// The registers kernel holding `items` vectors a thread, of a store kind
// (its copies: with_store).
template <typename scalar_t, int V, bool kFused>
auto registers_kernel_of(int items, Store store) {
  return with_store<scalar_t, V, false, kFused>(store, [&](auto k) {
    constexpr Store kStore = decltype(k)::value;
    return items == kRegistersFewItems
               ? &groupnorm_forward_registers_kernel<scalar_t, V, kRegistersFewItems, kFused,
                                                     kStore>
               : &groupnorm_forward_registers_kernel<scalar_t, V, kRegistersManyItems, kFused,
                                                     kStore>;
  });
}

template <typename scalar_t, bool kFused>
const void* registers_kernel(int vec, int items, Store store) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    kernel = reinterpret_cast<const void*>(
        registers_kernel_of<scalar_t, decltype(v)::value, kFused>(items, store));
  });
  return kernel;
}

template <typename scalar_t, bool kFused>
void launch_reference(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                      cudaStream_t stream) {
  const int64_t stride_c = p.channels_last ? 1 : p.HxW;
  const int64_t stride_s = p.channels_last ? p.C : 1;
  const TypedForward<scalar_t> f(a);
  launch_kernel(&groupnorm_forward_reference_kernel<scalar_t, kFused>, {plan.grid, plan.threads},
                stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                f.template epilogue_for<kFused>(), p.N, p.HxW, p.G, int(p.D()), p.C * p.HxW,
                stride_c, stride_s, f.eps);
}

// The epilogue's inline forms alone (kFused): the planner gives a called
// chain another kernel.
template <typename scalar_t, bool kFused>
void launch_registers(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                      cudaStream_t stream) {
  const TypedForward<scalar_t> f(a);
  const RegistersConfig& r = plan.registers;
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    LaunchShape shape{plan.grid, plan.threads};
    shape.cluster = r.ranks;
    launch_kernel(registers_kernel_of<scalar_t, decltype(v)::value, kFused>(r.items, plan.store),
                  shape, stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                  f.template epilogue_for<kFused>(), plan.units, int(p.HxW), p.C, p.G, int(p.D()),
                  p.channels_last, r.ranks, f.eps);
  });
}

// Channels-last reads add as vectors: p.addr holds its address too. The
// caller keeps a sample's vectors under 2^31.
template <typename scalar_t, bool kFused>
void launch_add_per_channel(const Problem& p, const void* x, const void* add, void* s,
                            cudaStream_t stream) {
  with_vec<scalar_t, 16>(widest_vector(p, {p.channels_last ? p.C : p.HxW}), [&](auto v) {
    constexpr int V = decltype(v)::value;
    const int64_t vectors = p.C * p.HxW / V;
    // about eight CTAs an SM over all samples, at least one a sample
    const int64_t wanted = (int64_t(p.dev->sms) * 8 + p.N - 1) / p.N;
    const int blocks = int(std::max<int64_t>(
        1, std::min<int64_t>((vectors + kAddThreads - 1) / kAddThreads, wanted)));
    const int64_t per_index = p.channels_last ? p.C / V : p.HxW / V;
    launch_kernel(&add_per_channel_kernel<scalar_t, V>, {p.N * blocks, kAddThreads}, stream,
                  static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(add),
                  static_cast<scalar_t*>(s), uint32_t(vectors), FastDivider(uint32_t(per_index)),
                  uint32_t(p.C / V), p.C, blocks, p.channels_last);
  });
}

#define GROUPNORM_INSTANTIATE_SMALL(T, F)                                                      \
  template void launch_add_per_channel<T, F>(const Problem&, const void*, const void*, void*,  \
                                             cudaStream_t);                                    \
  template const void* registers_kernel<T, F>(int, int, Store);                                \
  template void launch_reference<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                       cudaStream_t);                                       \
  template void launch_registers<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                       cudaStream_t);
#define GROUPNORM_INSTANTIATE_SMALLS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_SMALL, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_SMALLS)
#undef GROUPNORM_INSTANTIATE_SMALLS
#undef GROUPNORM_INSTANTIATE_SMALL

}  // namespace groupnorm
