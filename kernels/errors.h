// The errors the kernel units raise: their checks call these functions,
// defined in errors.cpp, so that no kernel unit parses torch's exception
// headers, which took a third of a small unit's compile (docs/DESIGN.md,
// "Build"). Python sees what TORCH_CHECK and C10_CUDA_CHECK raise.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace groupnorm {

// c10::Error (RuntimeError in Python), as TORCH_CHECK(false, message) raises.
[[noreturn]] void raise_error(const std::string& message);

// What C10_CUDA_CHECK raises for `error` from a CUDA call at file:line in
// `function`.
void raise_cuda_error(cudaError_t error, const char* file, const char* function, int line);

}  // namespace groupnorm

// The message is built only when the check fails.
#define GROUPNORM_CHECK(condition, message)                           \
  do {                                                                \
    if (!(condition)) ::groupnorm::raise_error(message);              \
  } while (false)

#define GROUPNORM_CUDA_CHECK(call)                                                   \
  do {                                                                               \
    const cudaError_t groupnorm_error = (call);                                      \
    if (groupnorm_error != cudaSuccess)                                              \
      ::groupnorm::raise_cuda_error(groupnorm_error, __FILE__, __func__, __LINE__);  \
  } while (false)
