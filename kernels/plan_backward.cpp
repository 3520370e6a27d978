// The backward's rule table: the one-launch registers kernel, the four-launch
// passes or the one-launch stream kernel, and their tiling. choose_backward
// is the one place that decides; docs/DESIGN.md gives the measurements
// behind every rule and threshold.
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>

#include "dispatch.h"
#include "kernel_shapes.h"
#include "launchers.h"
#include "message.h"
#include "plan.h"

namespace groupnorm {
namespace {

// A piece of a row is never cut below this many bytes of each input: smaller
// pieces add partial sums faster than they add parallelism.
constexpr int64_t kMinChunkBytes = 32 * 1024;
// Pieces per SM the passes aim for when rows are few (about two waves of
// resident CTAs): enough to fill the GPU, few enough partials to add up.
constexpr int64_t kTilesPerSm = 16;
constexpr int64_t kMaxChunks = 1024;
// Channels-last stream tiles hold at least this many bytes of each channel.
constexpr int64_t kMinStreamTileColumnBytes = 128;
// The stream backward's tiles, grid and lag. Contiguous: rows cut into tiles
// of at most kStreamBackwardTileVecs vectors, a unit (sample, group) D rows.
// Channels-last: a unit is a sample or a block of `blocks` whole groups of it
// (plan.vec divides C / G), cut into tiles of rows_per_step *
// kStreamBackwardItems rows. The sums run `lag` tiles ahead of dx: at least
// one unit's tiles (deadlock-free), and about the tiles in flight.
void plan_stream(BackwardPlan& plan, const Problem& p, int blocks, int64_t forced_lag) {
  BackwardTiles& t = plan.tiles;
  int64_t unit_tiles = 0;
  if (!p.channels_last) {
    plan.kernel = BackwardKernel::Stream;
    t.rows = p.N * p.C;
    t.row_items = p.HxW / plan.vec;
    t.chunks = (t.row_items + kStreamBackwardTileVecs - 1) / kStreamBackwardTileVecs;
    t.chunk = (t.row_items + t.chunks - 1) / t.chunks;
    t.tiles = t.rows * t.chunks;
    unit_tiles = p.D() * t.chunks;
  } else {
    plan.kernel = BackwardKernel::StreamChannelsLast;
    t.rows = p.N;
    t.row_items = p.HxW;
    t.cblocks = blocks;
    t.block_cols = int(p.C / blocks / plan.vec);
    t.chunk = int64_t(kBackwardThreads / t.block_cols) * kStreamBackwardItems;
    t.chunks = (p.HxW + t.chunk - 1) / t.chunk;
    t.tiles = p.N * blocks * t.chunks;
    unit_tiles = t.chunks;
  }
  // the plain backward's: the fused one has no stream kernel (choose_backward)
  const void* kernel = with_kernel_types(p, [&](auto tag, auto fused) -> const void* {
    if constexpr (!decltype(fused)::value) {
      return backward_stream_kernel<typename decltype(tag)::type>(p.channels_last, plan.vec);
    }
    return nullptr;
  });
  const int64_t resident =
      int64_t(blocks_per_sm(kernel, p.device, kBackwardThreads, 0)) * p.dev->sms;
  TORCH_CHECK(resident > 0, "groupnorm backward: the stream kernel does not fit on this device");
  plan.grid = std::min({resident, 2 * t.tiles, kMaxGrid});
  const int64_t in_flight =
      p.channels_last ? plan.grid
                      : std::min(unit_tiles + plan.grid / 2, std::max(unit_tiles, plan.grid));
  plan.lag = std::min(t.tiles, std::max(unit_tiles, forced_lag > 0 ? forced_lag : in_flight));
}

// Whether channels-last input, planned as the stream backward, takes it by
// default: 16-byte vectors, tiles of at least kMinStreamTileColumnBytes of
// each channel, and units of at most half as many tiles as the grid (a unit's
// last sums item is then at least half the grid ahead of its first dx item).
bool stream_channels_last_suits(const BackwardPlan& plan, const Problem& p) {
  return plan.vec * p.elem == 16 && plan.tiles.chunk * p.elem >= kMinStreamTileColumnBytes &&
         2 * plan.tiles.chunks <= plan.grid;
}

// The passes' vector width: the widest that `multiple` and the addresses
// allow; for the fused backward 16 bytes or else one element, the widths it
// is built for (with_passes_vec).
int passes_vector(const Problem& p, int64_t multiple) {
  const int v = widest_vector(p, {multiple});
  return p.epilogue && v * p.elem != 16 ? 1 : v;
}

BackwardPlan passes_contiguous(const Problem& p) {
  BackwardPlan plan;
  plan.kernel = BackwardKernel::Passes;
  plan.vec = passes_vector(p, p.HxW);
  BackwardTiles& t = plan.tiles;
  t.rows = p.N * p.C;
  t.row_items = p.HxW / plan.vec;
  if (t.row_items <= kWarpRowVecs) {
    t.warp_rows = 1;
    t.chunk = t.row_items;
    t.chunks = 1;
    t.tiles = (t.rows + kBackwardWarps - 1) / kBackwardWarps;
  } else {
    const int64_t target = int64_t(p.dev->sms) * kTilesPerSm;
    const int64_t min_chunk =
        std::max<int64_t>(kBackwardThreads, kMinChunkBytes / (plan.vec * p.elem));
    const int64_t most = std::max<int64_t>(1, std::min(kMaxChunks, t.row_items / min_chunk));
    const int64_t want = std::min(most, std::max<int64_t>(1, (target + t.rows - 1) / t.rows));
    t.chunk = (t.row_items + want - 1) / want;
    t.chunks = (t.row_items + t.chunk - 1) / t.chunk;
    t.tiles = t.rows * t.chunks;
  }
  plan.grid = std::min(t.tiles, kMaxGrid);
  return plan;
}

BackwardPlan passes_channels_last(const Problem& p) {
  BackwardPlan plan;
  plan.kernel = BackwardKernel::PassesChannelsLast;
  plan.vec = passes_vector(p, p.C);
  BackwardTiles& t = plan.tiles;
  const int64_t cols = p.C / plan.vec;
  t.rows = p.N;
  t.row_items = p.HxW;
  t.block_cols = int(std::min<int64_t>(cols, kBackwardThreads));
  t.cblocks = int((cols + t.block_cols - 1) / t.block_cols);
  const int64_t trows = kBackwardThreads / t.block_cols;
  const int64_t row_bytes = int64_t(t.block_cols) * plan.vec * p.elem;
  const int64_t min_rows = std::max<int64_t>(trows, kMinChunkBytes / row_bytes);
  const int64_t most = std::max<int64_t>(1, std::min(kMaxChunks, p.HxW / min_rows));
  const int64_t per_sample = p.N * t.cblocks;
  const int64_t target = int64_t(p.dev->sms) * kTilesPerSm;
  const int64_t want = std::min(most, std::max<int64_t>(1, (target + per_sample - 1) / per_sample));
  t.chunk = (p.HxW + want - 1) / want;
  t.chunks = (p.HxW + t.chunk - 1) / t.chunk;
  t.tiles = p.N * t.chunks * t.cblocks;
  plan.grid = std::min(t.tiles, kMaxGrid);
  return plan;
}

// The registers backward when a group fits one CTA: at most
// kBackwardRegistersItems vectors of each input a thread, at most
// kBackwardRegistersMaxThreads threads (the fused kernel's recompute:
// kFusedBackwardRegistersMaxThreads, and 16-byte vectors, the one width it
// is built for), for channels-last input a multiple of a row's D / vec
// vectors (a thread keeps one column), and a table of channel sums (three
// an entry for the fused kernel, two for the plain one) that with the
// kernel's static scratch (two sums a warp) stays within
// kBackwardRegistersSharedBytes; on few units an SM, more threads of fewer
// vectors (below). Forced, a group that does not fit is an error.
std::optional<BackwardPlan> registers_backward(const Problem& p, bool forced) {
  BackwardPlan plan;
  plan.kernel = BackwardKernel::Registers;
  const int64_t D = p.D();
  plan.vec = p.channels_last ? widest_vector(p, {p.C, D}) : widest_vector(p, {p.HxW});
  const int64_t most_threads =
      p.epilogue ? kFusedBackwardRegistersMaxThreads : kBackwardRegistersMaxThreads;
  const int64_t vectors = D * p.HxW / plan.vec;
  const int64_t multiple = p.channels_last ? std::lcm<int64_t>(kWarp, D / plan.vec) : kWarp;
  const auto round_up = [multiple](int64_t n) {
    return std::max<int64_t>(1, (n + multiple - 1) / multiple) * multiple;
  };
  const int64_t sums = p.epilogue ? 3 : 2;
  const int64_t scratch = 2 * (most_threads / kWarp) * p.acc;
  // Threads for kBackwardRegistersItems vectors each, the fewest that hold
  // the group; on few units an SM, threads for one vector each (their
  // latency needs warps) while every unit's CTA fits the card at once
  // (most_threads fill an SM's registers) and, channels-last, the table
  // fits (an entry a thread's lane): for the fused kernel, and for the plain
  // one where its block would have fewer than kBackwardRegistersSpreadBelow.
  int64_t threads = round_up((vectors + kBackwardRegistersItems - 1) / kBackwardRegistersItems);
  const int64_t units_per_sm = (p.N * p.G + p.dev->sms - 1) / p.dev->sms;
  if (units_per_sm <= kBackwardRegistersSpreadUnits &&
      (p.epilogue || threads < kBackwardRegistersSpreadBelow)) {
    int64_t most = most_threads / units_per_sm;
    if (p.channels_last) {
      most = std::min(most, (kBackwardRegistersSharedBytes - scratch) / (plan.vec * sums * p.acc));
    }
    threads = std::max(threads, std::min(round_up(vectors), most / multiple * multiple));
  }
  const int64_t entries = p.channels_last ? threads * plan.vec : vectors;
  const int64_t table = entries * sums * p.acc;
  const bool wide = !p.epilogue || plan.vec * p.elem == 16;
  TORCH_CHECK_VALUE(
      wide || !forced,
      message("groupnorm backward: the fused registers kernel takes 16-byte vectors; "
              "this input allows ",
              plan.vec, " elements of ", p.elem, " bytes (kernel=\"passes\" takes any input)"));
  const bool fits =
      wide && threads <= most_threads && table + scratch <= kBackwardRegistersSharedBytes;
  TORCH_CHECK_VALUE(
      fits || !forced,
      message("groupnorm backward: the ", p.epilogue ? "fused " : "",
              "registers kernel holds a group in one CTA of at most ", most_threads, " threads, ",
              kBackwardRegistersItems, " vectors a thread, with a table and scratch of at most ",
              kBackwardRegistersSharedBytes, " bytes; this group of ", vectors, " vectors of ",
              plan.vec, " elements needs ", threads, " threads and ", table + scratch,
              " bytes (kernel=\"passes\" takes any group)"));
  if (!fits) return std::nullopt;
  BackwardTiles& t = plan.tiles;
  t.rows = p.N * p.G;
  t.tiles = t.rows;
  t.row_items = vectors;
  t.chunk = vectors;
  t.chunks = 1;
  plan.threads = int(threads);
  plan.smem = size_t(table);
  plan.grid = std::min(t.tiles, kMaxGrid);
  plan.reason = forced ? "registers requested" : "input smaller than L2, a group fits one CTA";
  return plan;
}

}  // namespace

// The registers backward, plain or fused (p.epilogue) with SiLU or ReLU
// alone or no activation, when the input is smaller than L2 and a group fits
// one CTA (registers_backward); after the chain kernel (p.called_chain) it
// was no faster than the passes (DESIGN.md), which it then leaves. The stream
// backward when dx is wanted and the input is at least as large as L2
// (smaller inputs are read from L2 the second time anyway: the dx kernels
// walk the tiles in reverse): contiguous input with 16-byte vectors and rows
// of whole tiles or more; channels-last input when its units' row fits a
// block and stream_channels_last_suits; never for the fused backward. The
// passes otherwise.
BackwardPlan choose_backward(const Problem& p, bool need_dx, const Request& req) {
  const std::string& k = req.kernel;
  TORCH_CHECK_VALUE(k == "auto" || k == "passes" || k == "stream" || k == "registers",
                    message("groupnorm backward: kernel must be \"auto\", \"passes\", "
                            "\"stream\" or \"registers\", got \"",
                            k, "\""));
  TORCH_CHECK_VALUE(req.lag >= 0, message("groupnorm backward: lag must be >= 0, got ", req.lag));
  TORCH_CHECK_VALUE(req.team == 0,
                    "groupnorm backward: team= applies to the forward's team kernels");
  TORCH_CHECK_VALUE(req.lag == 0 || k == "stream",
                    "groupnorm backward: lag= sets the stream kernel's lag (kernel='stream')");
  TORCH_CHECK_VALUE(k != "stream" || need_dx,
                    "groupnorm backward: the stream kernel needs dx wanted");
  TORCH_CHECK_VALUE(k != "stream" || !p.epilogue,
                    "groupnorm backward: the fused backward has no stream kernel");
  if (k == "registers" || (k == "auto" && !p.larger_than_l2() && !p.called_chain)) {
    if (auto plan = registers_backward(p, k == "registers")) return *plan;
  }
  const bool automatic = k == "auto" && need_dx && p.larger_than_l2() && !p.epilogue;
  if (!p.channels_last) {
    BackwardPlan plan;
    plan.vec = widest_vector(p, {p.HxW});
    if (k == "stream" ||
        (automatic && plan.vec * p.elem == 16 && p.HxW / plan.vec >= kStreamBackwardTileVecs)) {
      plan_stream(plan, p, 1, req.lag);
      plan.reason = k == "stream" ? "stream requested" : "input at least L2's size";
      return plan;
    }
  } else {
    // The stream kernel's vectors divide C / G (a thread's channels lie in
    // one group), with its units' blocks of whole groups as in the forward.
    BackwardPlan plan;
    plan.vec = widest_vector(p, {p.C, p.D()});
    const int blocks = group_blocks(p, std::numeric_limits<int64_t>::max());
    const int64_t cols = p.C / blocks / plan.vec;
    TORCH_CHECK_VALUE(k != "stream" || cols <= kBackwardThreads,
                      message("groupnorm backward: the stream kernel for channels-last input "
                              "needs C / ",
                              blocks * plan.vec, " <= ", kBackwardThreads, ", got C = ", p.C,
                              " (kernel=\"passes\" takes any C)"));
    if (k == "stream" || (automatic && cols <= kBackwardThreads)) {
      plan_stream(plan, p, blocks, req.lag);
      if (k == "stream" || stream_channels_last_suits(plan, p)) {
        plan.reason = k == "stream" ? "stream requested"
                                    : "input at least L2's size, units of at most half the grid";
        return plan;
      }
    }
  }
  BackwardPlan plan = p.channels_last ? passes_channels_last(p) : passes_contiguous(p);
  plan.reason = k == "passes" ? "passes requested"
                : p.epilogue && p.called_chain && !p.larger_than_l2()
                    ? "the fused backward after the chain kernel"
                : p.epilogue ? "the fused backward: no registers plan, no stream kernel"
                             : "the default";
  return plan;
}

PlanFields describe(const BackwardPlan& plan, const Problem& p) {
  const BackwardTiles& t = plan.tiles;
  const bool stream =
      plan.kernel == BackwardKernel::Stream || plan.kernel == BackwardKernel::StreamChannelsLast;
  const bool registers = plan.kernel == BackwardKernel::Registers;
  PlanFields f = {{"kernel", std::string(registers ? "registers"
                                         : stream  ? "stream"
                                                   : "passes")},
                  {"layout", std::string(p.channels_last ? "channels_last" : "contiguous")},
                  {"vec", int64_t(plan.vec)},
                  {"grid", plan.grid},
                  {"threads", int64_t(plan.threads)},
                  {"tiles", t.tiles},
                  {"chunks", t.chunks},
                  {"chunk", t.chunk}};
  if (stream) f.push_back({"lag", plan.lag});
  if (registers) {
    f.push_back({"smem", int64_t(plan.smem)});
  } else if (p.channels_last) {
    f.push_back({"blocks", int64_t(t.cblocks)});
    f.push_back({"block_cols", int64_t(t.block_cols)});
  } else if (!stream) {
    f.push_back({"warp_rows", bool(t.warp_rows)});
  }
  f.push_back({"reason", plan.reason});
  return f;
}

}  // namespace groupnorm
