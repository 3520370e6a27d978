// The activations the forward epilogue applies (epilogue.cuh), shared by the
// host, which checks the codes Python passes, and the kernels. A code is the
// enumerator's value; groupnorm_inline.py's _ACTIVATION_CODES lists the same
// names in the same order.
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

}  // namespace groupnorm
