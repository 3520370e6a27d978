// Plans as data: which kernel runs for a problem, with a small config per
// kernel, chosen by choose_forward / choose_backward (the rule tables in
// plan_forward.cpp and plan_backward.cpp) and carried out by the launchers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "kernel_shapes.h"
#include "problem.h"

namespace groupnorm {

enum class ForwardKernel {
  Reference,           // one CTA per group, scalar accesses, any layout: the oracle
  Registers,           // one CTA (or a cluster) per group, held in registers
  Contiguous,          // team kernel, contiguous input: teams of CTAs keep slices on chip
  ChannelsLast,        // team kernel, channels-last input
  Stream,              // ticket-ordered stream, contiguous input larger than L2
  StreamChannelsLast,  // the same over channels-last rows
};

enum class BackwardKernel {
  Passes,              // four launches: sums, coefficients, affine, dx
  PassesChannelsLast,  // the same for channels-last input
  Stream,              // one ticket-ordered launch (and the affine kernel)
  StreamChannelsLast,
  Registers,           // one CTA per group, held in registers (and the affine kernel)
};

// What a caller may force: a kernel by name ("stream" takes the input's
// layout), CTAs per unit for the team kernels, the lag of the stream kernels.
struct Request {
  std::string kernel = "auto";
  int64_t team = 0;  // team kernels only; 0 = choose
  int64_t lag = 0;   // stream kernels only, in pieces; 0 = choose
  bool automatic() const { return kernel == "auto"; }
};

struct TeamConfig {       // Contiguous, ChannelsLast
  int team = 1;           // CTAs per unit
  int64_t slice = 0;      // items per CTA: vectors (contiguous) or rows (channels-last)
  int64_t kept = 0;       // items of the slice held in shared memory
  int blocks = 1;         // channels-last: units (blocks of whole groups) per sample
  int rows_per_step = 1;  // channels-last: rows a CTA sweeps side by side
};

struct StreamConfig {        // Stream, StreamChannelsLast
  int64_t pieces = 0;        // pieces per unit
  int64_t piece = 0;         // items per piece: vectors (contiguous) or rows (channels-last)
  int64_t lag = 0;           // pieces the statistics run ahead of the normalisation
  int64_t slots = 0;         // units whose piece statistics are kept at once
  bool each_merges = false;  // every normalise item merges its unit's partials
  int64_t chunk = 0;         // channels-last: pieces per first-level merge
  int blocks = 1;            // channels-last: units per sample
  int rows_per_step = 1;     // channels-last
};

struct RegistersConfig {  // Registers
  int items = 0;          // vectors a thread holds
  int ranks = 1;          // CTAs per group (a cluster when > 1)
};

struct ForwardPlan {
  ForwardKernel kernel = ForwardKernel::Reference;
  int vec = 1;        // elements per access
  int64_t units = 0;  // groups (sample, group), or channels-last units (sample, block)
  int64_t grid = 0;
  int threads = 0;
  size_t smem = 0;  // dynamic shared memory per CTA
  Store store = Store::Bare;  // the kernel's copy (activation.h); Any where it has none
  TeamConfig team;
  StreamConfig stream;
  RegistersConfig registers;
  std::string reason;
};

// Where the backward's tiles lie: shared by the kernels that walk them.
struct BackwardTiles {
  int64_t rows;       // contiguous: N * C rows; channels-last: N samples
  int64_t row_items;  // vectors per row (contiguous) or positions per sample
  int64_t chunk;      // items per chunk
  int64_t chunks;     // chunks per row
  int warp_rows;      // contiguous passes: 1 = one warp per row; 0 = one CTA per chunk
  int block_cols;     // channels-last: vector columns per CTA
  int cblocks;        // channels-last: column blocks (units, for the stream) per sample
  int64_t tiles;      // pieces of work
};

struct BackwardPlan {
  BackwardKernel kernel = BackwardKernel::Passes;
  int vec = 1;
  BackwardTiles tiles{};
  int64_t grid = 0;
  int threads = kBackwardThreads;
  size_t smem = 0;  // registers: the table of channel sums
  int64_t lag = 0;  // stream: tiles the sums run ahead of dx
  std::string reason;
};

ForwardPlan choose_forward(const Problem& p, const Request& req);
BackwardPlan choose_backward(const Problem& p, bool need_dx, const Request& req);

// A plan as (name, value) fields, for plan() in Python: the kernel's name,
// grid, block, its own config and the reason.
using PlanValue = std::variant<int64_t, bool, std::string>;
using PlanFields = std::vector<std::pair<std::string, PlanValue>>;
PlanFields describe(const ForwardPlan& plan, const Problem& p);
PlanFields describe(const BackwardPlan& plan, const Problem& p);

}  // namespace groupnorm
