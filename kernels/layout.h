// Sizes shared by the host (planning, allocation) and the kernels: 16-byte
// rounding, dynamic shared memory of the team and stream kernels, and the
// workspace every launch carves from one allocation.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define GROUPNORM_HOST_DEVICE __host__ __device__
#else
#define GROUPNORM_HOST_DEVICE
#endif

namespace groupnorm {

// Bytes rounded up to 16, so that what is laid out after them stays aligned
// for 16-byte vectors.
GROUPNORM_HOST_DEVICE constexpr int64_t round_up_to_16(int64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// Dynamic shared memory of a team kernel (SharedLayout in team.cuh).
inline size_t team_shared_bytes(size_t slice_bytes, int red_entries, int groups, size_t acc_size) {
  return size_t(round_up_to_16(int64_t(slice_bytes))) +
         (size_t(red_entries) + 4 * size_t(groups)) * acc_size;
}

// Dynamic shared memory of the channels-last stream forward: the per-thread
// table [rows_per_step, cols] and the per-group sums and M2 of a piece.
inline size_t stream_rows_shared_bytes(int rows_per_step, int cols, int G, size_t acc_size) {
  return (size_t(rows_per_step) * cols + 2 * size_t(G)) * acc_size;
}

// Where each array of a launch's temporary memory lies in its one
// allocation: add<T>(count) returns the byte offset of `count` Ts, each array
// starting 16-byte aligned.
struct WorkspaceLayout {
  int64_t bytes = 0;
  template <typename T>
  int64_t add(int64_t count) {
    const int64_t at = bytes;
    bytes += round_up_to_16(count * int64_t(sizeof(T)));
    return at;
  }
};

// Device memory for one launch on the caller's stream: a temporary (the
// caching allocator's), and the counters by which CTAs wait on each other,
// which are zero when the launch starts and which the kernels leave at zero
// (team_leave, stream_leave).
class WorkspaceAllocator {
 public:
  virtual uint8_t* allocate(int64_t bytes) = 0;
  virtual uint8_t* counters(int64_t bytes) = 0;

 protected:
  ~WorkspaceAllocator() = default;
};

}  // namespace groupnorm
