// Counters that the team and stream kernels leave zeroed, kept per stream, so
// that a launch on that stream needs no memset before it.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace groupnorm {

// `bytes` of zeroed counters for a launch on `stream` of `like`'s device,
// which the launch must leave zeroed; nullptr where no slot can serve it
// (counters.cpp): the caller zeroes a temporary instead.
uint8_t* stream_counters(int64_t bytes, const at::Tensor& like, cudaStream_t stream);

}  // namespace groupnorm
