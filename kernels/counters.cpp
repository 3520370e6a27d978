// One slot of counters (counter_slots.h) per (device, stream) for the life of
// the process. Launches on one stream run in order, so each finds its slot as
// the one before left it: zeroed. Two streams never share a slot. A stream
// gets none while it captures a CUDA graph (a replay may run beside eager
// launches on another stream, so the graph zeroes its own: a memset node),
// nor does the per-thread default stream (one handle, many streams); nor do
// counters larger than a slot, nor streams past the last slot.
#include "counters.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <utility>

#include "counter_slots.h"

namespace groupnorm {
namespace {

struct SlotTable {
  std::mutex mutex;
  std::map<std::pair<int, unsigned long long>, uint8_t*> slot_of;  // (device, stream id)
  std::map<int, int> used;                                         // slots taken, per device
};

SlotTable& table() {
  static SlotTable* t = new SlotTable;  // never destroyed: in use until the process ends
  return *t;
}

bool can_share(cudaStream_t stream) {
  if (stream == cudaStreamPerThread) return false;
  cudaStreamCaptureStatus status;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status == cudaStreamCaptureStatusNone;
}

}  // namespace

uint8_t* stream_counters(int64_t bytes, const at::Tensor& like, cudaStream_t stream) {
  if (bytes > kCounterSlotBytes || !can_share(stream)) return nullptr;
  unsigned long long id = 0;  // unlike a handle, never reused by a later stream
  C10_CUDA_CHECK(cudaStreamGetId(stream, &id));
  const int device = like.device().index();
  SlotTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  const auto found = t.slot_of.find({device, id});
  if (found != t.slot_of.end()) return found->second;
  int& used = t.used[device];
  if (used == kCounterSlots) return nullptr;
  const c10::cuda::CUDAGuard guard(like.device());
  void* base = nullptr;
  C10_CUDA_CHECK(counter_slots(&base));
  uint8_t* slot = static_cast<uint8_t*>(base) + used * kCounterSlotBytes;
  C10_CUDA_CHECK(cudaMemsetAsync(slot, 0, size_t(kCounterSlotBytes), stream));
  ++used;
  t.slot_of[{device, id}] = slot;
  return slot;
}

}  // namespace groupnorm
