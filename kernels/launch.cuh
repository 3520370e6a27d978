// The one way kernels are launched: cudaLaunchKernelEx on the current
// stream, plain, cooperative (teams that wait on each other must all be
// resident: the launch guarantees it or fails, never hangs), as clusters, or
// as a dependent launch that overlaps the previous kernel's end (sm_90+);
// and the dispatch from a planned vector width to a kernel's template.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "epilogue.cuh"
#include "errors.h"
#include "kernel_shapes.h"
#include "launchers.h"
#include "vec.cuh"

namespace groupnorm {

struct LaunchShape {
  int64_t grid;
  int threads;
  size_t smem = 0;
  bool cooperative = false;
  int cluster = 1;              // CTAs per cluster
  bool after_previous = false;  // may start before the previous kernel ends (griddep_wait)
};

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), const LaunchShape& shape, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(shape.grid));
  config.blockDim = dim3(unsigned(shape.threads));
  config.dynamicSmemBytes = shape.smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[3];
  unsigned count = 0;
  if (shape.cooperative) {
    attrs[count].id = cudaLaunchAttributeCooperative;
    attrs[count++].val.cooperative = 1;
  }
  if (shape.cluster > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = unsigned(shape.cluster);
    attrs[count].val.clusterDim.y = 1;
    attrs[count++].val.clusterDim.z = 1;
  }
  if (shape.after_previous) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = attrs;
  config.numAttrs = count;
  GROUPNORM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// An epilogue's untyped arguments as a kernel takes them.
template <typename scalar_t>
Epilogue<scalar_t, true> typed_epilogue(const EpilogueArgs& e) {
  Epilogue<scalar_t, true> epilogue;
  epilogue.add = static_cast<const scalar_t*>(e.add);
  epilogue.scale = static_cast<const scalar_t*>(e.scale);
  epilogue.shift = static_cast<const scalar_t*>(e.shift);
  epilogue.residual = static_cast<const scalar_t*>(e.residual);
  epilogue.residual_first = e.residual_first;
  epilogue.C = e.C;
  epilogue.slope = acc_t<scalar_t>(e.slope);
  epilogue.activations = e.activations;
  epilogue.chain = 0;
  for (int i = 0; i < e.activations; ++i) epilogue.chain |= uint32_t(e.chain[i]) << (8 * i);
  return epilogue;
}

// A call's pointers typed for scalar_t, accumulators in acc_t<scalar_t>.
template <typename scalar_t>
struct TypedForward {
  using A = acc_t<scalar_t>;
  const scalar_t* x;
  const scalar_t* gamma;
  const scalar_t* beta;
  scalar_t* y;
  A* mean;
  A* rstd;
  A eps;
  Epilogue<scalar_t, true> epilogue;
  explicit TypedForward(const ForwardArgs& a)
      : x(static_cast<const scalar_t*>(a.x)),
        gamma(static_cast<const scalar_t*>(a.gamma)),
        beta(static_cast<const scalar_t*>(a.beta)),
        y(static_cast<scalar_t*>(a.y)),
        mean(static_cast<A*>(a.mean)),
        rstd(static_cast<A*>(a.rstd)),
        eps(A(a.eps)),
        epilogue(typed_epilogue<scalar_t>(a.epilogue)) {}
  // The epilogue argument of a kernel instantiated with kFused.
  template <bool kFused>
  Epilogue<scalar_t, kFused> epilogue_for() const {
    if constexpr (kFused)
      return epilogue;
    else
      return {};
  }
};

template <typename scalar_t>
struct TypedBackward {
  using A = acc_t<scalar_t>;
  const scalar_t* dy;
  const scalar_t* x;
  const A* mean;
  const A* rstd;
  const scalar_t* gamma;
  scalar_t* dx;
  scalar_t* dgamma;
  scalar_t* dbeta;
  explicit TypedBackward(const BackwardArgs& a)
      : dy(static_cast<const scalar_t*>(a.dy)),
        x(static_cast<const scalar_t*>(a.x)),
        mean(static_cast<const A*>(a.mean)),
        rstd(static_cast<const A*>(a.rstd)),
        gamma(static_cast<const scalar_t*>(a.gamma)),
        dx(static_cast<scalar_t*>(a.dx)),
        dgamma(static_cast<scalar_t*>(a.dgamma)),
        dbeta(static_cast<scalar_t*>(a.dbeta)) {}
};

// Calls f(std::integral_constant<int, v>) for the vector widths a kernel is
// built for: up to kMaxBytes per access.
template <typename scalar_t, int kMaxBytes, typename F>
void with_vec(int v, F&& f) {
  constexpr int kMax = int(kMaxBytes / sizeof(scalar_t));
  switch (v) {
    case 8:
      if constexpr (kMax >= 8) return f(std::integral_constant<int, 8>{});
      break;
    case 4:
      if constexpr (kMax >= 4) return f(std::integral_constant<int, 4>{});
      break;
    case 2:
      if constexpr (kMax >= 2) return f(std::integral_constant<int, 2>{});
      break;
    case 1:
      return f(std::integral_constant<int, 1>{});
  }
  raise_error("groupnorm: no kernel for vector width " + std::to_string(v));
}

// A store kind (activation.h) as a type, a kernel copy's template argument.
template <Store K>
using StoreAs = std::integral_constant<Store, K>;

// Calls f(StoreAs<K>{}) for the kernel copy that serves `store` at vector
// width V: the kind's own where the kernel has copies at V
// (has_store_copies), else Any; a plain kernel's, Bare.
template <typename scalar_t, int V, bool kChannelsLastTeam, bool kFused, typename F>
decltype(auto) with_store(Store store, F&& f) {
  if constexpr (!kFused) {
    return f(StoreAs<Store::Bare>{});
  } else if constexpr (!has_store_copies(kChannelsLastTeam, V * sizeof(scalar_t),
                                         sizeof(scalar_t))) {
    return f(StoreAs<Store::Any>{});
  } else {
    switch (store) {
      case Store::Bare:
        return f(StoreAs<Store::Bare>{});
      case Store::SiLU:
        return f(StoreAs<Store::SiLU>{});
      case Store::ReLU:
        return f(StoreAs<Store::ReLU>{});
      case Store::Any:
        break;
    }
    return f(StoreAs<Store::Any>{});
  }
}

}  // namespace groupnorm
