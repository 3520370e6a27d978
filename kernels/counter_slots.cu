#include "counter_slots.h"

namespace groupnorm {

// 16-byte aligned, as the workspace layouts assume (the tickets are 8-byte atomics)
__device__ __align__(16) uint8_t counter_slot_memory[kCounterSlots * kCounterSlotBytes];

cudaError_t counter_slots(void** base) { return cudaGetSymbolAddress(base, counter_slot_memory); }

}  // namespace groupnorm
