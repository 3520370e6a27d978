// The ticket order shared by the stream kernels (forward_stream.cu,
// forward_stream_channels_last.cu, backward_stream.cu,
// backward_stream_channels_last.cu): every piece of every
// unit is visited twice, a first read (statistics) and, `lag` pieces later, a
// second read (normalise, or dx) that should find the piece still in L2.
// CTAs claim items from one ticket counter, in which the first reads run
// `lag` pieces ahead of the second:
//
//   S(0) .. S(lag-1), S(lag) N(0), S(lag+1) N(1), ..., N(total-lag) .. N(total-1)
//
// With lag >= pieces per unit, every first read of a unit has a smaller
// ticket than any second read of it. A second read waits only for its unit's
// first reads; in the forward kernels a first read also waits for its ring
// slot, freed by readers that hold smaller tickets as long as the host keeps
// slots > lag / pieces + 1 (forward_stream.cu). A CTA works on its tickets in
// the order it claimed them, so the unfinished item with the smallest ticket
// can always run: no deadlock whatever is resident, and no cooperative
// launch.
#pragma once

#include "common.cuh"

namespace groupnorm {

// One vector load with an L2 eviction priority: evict_last for the first
// read of a piece (L2 should still hold it at the second), evict_first for
// the second. Hints need sm_80 and 16-byte vectors; other loads are plain.
template <typename VecT>
__device__ __forceinline__ VecT load_with_l2_priority(const VecT* p, bool keep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(VecT) == 16) {
    uint64_t policy;
    if (keep) {
      asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    } else {
      asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    }
    VecT v;
    uint32_t* r = reinterpret_cast<uint32_t*>(&v);
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(p), "l"(policy));
    return v;
  }
#endif
  return *p;
}

struct StreamWorkspace {
  unsigned long long* next;  // [1]     next ticket to hand out
  int* arrived;              // [units] statistics items finished
  int* ready;                // [units] forward, merge=once: 1 when the unit's mean and
                             //         rstd are written; merge=each: readers done with
                             //         the unit's ring slot (unused by the backward)
};

// Bytes of a StreamWorkspace's counters for `units` units, rounded up to 16
// so that what the caller lays out after them stays aligned. They must be
// zeroed before the launch.
inline int64_t stream_counter_bytes(int64_t units) {
  return round_up_to_16(int64_t(sizeof(unsigned long long)) + 2 * units * int64_t(sizeof(int)));
}

// The counters of stream_counter_bytes(units) laid out from `base`.
inline StreamWorkspace stream_workspace(uint8_t* base, int64_t units) {
  StreamWorkspace ws;
  ws.next = reinterpret_cast<unsigned long long*>(base);
  ws.arrived = reinterpret_cast<int*>(base + sizeof(unsigned long long));
  ws.ready = ws.arrived + units;
  return ws;
}

// Ticket -> item in the order above. total: pieces in all units.
struct StreamOrder {
  int64_t total, lag;
  // True for a statistics item; `piece` is the global piece index.
  __device__ __forceinline__ bool item(int64_t t, int64_t& piece) const {
    if (t < lag) {
      piece = t;
      return true;
    }
    const int64_t r = t - lag;
    const int64_t paired = total - lag;  // statistics items after the first `lag`
    if (r < 2 * paired) {
      piece = (r & 1) == 0 ? lag + r / 2 : r / 2;
      return (r & 1) == 0;
    }
    piece = paired + (r - 2 * paired);
    return false;
  }
};

}  // namespace groupnorm
