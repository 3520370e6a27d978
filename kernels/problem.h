// One call's problem, described once: the shape and layout of the input, the
// alignment its vectors may assume, and the device's facts. Every planning
// rule reads this and nothing else.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "activation.h"
#include "device.h"

namespace groupnorm {

// The input's element type: dispatch.h maps torch's ScalarType to it, so
// that the kernel units, which include this header, need not parse torch's.
enum class Dtype : int8_t { Float, Double, Half, BFloat16 };

struct Problem {
  int64_t N, C, HxW;
  int G;
  bool channels_last;  // x is (N, HxW, C) in memory
  Dtype dtype;
  int64_t elem;    // bytes per element
  int64_t acc;     // bytes per accumulator (float, or double for double)
  uintptr_t addr;  // addresses the vectors must divide (x's, OR-ed with dy's in the backward)
  int device;
  const DeviceInfo* dev;
  // The forward applies an epilogue (epilogue.cuh); a backward: it is the fused forward's
  // (backward_epilogue.cuh), the passes or the registers kernel.
  bool epilogue = false;
  // The forward's activation chain is called, not inline (EpilogueArgs::inline_chain),
  // which the forward's registers kernel does not take; the fused backward takes it
  // back by the chain kernel first, then the passes unless the registers kernel is forced.
  bool called_chain = false;
  // The store kind of a fused forward's kernel (activation.h).
  Store store = Store::Bare;

  int64_t D() const { return C / G; }
  int64_t bytes() const { return N * C * HxW * elem; }  // of x
  bool larger_than_l2() const { return bytes() >= dev->l2_bytes; }
};

// The widest vector of at most max_bytes (elements a vector) that the
// address and every one of `multiples_of` allow.
inline int widest_vector(const Problem& p, std::initializer_list<int64_t> multiples_of,
                         int64_t max_bytes = 16) {
  for (int v = int(max_bytes / p.elem); v > 1; v /= 2) {
    bool ok = p.addr % (uintptr_t(v) * p.elem) == 0;
    for (int64_t m : multiples_of) ok = ok && m % v == 0;
    if (ok) return v;
  }
  return 1;
}

// Channels-last units may be blocks of whole groups of a sample; each keeps
// at least this many bytes of a row, so that reads stay coalesced.
constexpr int64_t kMinBlockRowBytes = 128;

// The most blocks of whole groups a channels-last row can be cut into with
// at least kMinBlockRowBytes each, stopping once the input holds max_units
// units (sample, block).
inline int group_blocks(const Problem& p, int64_t max_units) {
  int blocks = 1;
  for (int b = 2; b <= p.G && p.N * blocks < max_units; ++b) {
    if (p.G % b != 0) continue;
    if ((p.C / b) * p.elem < kMinBlockRowBytes) break;
    blocks = b;
  }
  return blocks;
}

}  // namespace groupnorm
