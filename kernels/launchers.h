// The kernel families' entry points on the host: each family's translation
// unit defines them for the dtypes of GROUPNORM_DTYPES (below; scalar_t:
// float, double, c10::Half, c10::BFloat16 in the library's build). The
// planner asks for kernel symbols (occupancy); the forward and backward
// entry points launch plans.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

#include <type_traits>

#include "activation.h"
#include "layout.h"
#include "plan.h"

namespace groupnorm {

// The forward's epilogue (epilogue.cuh) of one call, untyped: scale and
// shift [N, C] of x's dtype or null, residual in y's layout and strides or
// null, and the activation chain applied between them (none by default).
struct EpilogueArgs {
  const void* add = nullptr;  // [N, C]: the norm of x + add
  const void* scale = nullptr;
  const void* shift = nullptr;
  const void* residual = nullptr;
  bool residual_first = false;  // act(y + residual) instead of act(y) + residual; with a chain
  int64_t C = 0;        // channels of a row of scale and shift
  double slope = 0.01;  // LeakyReLU's
  int activations = 0;
  Activation chain[kMaxActivations] = {};
  bool any() const {
    return add != nullptr || scale != nullptr || shift != nullptr || residual != nullptr ||
           activations > 0;
  }
  // No activation, or SiLU or ReLU alone: what the kernels apply inline,
  // without calling `activate` (epilogue.cuh), the registers kernel too, and
  // what the fused backward's passes and registers kernel take back
  // themselves (recompute_lanes).
  bool inline_chain() const {
    return activations == 0 ||
           (activations == 1 && (chain[0] == Activation::SiLU || chain[0] == Activation::ReLU));
  }
  Store store() const {
    if (residual != nullptr || activations > 1) return Store::Any;
    if (activations == 0) return Store::Bare;
    if (chain[0] == Activation::SiLU) return Store::SiLU;
    return chain[0] == Activation::ReLU ? Store::ReLU : Store::Any;
  }
};

// Pointers of one forward call, typed by the launcher: x, y in the input's
// layout; gamma, beta [C] or null; mean, rstd [N, G] in the accumulation type.
struct ForwardArgs {
  const void* x;
  const void* gamma;
  const void* beta;
  void* y;
  void* mean;
  void* rstd;
  double eps;
  EpilogueArgs epilogue;
};

// One backward call: dy and x in x's layout; dx there or null (not wanted);
// dgamma, dbeta [C] or null (not wanted). The fused backward's
// (backward_epilogue.cuh) also: beta, the forward's epilogue (add, scale,
// shift, the chain; no residual), and dscale, dshift, dadd [N, C] or null.
struct BackwardArgs {
  const void* dy;
  const void* x;
  const void* mean;
  const void* rstd;
  const void* gamma;
  void* dx;
  void* dgamma;
  void* dbeta;
  const void* beta = nullptr;
  EpilogueArgs epilogue = {};
  void* dscale = nullptr;
  void* dshift = nullptr;
  void* dadd = nullptr;
};

// Kernel symbols for the occupancy queries: the copy of the store kind
// that will run. Either merge of a stream kernel has the same launch bounds
// and shared memory, so the same residency. kFused: the forward kernel with
// the epilogue (epilogue.cuh).
template <typename scalar_t, bool kFused>
const void* team_kernel(bool channels_last, int vec, Store store);
// kItems: the vectors a thread holds (RegistersConfig::items)
template <typename scalar_t, int kItems, bool kFused>
const void* registers_kernel(int vec, Store store);
template <typename scalar_t, bool kFused>
const void* stream_kernel(int vec, Store store);
template <typename scalar_t, bool kFused>
const void* stream_channels_last_kernel(int vec, Store store);
template <typename scalar_t>
const void* backward_stream_kernel(bool channels_last, int vec);

// s = x + add, add [N, C] (one value per sample and channel), in x's layout:
// the separate add of plans that cannot form s in their kernel.
template <typename scalar_t, bool kFused>
void launch_add_per_channel(const Problem& p, const void* x, const void* add, void* s,
                            cudaStream_t stream);

template <typename scalar_t, bool kFused>
void launch_reference(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                      cudaStream_t stream);
template <typename scalar_t, int kItems, bool kFused>
void launch_registers(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                      cudaStream_t stream);
template <typename scalar_t, bool kFused>
void launch_team(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                 WorkspaceAllocator& workspace, cudaStream_t stream);
template <typename scalar_t, bool kFused>
void launch_stream(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                   WorkspaceAllocator& workspace, cudaStream_t stream);
template <typename scalar_t, bool kFused>
void launch_stream_channels_last(const ForwardPlan& plan, const Problem& p, const ForwardArgs& a,
                                 WorkspaceAllocator& workspace, cudaStream_t stream);
template <typename scalar_t, bool kFused>
void launch_backward_passes(const BackwardPlan& plan, const Problem& p, const BackwardArgs& a,
                            WorkspaceAllocator& workspace, cudaStream_t stream);
template <typename scalar_t>
void launch_backward_stream(const BackwardPlan& plan, const Problem& p, const BackwardArgs& a,
                            WorkspaceAllocator& workspace, cudaStream_t stream);
template <typename scalar_t, bool kFused>
void launch_backward_registers(const BackwardPlan& plan, const Problem& p, const BackwardArgs& a,
                               WorkspaceAllocator& workspace, cudaStream_t stream);

// The dtypes (GROUPNORM_DTYPES) and forward epilogue switches
// (GROUPNORM_EPILOGUES: X(T, false) X(T, true)) a build has kernels for:
// all, unless defined before this header. The loader compiles one
// translation unit per dtype (and per switch) in parallel, each defining
// them to its own; a KernelBench solution, one translation unit, defines
// them to what its problem runs (float32; the plain or the fused forward).
#ifndef GROUPNORM_DTYPES
#define GROUPNORM_DTYPES(X) X(float) X(double) X(c10::Half) X(c10::BFloat16)
#endif
#ifndef GROUPNORM_EPILOGUES
#define GROUPNORM_EPILOGUES(X, T) X(T, false) X(T, true)
#endif

#define GROUPNORM_IS_DTYPE(U) || std::is_same_v<T, U>
template <typename T>
constexpr bool built_for_dtype() {
  return false GROUPNORM_DTYPES(GROUPNORM_IS_DTYPE);
}
#undef GROUPNORM_IS_DTYPE

#define GROUPNORM_IS_SWITCH(T, fused) || (fused) == kFused
template <bool kFused>
constexpr bool built_for_epilogue() {
  return false GROUPNORM_EPILOGUES(GROUPNORM_IS_SWITCH, float);
}
#undef GROUPNORM_IS_SWITCH

}  // namespace groupnorm
