// The ticket order shared by the stream kernels: every piece of every unit is
// visited twice, a first read (statistics, or the backward's sums) and, `lag`
// pieces later, a second read (normalise, or dx) that should find the piece
// still in L2. CTAs claim items from one ticket counter, in which the first
// reads run `lag` pieces ahead of the second:
//
//   S(0) .. S(lag-1), S(lag) N(0), S(lag+1) N(1), ..., N(total-lag) .. N(total-1)
//
// With lag >= pieces per unit, every first read of a unit has a smaller
// ticket than any second read of it. A second read waits only for its unit's
// first reads; in the forward kernels a first read also waits for its ring
// slot, freed by readers that hold smaller tickets as long as the host keeps
// slots > lag / pieces + 1. A CTA works on its tickets in the order it
// claimed them, so the unfinished item with the smallest ticket can always
// run: no deadlock whatever is resident, and no cooperative launch.
#pragma once

#include "layout.h"
#include "sync.cuh"
#include "vec.cuh"

namespace groupnorm {

// The counters of a stream launch: zero when it starts, and zero again when
// its last CTA leaves (stream_leave).
struct StreamWorkspace {
  unsigned long long* next;  // [1]              next ticket to hand out
  int* arrived;              // [units, chunks]  first reads finished, per chunk of pieces
  int* chunk_arrived;        // [units]          chunks merged (channels-last forward)
  int* ready;                // [units]          forward: merge=once, 1 when the unit's mean
                             //                  and rstd are written; merge=each, readers
                             //                  done with the unit's ring slot
  int* left;                 // [1]              CTAs that have left the kernel
  int64_t ints;              // the int counters above, from `arrived` to `left`
};

// The counters of `units` units of `chunks` chunks in `bytes` of memory;
// bind() points them into it.
struct StreamCounters {
  int64_t units, chunks, ints, bytes;
  StreamCounters(int64_t units_, int64_t chunks_) : units(units_), chunks(chunks_) {
    ints = units * chunks + 2 * units + 1;
    bytes = round_up_to_16(int64_t(sizeof(unsigned long long))) + ints * int64_t(sizeof(int));
  }
  StreamWorkspace bind(uint8_t* base) const {
    StreamWorkspace ws;
    ws.next = reinterpret_cast<unsigned long long*>(base);
    ws.arrived = reinterpret_cast<int*>(base + round_up_to_16(sizeof(unsigned long long)));
    ws.chunk_arrived = ws.arrived + units * chunks;
    ws.ready = ws.chunk_arrived + units;
    ws.left = ws.ready + units;
    ws.ints = ints;
    return ws;
  }
};

// Called by every CTA of a stream kernel once it has no item left. The last
// to leave zeroes the counters for the next launch on the stream: the others
// have done with them (thread 0, which alone touches them, left after its
// last wait), and it has acquired what they did.
__device__ __forceinline__ void stream_leave(const StreamWorkspace& ws) {
  bool last = false;
  if (threadIdx.x == 0) last = add_acq_rel(ws.left, 1) == int(gridDim.x) - 1;
  if (!__syncthreads_or(last)) return;
  for (int64_t i = threadIdx.x; i < ws.ints; i += blockDim.x) ws.arrived[i] = 0;
  if (threadIdx.x == 0) *ws.next = 0;
}

// Ticket -> item in the order above. total: pieces in all units.
struct StreamOrder {
  int64_t total, lag;
  // True for a first read; `piece` is the global piece index.
  __device__ __forceinline__ bool item(int64_t t, int64_t& piece) const {
    if (t < lag) {
      piece = t;
      return true;
    }
    const int64_t r = t - lag;
    const int64_t paired = total - lag;  // first reads after the first `lag`
    if (r < 2 * paired) {
      piece = (r & 1) == 0 ? lag + r / 2 : r / 2;
      return (r & 1) == 0;
    }
    piece = paired + (r - 2 * paired);
    return false;
  }
};

}  // namespace groupnorm
