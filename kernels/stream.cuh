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

#include "errors.h"
#include "layout.h"
#include "sync.cuh"
#include "vec.cuh"

namespace groupnorm {

// The counters of a stream launch, zeroed before it.
struct StreamWorkspace {
  unsigned long long* next;  // [1]              next ticket to hand out
  int* arrived;              // [units, chunks]  first reads finished, per chunk of pieces
  int* chunk_arrived;        // [units]          chunks merged (channels-last forward)
  int* ready;                // [units]          forward: merge=once, 1 when the unit's mean
                             //                  and rstd are written; merge=each, readers
                             //                  done with the unit's ring slot
};

// Lays out the counters of `units` units of `chunks` chunks as the first
// `bytes` of `layout` (the part of a workspace that is zeroed); bind()
// points them into the allocation.
struct StreamCounters {
  int64_t units, chunks, ints_at, bytes;
  StreamCounters(WorkspaceLayout& layout, int64_t units_, int64_t chunks_)
      : units(units_), chunks(chunks_) {
    GROUPNORM_CHECK(layout.bytes == 0, "groupnorm: stream counters must open the workspace");
    layout.add<unsigned long long>(1);
    ints_at = layout.add<int>(units * chunks + 2 * units);
    bytes = layout.bytes;
  }
  StreamWorkspace bind(uint8_t* base) const {
    StreamWorkspace ws;
    ws.next = reinterpret_cast<unsigned long long*>(base);
    ws.arrived = reinterpret_cast<int*>(base + ints_at);
    ws.chunk_arrived = ws.arrived + units * chunks;
    ws.ready = ws.chunk_arrived + units;
    return ws;
  }
};

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
