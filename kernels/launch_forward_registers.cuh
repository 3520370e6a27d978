// The registers kernel's launcher and kernel query for one count of vectors
// a thread holds. Each count is compiled in units of its own: the few-items
// copies in launch_forward_small.cu, the many-items ones in
// launch_forward_registers_many.cu; together they were the build's longest
// unit (docs/DESIGN.md, "Build").
#pragma once

#include "forward_registers.cuh"
#include "launch.cuh"

namespace groupnorm {

// The registers kernel holding kItems vectors a thread, of a store kind
// (its copies: with_store).
template <typename scalar_t, int V, int kItems, bool kFused>
auto registers_kernel_of(Store store) {
  return with_store<scalar_t, V, false, kFused>(store, [](auto k) {
    return &groupnorm_forward_registers_kernel<scalar_t, V, kItems, kFused, decltype(k)::value>;
  });
}

template <typename scalar_t, int kItems, bool kFused>
const void* registers_kernel(int vec, Store store) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    kernel = reinterpret_cast<const void*>(
        registers_kernel_of<scalar_t, decltype(v)::value, kItems, kFused>(store));
  });
  return kernel;
}

// The epilogue's inline forms alone (kFused): the planner gives a called
// chain another kernel.
template <typename scalar_t, int kItems, bool kFused>
void launch_registers(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                      cudaStream_t stream) {
  const TypedForward<scalar_t> f(a);
  const RegistersConfig& r = plan.registers;
  with_vec<scalar_t, 16>(plan.vec, [&](auto v) {
    LaunchShape shape{plan.grid, plan.threads};
    shape.cluster = r.ranks;
    launch_kernel(registers_kernel_of<scalar_t, decltype(v)::value, kItems, kFused>(plan.store),
                  shape, stream, f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                  f.template epilogue_for<kFused>(), plan.units, int(p.HxW), p.C, p.G, int(p.D()),
                  p.channels_last, r.ranks, f.eps);
  });
}

#define GROUPNORM_INSTANTIATE_REGISTERS(T, K, F)                                            \
  template const void* registers_kernel<T, K, F>(int, Store);                               \
  template void launch_registers<T, K, F>(const ForwardPlan&, const Problem&,               \
                                          const ForwardArgs&, cudaStream_t);

}  // namespace groupnorm
