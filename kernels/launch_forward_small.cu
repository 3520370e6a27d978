// Launchers of the small-problem forward kernels: the reference kernel (the
// oracle) and the registers kernel.
#include "forward_reference.cuh"
#include "forward_registers.cuh"
#include "launch.cuh"

namespace groupnorm {

// The registers kernel holding `items` vectors a thread.
template <typename scalar_t, int V, bool kFused>
auto registers_kernel_of(int items) {
  return items == kRegistersFewItems
             ? &groupnorm_forward_registers_kernel<scalar_t, V, kRegistersFewItems, kFused>
             : &groupnorm_forward_registers_kernel<scalar_t, V, kRegistersManyItems, kFused>;
}

template <typename scalar_t, bool kFused>
const void* registers_kernel(int vec, int items) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    kernel = reinterpret_cast<const void*>(
        registers_kernel_of<scalar_t, decltype(v)::value, kFused>(items));
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
    launch_kernel(registers_kernel_of<scalar_t, decltype(v)::value, kFused>(r.items), shape,
                  stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                  f.template epilogue_for<kFused>(), plan.units, int(p.HxW), p.C, p.G,
                  int(p.D()), p.channels_last, r.ranks, f.eps);
  });
}

#define GROUPNORM_INSTANTIATE_SMALL(T, F)                                                   \
  template const void* registers_kernel<T, F>(int, int);                                    \
  template void launch_reference<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                       cudaStream_t);                                       \
  template void launch_registers<T, F>(const ForwardPlan&, const Problem&, const ForwardArgs&, \
                                       cudaStream_t);
#define GROUPNORM_INSTANTIATE_SMALLS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_SMALL, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_SMALLS)
#undef GROUPNORM_INSTANTIATE_SMALLS
#undef GROUPNORM_INSTANTIATE_SMALL

}  // namespace groupnorm
