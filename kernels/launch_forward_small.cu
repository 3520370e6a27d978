// Launchers of the small-problem forward kernels: the reference kernel (the
// oracle) and the registers kernel's few-items copies (its many-items ones:
// launch_forward_registers_many.cu); and the separate pre-norm add.
#include <algorithm>

#include "add_per_channel.cuh"
#include "forward_reference.cuh"
#include "launch.cuh"
#include "launch_forward_registers.cuh"

namespace groupnorm {

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
  template void launch_reference<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                       cudaStream_t);                                          \
  GROUPNORM_INSTANTIATE_REGISTERS(T, kRegistersFewItems, F)
#define GROUPNORM_INSTANTIATE_SMALLS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_SMALL, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_SMALLS)
#undef GROUPNORM_INSTANTIATE_SMALLS
#undef GROUPNORM_INSTANTIATE_SMALL

}  // namespace groupnorm
