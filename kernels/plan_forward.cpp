// The forward's rule table: which kernel runs for a problem, and its config.
// choose_forward is the one place that decides; docs/DESIGN.md gives the
// measurements behind every rule and threshold.
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

#include "dispatch.h"
#include "kernel_shapes.h"
#include "launchers.h"
#include "message.h"
#include "plan.h"

namespace groupnorm {
namespace {

// Team kernels: a CTA's share of a unit is never cut below this (smaller
// slices spend more time in the team barrier than moving bytes).
constexpr int64_t kMinSliceBytes = 12 * 1024;
// Resident CTAs per SM the on-chip budget is sized for: while one waits at
// its team barrier, the others keep the SM's memory pipe busy.
constexpr int kTargetBlocksPerSm = 4;
// Channels-last team kernel: 8-byte columns, 16 only when a row needs more
// threads than a CTA has (its per-channel registers spill at 16).
constexpr int kChannelsLastVecBytes = 8;
// Stream kernels take units of at least this many pieces; smaller groups are
// read once by the team or registers kernels, with no atomics.
constexpr int64_t kStreamMinPieces = 8;
// Channels-last stream: input of at least 1/kStreamRowsMinL2Share of L2, and
// a single sample's units each at most 1/kStreamRowsMaxUnitL2Share of it
// (larger units are read twice from DRAM).
constexpr int64_t kStreamRowsMinL2Share = 2;
constexpr int64_t kStreamRowsMaxUnitL2Share = 4;
// Channels-last stream: a piece's partials take at most 1/kMaxPartialShare of
// its bytes (beyond that the ring and merges outweigh the gain), and every
// normalise item merges them itself while they take at most 1/kEachMergeShare.
constexpr int64_t kMaxPartialShare = 16;
constexpr int64_t kEachMergeShare = 8;
// Stream lag: the share of L2 a lag of pieces may fill ahead of the second
// read, and the fronts (the larger of the resident CTAs and that share) a
// channels-last lag spans when one CTA merges each unit.
constexpr int64_t kLagL2Share = 4;
constexpr int kRowsFrontsOnce = 3;
// Contiguous stream lag on cards with at least this much L2 (the H200's
// 60 MiB): the rows' one-front lag, not the shorter one measured on 50 MiB.
constexpr int64_t kLongLagMinL2Bytes = int64_t(60) << 20;
// Registers kernel in clusters: CTA size while 8 of them hold the group.
// Channels-last groups the team kernel serves faster than the registers
// kernel (team_over_registers): rows under kRegistersMinRowBytes on
// kTeamNarrowRowsUnitsPerSm units an SM in kTeamNarrowRowsMinBytes of input;
// groups of kTeamManyGroupsMinBytes in rows under kTeamManyGroupsMaxRowBytes
// on kTeamManyGroupsUnitsPerSm units an SM; the 16-vector form on more units
// than SMs; groups of kTeamLargeGroupBytes in rows of kRegistersMinRowBytes.
constexpr int kRegistersClusterThreads = 256;
constexpr int64_t kRegistersMinRowBytes = 16;
constexpr int64_t kTeamNarrowRowsUnitsPerSm = 2;
constexpr int64_t kTeamNarrowRowsMinBytes = 2 << 20;
constexpr int64_t kTeamManyGroupsUnitsPerSm = 6;
constexpr int64_t kTeamManyGroupsMinBytes = 12 << 10;
constexpr int64_t kTeamManyGroupsMaxRowBytes = 64;
constexpr int64_t kTeamLargeGroupBytes = 64 << 10;
// A call with an epilogue: the registers kernel only for groups of at most
// kRegistersFusedMaxVectors in one CTA (the activation's arithmetic on one
// SM outweighs the single read beyond), or for contiguous input in clusters
// of as many CTAs as the SMs hold for every unit at once, up to
// kRegistersFusedMaxRanks, each CTA with at most
// kRegistersFusedClusterVectors; and with at most kRegistersFusedSpreadUnits
// units an SM, threads for one vector each (its latency then needs threads,
// not loads in flight).
constexpr int64_t kRegistersFusedMaxVectors = 4096;
constexpr int64_t kRegistersFusedMaxRanks = 3;
constexpr int64_t kRegistersFusedClusterVectors = 3072;
constexpr int64_t kRegistersFusedSpreadUnits = 2;

ForwardPlan reference_plan(const Problem& p, std::string reason) {
  ForwardPlan plan;
  plan.kernel = ForwardKernel::Reference;
  plan.units = p.N * p.G;
  plan.threads = kReferenceThreads;
  plan.grid = std::min(plan.units, kMaxGrid);
  plan.reason = std::move(reason);
  return plan;
}

// Splits plan.units units of `items` items each (an item is one vector or
// one row of `item_bytes`) over teams of CTAs: the team config, grid and
// shared memory. forced_team > 0 sets the CTAs per unit.
void plan_teams(ForwardPlan& plan, const Problem& p, const void* kernel, int64_t items,
                size_t item_bytes, int stat_groups, int red_entries, int64_t forced_team) {
  const DeviceInfo& dev = *p.dev;
  TeamConfig& t = plan.team;
  const size_t limit = dynamic_smem_limit(kernel, p.device);
  const size_t overhead = team_shared_bytes(0, red_entries, stat_groups, p.acc);
  TORCH_CHECK(overhead + 16 <= limit, message("groupnorm: ", stat_groups,
                                              " groups need more shared memory than a block has"));
  // team_shared_bytes() rounds the slice up to 16 bytes: stay under the limit after that.
  const int64_t most_items = int64_t((limit - overhead) / 16 * 16 / item_bytes);
  const int64_t min_items = std::max<int64_t>(1, kMinSliceBytes / int64_t(item_bytes));
  const auto smem_for = [&](int64_t kept_items) {
    return team_shared_bytes(kept_items * item_bytes, red_entries, stat_groups, p.acc);
  };
  const auto capacity = [&](int64_t kept_items) {
    return int64_t(blocks_per_sm(kernel, p.device, plan.threads, smem_for(kept_items))) * dev.sms;
  };
  const int64_t max_team = dev.cooperative ? capacity(0) : 1;
  // Shared memory per CTA when kTargetBlocksPerSm share an SM (fewer, if
  // registers or threads already limit residency).
  const int resident =
      std::max<int>(1, std::min<int64_t>(kTargetBlocksPerSm, capacity(0) / dev.sms));
  const size_t per_sm = size_t(dev.smem_per_sm) / resident;
  const int64_t budget_items = std::min<int64_t>(
      per_sm > overhead + 1024 ? (per_sm - overhead - 1024) / item_bytes : 0, most_items);

  int64_t T, kept, teams = plan.units;
  if (forced_team > 0) {
    T = std::min<int64_t>(forced_team, items);
    TORCH_CHECK(T <= max_team,
                message("groupnorm: a team of ", forced_team,
                        " CTAs cannot be co-resident on this device (at most ", max_team, ")"));
    kept = std::min((items + T - 1) / T, most_items);
    while (T > 1 && kept > 0 && capacity(kept) < T) kept /= 2;
    plan.reason = "team forced to " + std::to_string(T);
  } else {
    // Every team does the same number of rounds (a ragged last round would
    // leave most of the grid idle): the fewest rounds that leave each team
    // t_fit CTAs, then as many CTAs per team as the grid holds while slices
    // stay above kMinSliceBytes.
    const int64_t t_fit = budget_items > 0 ? (items + budget_items - 1) / budget_items : items + 1;
    const int64_t cap =
        std::min(max_team, capacity(std::min(items, std::max<int64_t>(budget_items, 1))));
    if (t_fit <= cap) {
      const int64_t rounds = (plan.units + cap / t_fit - 1) / (cap / t_fit);
      teams = (plan.units + rounds - 1) / rounds;
      T = std::max(t_fit, std::min(cap / teams, std::max<int64_t>(1, items / min_items)));
      kept = (items + T - 1) / T;
      plan.reason =
          "on chip: " + std::to_string(teams) + " team(s), " + std::to_string(rounds) + " round(s)";
    } else {
      // A unit larger than the shared memory of every resident CTA together:
      // one team of all of them, each keeping its budget and re-reading the
      // rest of its slice (from L2, mostly).
      teams = 1;
      T = std::max<int64_t>(1, std::min({max_team, capacity(budget_items), items}));
      kept = T == 1 ? most_items : budget_items;
      plan.reason = "unit larger than on-chip memory: partly re-read";
    }
  }
  t.slice = (items + T - 1) / T;
  t.team = int((items + t.slice - 1) / t.slice);  // no empty slices
  t.kept = std::min(t.slice, kept);
  plan.smem = smem_for(t.kept);
  if (t.team == 1) {
    plan.grid = std::min(plan.units, kMaxGrid);
    TORCH_CHECK(capacity(t.kept) > 0, message("groupnorm: kernel does not fit on this device (",
                                              plan.smem, " bytes of shared memory)"));
  } else {
    teams = std::min(teams, capacity(t.kept) / t.team);
    TORCH_CHECK(teams >= 1,
                message("groupnorm: a team of ", t.team, " CTAs cannot be co-resident"));
    plan.grid = teams * t.team;
  }
}

ForwardPlan team_contiguous(const Problem& p, int64_t forced_team) {
  ForwardPlan plan;
  plan.kernel = ForwardKernel::Contiguous;
  plan.vec = widest_vector(p, {p.HxW});  // a vector lies in one channel
  plan.units = p.N * p.G;
  const int64_t items = p.D() * p.HxW / plan.vec;
  // Units of fewer vectors than a full block get the warps they fill: fewer
  // warps make each block reduction (the latency of a tiny launch) shorter.
  plan.threads =
      int(std::clamp<int64_t>((items + kWarp - 1) / kWarp * kWarp, kWarp, kContiguousThreads));
  const void* kernel = with_kernel_types(p, [&](auto tag, auto fused) {
    return team_kernel<typename decltype(tag)::type, fused>(false, plan.vec, p.store);
  });
  plan_teams(plan, p, kernel, items, plan.vec * p.elem, 1, plan.threads, forced_team);
  return plan;
}

// The channels-last team kernel, or nothing when C is too wide for one
// thread per column (an error when forced). Samples too small to give every
// CTA a unit are cut into blocks of whole groups, until there are two units
// per SM.
std::optional<ForwardPlan> team_channels_last(const Problem& p, bool forced, int64_t forced_team) {
  const int blocks = group_blocks(p, 2 * int64_t(p.dev->sms));
  const int64_t C = p.C / blocks;  // a unit's channels
  int v = widest_vector(p, {p.C, C}, kChannelsLastVecBytes);
  if (C / v > kChannelsLastMaxThreads) v = widest_vector(p, {p.C, C});
  const int64_t cols = C / v;
  TORCH_CHECK(!forced || cols <= kChannelsLastMaxThreads,
              message("groupnorm: the channels_last kernel needs C / ", v,
                      " <= ", kChannelsLastMaxThreads, ", got C = ", p.C));
  if (cols > kChannelsLastMaxThreads) return std::nullopt;
  ForwardPlan plan;
  plan.kernel = ForwardKernel::ChannelsLast;
  plan.vec = v;
  plan.team.blocks = blocks;
  plan.team.rows_per_step = int(std::max<int64_t>(1, kContiguousThreads / cols));
  plan.threads = int((cols * plan.team.rows_per_step + kWarp - 1) / kWarp * kWarp);
  plan.units = p.N * blocks;
  const void* kernel = with_kernel_types(p, [&](auto tag, auto fused) {
    return team_kernel<typename decltype(tag)::type, fused>(true, v, p.store);
  });
  plan_teams(plan, p, kernel, p.HxW, C * p.elem, p.G / blocks, plan.team.rows_per_step * int(C),
             forced_team);
  return plan;
}

// The grid and lag of a stream plan whose units have `pieces` pieces of
// `piece_bytes`: the lag covers at least one unit (deadlock-free order) and
// the items in flight; beyond that a longer lag leaves L2 less likely to hold
// a piece at its second read. `fronts`: the channels-last lag's multiple
// of the longer lag's span; 1 for contiguous input.
void plan_stream(ForwardPlan& plan, const Problem& p, const void* kernel, int64_t pieces,
                 int64_t piece_bytes, int fronts, int64_t forced_lag) {
  StreamConfig& s = plan.stream;
  const int64_t total = plan.units * pieces;
  s.pieces = pieces;
  const int64_t resident =
      int64_t(blocks_per_sm(kernel, p.device, plan.threads, plan.smem)) * p.dev->sms;
  TORCH_CHECK(resident > 0, "groupnorm: the stream kernel does not fit on this device");
  plan.grid = std::min({resident, 2 * total, kMaxGrid});
  const int64_t l2_pieces = int64_t(p.dev->l2_bytes) / kLagL2Share / piece_bytes;
  const bool rows = plan.kernel == ForwardKernel::StreamChannelsLast;
  const bool long_lag = rows || int64_t(p.dev->l2_bytes) >= kLongLagMinL2Bytes;
  const int64_t lag = forced_lag > 0 ? forced_lag
                      : long_lag     ? pieces + fronts * std::max(resident, l2_pieces)
                                     : std::max(pieces, resident) + resident / 4;
  s.lag = std::min(total, std::max(pieces, lag));  // lag >= pieces: deadlock-free
  // Units between the normalising and the statistics front, and one more.
  s.slots = std::min(plan.units, (s.lag + 2 * plan.grid + pieces - 1) / pieces + 1);
}

// Whether contiguous input takes the stream kernel by default: at least as
// large as L2 (its second read then comes from L2 while the team kernel
// waits at team barriers), in units of kStreamMinPieces pieces or more.
bool stream_contiguous_suits(const Problem& p) {
  const int64_t items = p.D() * p.HxW / widest_vector(p, {p.HxW});
  return p.larger_than_l2() && items >= kStreamMinPieces * kStreamPieceVecs;
}

ForwardPlan stream_contiguous(const Problem& p, int64_t forced_lag) {
  ForwardPlan plan;
  plan.kernel = ForwardKernel::Stream;
  plan.vec = widest_vector(p, {p.HxW});
  plan.units = p.N * p.G;
  plan.threads = kStreamThreads;
  plan.smem = 0;
  StreamConfig& s = plan.stream;
  s.piece = kStreamPieceVecs;
  const int64_t items = p.D() * p.HxW / plan.vec;
  const int64_t pieces = (items + s.piece - 1) / s.piece;
  const void* kernel = with_kernel_types(p, [&](auto tag, auto fused) {
    return stream_kernel<typename decltype(tag)::type, fused>(plan.vec, p.store);
  });
  plan_stream(plan, p, kernel, pieces, s.piece * plan.vec * p.elem, 1, forced_lag);
  // Every normalise item merges its unit's partials itself when fewer than
  // three quarters of the items in flight separate a unit's last statistics
  // item from its first normalise item: the completing CTA's merge would
  // often still be running.
  s.each_merges = 4 * (s.lag - pieces) < 3 * plan.grid;
  return plan;
}

// The channels-last stream kernel over rows, or nothing when it does not
// suit the problem (`forced`: whenever a unit's row fits one block).
std::optional<ForwardPlan> stream_channels_last(const Problem& p, bool forced, int64_t forced_lag) {
  const int blocks = group_blocks(p, std::numeric_limits<int64_t>::max());
  const int64_t unit_C = p.C / blocks;
  const int G = p.G / blocks;  // per unit
  const int v =
      widest_vector(p, {p.C, p.D()});  // V divides C / G: a thread's channels lie in one group
  const int64_t cols = unit_C / v;
  TORCH_CHECK_VALUE(!forced || cols <= kStreamThreads,
                    message("groupnorm: the stream kernel for channels-last input needs C / ",
                            blocks * v, " <= ", kStreamThreads, ", got C = ", p.C));
  if (cols > kStreamThreads) return std::nullopt;
  const int rows_per_step = int(kStreamThreads / cols);
  const int64_t rows_per_piece = int64_t(rows_per_step) * kStreamItems;
  const int64_t pieces = (p.HxW + rows_per_piece - 1) / rows_per_piece;
  const int64_t piece_bytes = rows_per_piece * unit_C * p.elem;
  const int64_t l2 = p.dev->l2_bytes;
  const int64_t unit_bytes = p.bytes() / (p.N * blocks);
  const bool suits = kStreamRowsMinL2Share * p.bytes() >= l2 && p.N * blocks >= 2 &&
                     (p.N >= 2 || unit_bytes <= l2 / kStreamRowsMaxUnitL2Share) &&
                     v * p.elem == 16 && pieces >= kStreamMinPieces &&
                     2 * G * p.acc * kMaxPartialShare <= piece_bytes;
  if (!forced && !suits) return std::nullopt;
  ForwardPlan plan;
  plan.kernel = ForwardKernel::StreamChannelsLast;
  plan.vec = v;
  plan.units = p.N * blocks;
  plan.threads = int((cols * rows_per_step + kWarp - 1) / kWarp * kWarp);
  plan.smem = stream_rows_shared_bytes(rows_per_step, int(cols), G, size_t(p.acc));
  StreamConfig& s = plan.stream;
  s.blocks = blocks;
  s.rows_per_step = rows_per_step;
  s.piece = rows_per_piece;
  // Every normalise item merges its unit's piece partials itself when they
  // are few next to its piece's bytes (one chunk); else chunks of pieces are
  // merged, then the chunks, by the CTAs that complete them.
  s.each_merges = pieces * 2 * G * p.acc * kEachMergeShare <= piece_bytes;
  s.chunk = s.each_merges ? pieces : std::max<int64_t>(1, kChunkPartials / G);
  const void* kernel = with_kernel_types(p, [&](auto tag, auto fused) {
    return stream_channels_last_kernel<typename decltype(tag)::type, fused>(v, p.store);
  });
  plan_stream(plan, p, kernel, pieces, piece_bytes, s.each_merges ? 1 : kRowsFrontsOnce,
              forced_lag);
  plan.reason = forced ? "stream requested" : "input at least half of L2's size";
  return plan;
}

// The registers kernel when a group fits one CTA's registers (or a
// cluster's), or nothing. Forced, a group that does not fit is an error;
// forced_ranks > 0 sets the CTAs a group (a cluster when above 1), each with
// threads for about kRegistersFewItems of its vectors (one, for a fused call
// on few units).
std::optional<ForwardPlan> registers(const Problem& p, bool forced, int64_t forced_ranks = 0) {
  const int64_t D = p.D();
  const int64_t L = D * p.HxW;
  const int v = p.channels_last ? widest_vector(p, {p.C, D}) : widest_vector(p, {p.HxW});
  const int64_t vectors = L / v;
  const int64_t per_cta = int64_t(kRegistersMaxThreads) * kRegistersManyItems;
  const int64_t per_cluster = kRegistersMaxRanks * per_cta;
  const bool clusters = p.dev->clusters;
  // Threads for about per_thread vectors each: kRegistersFewItems puts more
  // loads in flight at once, which a latency-bound launch needs; a fused call
  // on few units takes one (above).
  const int64_t per_thread =
      p.epilogue && p.N * p.G <= kRegistersFusedSpreadUnits * p.dev->sms ? 1 : kRegistersFewItems;
  const auto few_items_threads = [per_thread](int64_t n) {
    return int(std::clamp<int64_t>((n + per_thread * kWarp - 1) / (per_thread * kWarp) * kWarp,
                                   kWarp, kRegistersMaxThreads));
  };
  int threads = few_items_threads(vectors);
  int64_t ranks = 1;
  if (forced_ranks > 0) {
    TORCH_CHECK_VALUE(forced_ranks <= kRegistersMaxRanks,
                      message("groupnorm: the registers kernel takes at most ", kRegistersMaxRanks,
                              " CTAs a group (team=), got ", forced_ranks));
    ranks = forced_ranks;
    threads = few_items_threads((vectors + ranks - 1) / ranks);
  } else if (!forced && p.epilogue && !p.channels_last && vectors > kRegistersFusedMaxVectors) {
    ranks = std::min(kRegistersFusedMaxRanks, p.dev->sms / (p.N * p.G));
    if (ranks * kRegistersFusedClusterVectors < vectors) return std::nullopt;
    threads = few_items_threads((vectors + ranks - 1) / ranks);
  } else if (vectors > per_cta) {
    threads =
        vectors <= int64_t(kRegistersMaxRanks) * kRegistersClusterThreads * kRegistersManyItems
            ? kRegistersClusterThreads
            : kRegistersMaxThreads;
    ranks = (vectors + int64_t(threads) * kRegistersManyItems - 1) /
            (int64_t(threads) * kRegistersManyItems);
  }
  const bool fits = vectors <= ranks * int64_t(threads) * kRegistersManyItems &&
                    (ranks == 1 || (clusters && ranks <= kRegistersMaxRanks));
  TORCH_CHECK(fits || !forced,
              message("groupnorm: the registers kernel holds at most ", per_cta,
                      " vectors per group in one CTA, or ", per_cluster,
                      " in a cluster of CTAs (sm_90 and later), got ", vectors, " of ", v,
                      " elements", clusters ? "" : " (no clusters on this device)"));
  if (!fits) return std::nullopt;
  const int items = ranks > 1 || vectors > int64_t(threads) * kRegistersFewItems
                        ? kRegistersManyItems
                        : kRegistersFewItems;
  if (!forced) {
    // Inputs at least as large as L2 only in the few-items form on contiguous
    // groups; clusters only for a fused call on contiguous input (above).
    if (p.larger_than_l2() && (p.channels_last || items != kRegistersFewItems)) return std::nullopt;
    if (p.epilogue ? (vectors + ranks - 1) / ranks > kRegistersFusedMaxVectors ||
                         (ranks > 1 && p.channels_last)
                   : ranks > 1) {
      return std::nullopt;
    }
  }
  if (ranks > 1) {
    const void* kernel = with_kernel_types(p, [&](auto tag, auto fused) {
      return registers_kernel<typename decltype(tag)::type, kRegistersManyItems, fused>(v,
                                                                                  p.store);
    });
    const bool schedulable = active_clusters(kernel, p.device, threads, int(ranks)) > 0;
    TORCH_CHECK(schedulable || !forced,
                message("groupnorm: a cluster of ", ranks, " CTAs of ", threads,
                        " threads cannot be scheduled on this device (or the kernels were not "
                        "built for sm_90 or later)"));
    if (!schedulable) return std::nullopt;
  }
  ForwardPlan plan;
  plan.kernel = ForwardKernel::Registers;
  plan.vec = v;
  plan.units = p.N * p.G;
  plan.threads = threads;
  plan.registers.items = items;
  plan.registers.ranks = int(ranks);
  plan.grid = std::min(plan.units, kMaxGrid / ranks) * ranks;
  plan.reason = forced      ? "registers requested"
                : ranks > 1 ? "a group fits the registers of a cluster of CTAs"
                            : "a group fits one CTA's registers";
  return plan;
}

// Why the team kernel serves these channels-last groups faster than the
// registers kernel's `plan`, or "" where it does not:
// - rows narrower than kRegistersMinRowBytes, of which a warp's loads use a
//   fraction of each sector, on many units in enough input (smaller launches
//   are latency-bound, where the registers kernel's single pass wins);
// - many mid-size groups of narrow rows, half of each DRAM burst a CTA;
// - groups of 16 vectors a thread, one CTA an SM, in more than one wave;
// - large groups, each of which one SM pulls alone.
std::string team_over_registers(const Problem& p, const ForwardPlan& plan) {
  if (!p.channels_last) return "";
  const int64_t units = p.N * p.G;
  const int64_t group_bytes = p.bytes() / units;
  const int64_t row_bytes = p.D() * p.elem;
  if (row_bytes < kRegistersMinRowBytes && units >= kTeamNarrowRowsUnitsPerSm * p.dev->sms &&
      p.bytes() >= kTeamNarrowRowsMinBytes) {
    return "channels-last group rows narrower than 16 bytes on many units";
  }
  if (row_bytes < kTeamManyGroupsMaxRowBytes && units >= kTeamManyGroupsUnitsPerSm * p.dev->sms &&
      group_bytes >= kTeamManyGroupsMinBytes) {
    return "channels-last groups of at least 12 KiB in rows under 64 bytes, many an SM";
  }
  if (plan.registers.items == kRegistersManyItems && units > p.dev->sms) {
    return "channels-last groups of one registers CTA an SM, more than one wave";
  }
  if (group_bytes >= kTeamLargeGroupBytes && row_bytes >= kRegistersMinRowBytes) {
    return "channels-last groups of at least 64 KiB";
  }
  return "";
}

void check_request(const Problem& p, const Request& req) {
  const std::string& k = req.kernel;
  TORCH_CHECK_VALUE(k == "auto" || k == "reference" || k == "registers" || k == "contiguous" ||
                        k == "channels_last" || k == "stream",
                    message("groupnorm: unknown kernel '", k,
                            "' (expected auto, reference, registers, contiguous, channels_last or "
                            "stream)"));
  TORCH_CHECK_VALUE(p.channels_last ? k != "contiguous" : k != "channels_last",
                    message("groupnorm: kernel '", k, "' does not match the input's layout (",
                            p.channels_last ? "channels_last" : "contiguous", ")"));
  TORCH_CHECK_VALUE(
      req.team >= 0 && req.lag >= 0,
      message("groupnorm: team and lag must be >= 0, got team=", req.team, ", lag=", req.lag));
  TORCH_CHECK_VALUE(req.team == 0 || k == "contiguous" || k == "channels_last" || k == "registers",
                    message("groupnorm: team= sets the CTAs per unit of the team kernels "
                            "(kernel='contiguous' or 'channels_last') or the cluster of the "
                            "registers kernel, not of kernel '",
                            k, "'"));
  TORCH_CHECK_VALUE(req.lag == 0 || k == "stream",
                    message("groupnorm: lag= sets the stream kernels' lag (kernel='stream'), not "
                            "that of kernel '",
                            k, "'"));
  TORCH_CHECK_VALUE(!(p.called_chain && k == "registers"),
                    "groupnorm: the registers kernel takes no activation but SiLU or ReLU alone; "
                    "force another kernel, or none");
}

ForwardPlan choose_kernel(const Problem& p, const Request& req) {
  if (req.automatic()) {
    // First match wins.
    if (p.channels_last) {
      if (auto plan = stream_channels_last(p, false, 0)) return *plan;
    }
    // The registers kernel has no called activation chain: the call costs
    // registers (epilogue.cuh).
    if (!p.called_chain) {
      if (auto plan = registers(p, false)) {
        const std::string why = team_over_registers(p, *plan);
        if (why.empty()) return *plan;
        if (auto team = team_channels_last(p, false, 0)) {
          team->reason = why + "; " + team->reason;
          return *team;
        }
        return *plan;
      }
    }
    if (!p.channels_last) {
      if (stream_contiguous_suits(p)) {
        ForwardPlan plan = stream_contiguous(p, 0);
        plan.reason = "input at least L2's size";
        return plan;
      }
      return team_contiguous(p, 0);
    }
    if (auto plan = team_channels_last(p, false, 0)) return *plan;
    return reference_plan(p, "C too wide for one thread per column; reference kernel");
  }
  if (req.kernel == "reference") return reference_plan(p, "reference kernel requested");
  if (req.kernel == "registers") return *registers(p, true, req.team);
  if (req.kernel == "contiguous") return team_contiguous(p, req.team);
  if (req.kernel == "channels_last") return *team_channels_last(p, true, req.team);
  // "stream": the stream kernel of the input's layout.
  if (p.channels_last) {
    ForwardPlan plan = *stream_channels_last(p, true, req.lag);
    plan.reason = req.lag > 0 ? "stream requested, lag forced" : "stream requested";
    return plan;
  }
  ForwardPlan plan = stream_contiguous(p, req.lag);
  plan.reason = req.lag > 0 ? "stream requested, lag forced" : "stream requested";
  return plan;
}

}  // namespace

ForwardPlan choose_forward(const Problem& p, const Request& req) {
  check_request(p, req);
  ForwardPlan plan = choose_kernel(p, req);
  // The kernel's copy for the call's store kind, where it has one.
  const bool copies =
      plan.kernel != ForwardKernel::Reference &&
      has_store_copies(plan.kernel == ForwardKernel::ChannelsLast, plan.vec * p.elem, p.elem);
  plan.store = !p.epilogue ? Store::Bare : copies ? p.store : Store::Any;
  return plan;
}

namespace {
const char* name_of(ForwardKernel k) {
  switch (k) {
    case ForwardKernel::Reference:
      return "reference";
    case ForwardKernel::Registers:
      return "registers";
    case ForwardKernel::Contiguous:
      return "contiguous";
    case ForwardKernel::ChannelsLast:
      return "channels_last";
    default:
      return "stream";  // either layout: the name that forces it
  }
}

const char* name_of(Store s) {
  switch (s) {
    case Store::Bare:
      return "none";
    case Store::SiLU:
      return "silu";
    case Store::ReLU:
      return "relu";
    default:
      return "any";
  }
}
}  // namespace

PlanFields describe(const ForwardPlan& plan, const Problem& p) {
  PlanFields f = {{"kernel", std::string(name_of(plan.kernel))},
                  {"layout", std::string(p.channels_last ? "channels_last" : "contiguous")},
                  {"vec", int64_t(plan.vec)},
                  {"units", plan.units},
                  {"grid", plan.grid},
                  {"threads", int64_t(plan.threads)},
                  {"smem", int64_t(plan.smem)},
                  {"store", std::string(name_of(plan.store))}};
  switch (plan.kernel) {
    case ForwardKernel::Registers:
      f.push_back({"items", int64_t(plan.registers.items)});
      f.push_back({"ranks", int64_t(plan.registers.ranks)});
      break;
    case ForwardKernel::Contiguous:
    case ForwardKernel::ChannelsLast:
      f.push_back({"team", int64_t(plan.team.team)});
      f.push_back({"slice", plan.team.slice});
      f.push_back({"kept", plan.team.kept});
      f.push_back({"blocks", int64_t(plan.team.blocks)});
      break;
    case ForwardKernel::Stream:
    case ForwardKernel::StreamChannelsLast:
      f.push_back({"pieces", plan.stream.pieces});
      f.push_back({"piece", plan.stream.piece});
      f.push_back({"lag", plan.stream.lag});
      f.push_back({"slots", plan.stream.slots});
      f.push_back({"merge", std::string(plan.stream.each_merges ? "each" : "once")});
      f.push_back({"chunk", plan.stream.chunk});
      f.push_back({"blocks", int64_t(plan.stream.blocks)});
      break;
    default:
      break;
  }
  f.push_back({"reason", plan.reason});
  return f;
}

}  // namespace groupnorm
