// The activations the forward epilogue applies (epilogue.cuh), shared by the
// host, which checks the codes Python passes and picks the store kind, and
// the kernels. A code is the enumerator's value; groupnorm_inline.py's
// _ACTIVATION_CODES lists the same names in the same order.
#pragma once

#include <cstdint>

namespace groupnorm {

enum class Activation : uint8_t {
  SiLU,       // x / (1 + exp(-x))
  GELU,       // x / 2 * (1 + erf(x / sqrt(2)))
  GELUTanh,   // x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))
  ReLU,       // max(x, 0)
  LeakyReLU,  // x > 0 ? x : slope * x
  Tanh,
  Sigmoid,    // 1 / (1 + exp(-x))
  Hardswish,  // x * min(max(x + 3, 0), 6) / 6
  Mish,       // x * tanh(log1p(exp(x)))
};
constexpr int kActivationCodes = 9;
constexpr int kMaxActivations = 4;  // the longest chain

// What a fused forward kernel's store applies to each vector, fixed when it
// is compiled: nothing, SiLU alone or ReLU alone (no residual), the common
// calls, which then test nothing per vector (DESIGN.md); or Any option,
// each tested per vector. A plain kernel's is Bare.
enum class Store : uint8_t { Bare, SiLU, ReLU, Any };

}  // namespace groupnorm
