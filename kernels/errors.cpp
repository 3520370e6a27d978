#include "errors.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

namespace groupnorm {

void raise_error(const std::string& message) { TORCH_CHECK(false, message); }

void raise_cuda_error(cudaError_t error, const char* file, const char* function, int line) {
  c10::cuda::c10_cuda_check_implementation(static_cast<int32_t>(error), file, function,
                                           static_cast<uint32_t>(line), true);
}

}  // namespace groupnorm
