// The module's static device memory for counters: kCounterSlots slots of
// kCounterSlotBytes, handed out by counters.cpp. Static, not the caching
// allocator's: a block from it could land in a pool that CUDA graphs or a
// user's MemPool manage.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace groupnorm {

constexpr int kCounterSlots = 64;
constexpr int64_t kCounterSlotBytes = 16384;

// The first slot's address on the current device.
cudaError_t counter_slots(void** base);

}  // namespace groupnorm
