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

// Backward.
constexpr int kBackwardThreads = 256;
constexpr int kBackwardWarps = kBackwardThreads / kWarp;
constexpr int kWarpRowVecs = 256;  // contiguous rows up to this many vectors: one warp each
constexpr int kStreamBackwardItems = 8;
constexpr int kStreamBackwardTileVecs = kBackwardThreads * kStreamBackwardItems;
constexpr int kStreamBackwardBlocksPerSm = 2;

}  // namespace groupnorm
