// Block sizes and per-thread work of each kernel: the contract between the
// planner (host) and the kernels. docs/DESIGN.md gives the measurements
// behind each number.
#pragma once

#include <cstdint>

namespace groupnorm {

constexpr int kWarp = 32;
constexpr int64_t kMaxGrid = int64_t(1) << 30;  // CTAs a launch may have

// Forward.
constexpr int kReferenceThreads = 256;
constexpr int kContiguousThreads = 256;
constexpr int kChannelsLastMaxThreads = 512;  // one CTA per SM: 128 registers, no spills
constexpr int kRegistersMaxThreads = 512;
constexpr int kRegistersFewItems = 4;    // vectors a thread holds, many small groups
constexpr int kRegistersManyItems = 16;  // twice the registers: larger groups, clusters
constexpr int kRegistersMaxRanks = 8;    // CTAs of a cluster (the portable maximum)
constexpr int kStreamThreads = 256;
constexpr int kStreamItems = 8;  // vectors (contiguous) or rows (channels-last) a thread holds
constexpr int kStreamPieceVecs = kStreamThreads * kStreamItems;
constexpr int kStreamBlocksPerSm = 3;      // register budget of the contiguous stream
constexpr int kStreamRowsBlocksPerSm = 3;  // and of the channels-last one
constexpr int kChunkPartials = 1024;       // partials one CTA merges in a couple of round trips

// Whether a fused forward kernel has a copy per store kind (activation.h's
// Store) at vectors of vec_bytes: at the width its planner prefers, 8 bytes
// for the channels-last team kernel and 16 for the others, not for double
// (each copy lengthens the build; DESIGN.md). The Any copy serves the rest.
constexpr bool has_store_copies(bool channels_last_team, int64_t vec_bytes, int64_t elem_bytes) {
  return elem_bytes < 8 && vec_bytes == (channels_last_team ? 8 : 16);
}

// Backward.
constexpr int kBackwardThreads = 256;
constexpr int kBackwardWarps = kBackwardThreads / kWarp;
constexpr int kWarpRowVecs = 256;  // contiguous rows up to this many vectors: one warp each
constexpr int kStreamBackwardItems = 8;
constexpr int kStreamBackwardTileVecs = kBackwardThreads * kStreamBackwardItems;
constexpr int kStreamBackwardBlocksPerSm = 2;
constexpr int kBackwardRegistersMaxThreads = 1024;
constexpr int kFusedBackwardRegistersMaxThreads = 512;  // the recompute's registers: 128 a thread
constexpr int kBackwardRegistersItems = 4;  // vectors of x and of dy a thread holds
constexpr int kBackwardRegistersSpreadUnits = 2;  // units an SM up to which a thread takes one
constexpr int kBackwardRegistersSpreadBelow = 256;  // plain: spread blocks of fewer threads only
// The registers backward's shared memory, its table of channel sums and its
// static scratch together: what a block gets without opting in to more.
constexpr int64_t kBackwardRegistersSharedBytes = 48 * 1024;

}  // namespace groupnorm
