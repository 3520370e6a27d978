// Host side of the forward: input checks, the choice of kernel for a shape
// (choose_plan, the one place that decides), and the launch on the current
// stream under a device guard. No host synchronisation; every temporary comes
// from PyTorch's caching allocator.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.cuh"
#include "forward_channels_last.cu"
#include "forward_contiguous.cu"
#include "forward_reference.cu"
#include "forward_registers.cu"
#include "forward_stream.cu"
#include "forward_stream_channels_last.cu"

namespace groupnorm {

// Error messages joined without iostreams: c10::str's ostringstream, built
// into a JIT extension, has crashed against the host's libstdc++.
inline std::string message_part(const std::string& s) { return s; }
inline std::string message_part(const char* s) { return s; }
inline std::string message_part(int v) { return std::to_string(v); }
inline std::string message_part(int64_t v) { return std::to_string(v); }
inline std::string message_part(size_t v) { return std::to_string(v); }
inline std::string message_part(double v) { return std::to_string(v); }
inline std::string message_part(c10::ScalarType t) { return c10::toString(t); }
inline std::string message_part(const c10::Device& d) { return d.str(); }
inline std::string message_part(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  ((out += message_part(parts)), ...);
  return out;
}

// ---------------------------------------------------------------------------
// Device facts, read once per device.
// ---------------------------------------------------------------------------
struct DeviceInfo {
  int sms = 0;
  int smem_per_sm = 0;     // bytes of shared memory per multiprocessor
  int smem_per_block = 0;  // opt-in maximum for one block
  int l2_bytes = 0;
  bool cooperative = false;  // co-resident launches (team barrier) allowed
  bool clusters = false;     // thread-block clusters (sm_90+)
};

const DeviceInfo& device_info(int device) {
  static std::mutex lock;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceInfo info;
  int coop = 0, clusters = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_sm,
                                        cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_block,
                                        cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
  info.cooperative = coop != 0;
  info.clusters = clusters != 0;
  return cache.emplace(device, info).first->second;
}

// Dynamic shared memory one block of `kernel` may ask for: the device's opt-in
// maximum less the kernel's static shared memory (asking for more than that
// makes cudaFuncSetAttribute fail). Cached: plans ask on every call.
size_t dynamic_smem_limit(const void* kernel, int device) {
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, size_t> cache;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_pair(kernel, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const size_t limit = size_t(device_info(device).smem_per_block) - attributes.sharedSizeBytes;
  return cache.emplace(key, limit).first->second;
}

// Blocks of `kernel` that fit on one SM with this many threads and bytes of
// dynamic shared memory; also raises the kernel's shared-memory limit to the
// device's opt-in maximum the first time it is seen on a device.
int blocks_per_sm(const void* kernel, int device, int threads, size_t smem) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(kernel, device, threads, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const auto limit_key = std::make_tuple(kernel, device, -1, size_t(0));
  if (cache.find(limit_key) == cache.end()) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(dynamic_smem_limit(kernel, device))));
    cache[limit_key] = 0;
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  cache[key] = blocks;
  return blocks;
}

// Clusters of `ranks` CTAs of `kernel` (with `threads` each) that the device
// can run at once; 0 when such a cluster cannot be scheduled, or when the
// kernel was built for an architecture without clusters (code for sm_80 runs
// on an sm_90 card, but its cluster code is compiled out). Cached: plans ask
// on every call.
int active_clusters(const void* kernel, int device, int threads, int ranks) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(kernel, device, threads, ranks);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  if (attributes.ptxVersion < 90) return cache.emplace(key, 0).first->second;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(ranks));
  config.blockDim = dim3(unsigned(threads));
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(ranks);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  return cache.emplace(key, clusters).first->second;
}

// ---------------------------------------------------------------------------
// The plan: which kernel runs for this shape, and why.
// ---------------------------------------------------------------------------
enum class Kernel { Reference, Contiguous, ChannelsLast, Stream, StreamChannelsLast, Registers };

struct Request {
  std::string kernel = "auto";  // "auto", "reference", "registers", "contiguous", "stream",
                                // "channels_last"
  int64_t team = 0;             // CTAs per unit (stream: its lag in pieces); 0 = choose
};

struct Shape {
  int64_t N, C, HxW;
  int G;
  bool channels_last;  // x is (N, HxW, C) in memory
  size_t elem;         // bytes per element
  uintptr_t x_addr;

  int64_t bytes() const { return N * C * HxW * int64_t(elem); }  // of x
};

struct Plan {
  Kernel kernel = Kernel::Reference;
  int vec = 1;       // elements per access
  int64_t kept = 0;  // items of the slice held on chip (all: one DRAM read of x)
  int threads = kReferenceThreads;
  int rows_per_step = 1;  // channels-last: rows in flight per sweep step
  // channels-last team and stream kernels: units (blocks of whole groups) per sample
  int blocks = 1;
  bool channels_last = false;  // registers kernel: x is (N, HxW, C)
  int items = 0;               // registers kernel: vectors a thread can hold (K)
  int ranks = 1;               // registers kernel: CTAs per group (a cluster when > 1)
  int64_t units = 0;           // groups (contiguous) or samples (channels-last)
  int64_t slice = 0;           // items per CTA: vectors (contiguous) or rows (channels-last)
  int team = 1;                // team kernels: CTAs per unit
  int64_t pieces = 0;          // stream: pieces per unit
  int64_t lag = 0;             // stream: pieces the statistics run ahead
  int64_t slots = 0;           // stream: units whose piece statistics are kept at once
  bool each_merges = false;    // stream: every normalise item merges its unit's partials
  int64_t chunk = 0;           // stream, channels-last: pieces per first-level merge
  int64_t grid = 0;
  size_t smem = 0;
  std::string why;
};

constexpr int64_t kMaxGrid = 1 << 30;
// A CTA's share of a unit is never cut below this: smaller slices spend more
// time in the team barrier than in moving bytes. 12 KiB: on an H200 every
// small SD UNet shape was fastest with slices of 10 or 20 KiB; 8 KiB made
// 2x1280x16x16 take 10 KiB slices, 18 % slower than 20 KiB, and 16 KiB made
// 8x1280x8x8 channels-last take 17 KiB, 11 % slower than 10 (benchmarks/README.md).
constexpr int64_t kMinSliceBytes = 12 * 1024;
// Resident CTAs per SM the on-chip budget is sized for: while one waits at its
// team barrier, the others keep the SM's memory pipe busy.
constexpr int kTargetBlocksPerSm = 4;
// Widest access per thread: 16 bytes for the contiguous kernel. The
// channels-last kernel keeps per-channel sums, shifts and affine terms in
// registers, which spill at 16 bytes (68 bytes a thread even with 128
// registers), so it uses 8 unless a row would need more than
// kChannelsLastMaxThreads threads: on an H100 16 bytes were 1-2 points of
// the floor slower on every channels-last team shape measured
// (benchmarks/README.md, run AD).
constexpr int kContiguousVecBytes = 16;
constexpr int kChannelsLastVecBytes = 8;
constexpr int kChannelsLastWideVecBytes = 16;

int widest_vector(size_t elem, uintptr_t addr, std::initializer_list<int64_t> multiples_of,
                  size_t max_bytes = 16) {
  for (int v = int(max_bytes / elem); v > 1; v /= 2) {
    bool ok = addr % (v * elem) == 0;
    for (int64_t m : multiples_of) ok = ok && m % v == 0;
    if (ok) return v;
  }
  return 1;
}

template <typename scalar_t, int V>
const void* contiguous_kernel() {
  return reinterpret_cast<const void*>(&groupnorm_forward_contiguous_kernel<scalar_t, V>);
}
// Either merge: both have the same launch bounds and shared memory, so the
// same residency, which plan_stream needs before it picks the merge.
template <typename scalar_t, int V>
const void* stream_kernel() {
  return reinterpret_cast<const void*>(&groupnorm_stream_kernel<scalar_t, V, false>);
}
template <typename scalar_t, int V>
const void* channels_last_kernel() {
  return reinterpret_cast<const void*>(&groupnorm_forward_channels_last_kernel<scalar_t, V>);
}
template <typename scalar_t, int V>
const void* stream_channels_last_kernel() {  // either merge: the same residency
  return reinterpret_cast<const void*>(&groupnorm_stream_channels_last_kernel<scalar_t, V, false>);
}

// Calls f(std::integral_constant<int, v>) for the vector widths a kernel is
// built for: up to kMaxBytes per access.
template <typename scalar_t, int kMaxBytes, typename F>
void with_vec(int v, F&& f) {
  constexpr int kMax = int(kMaxBytes / sizeof(scalar_t));
  switch (v) {
    case 8:
      if constexpr (kMax >= 8) {
        f(std::integral_constant<int, 8>{});
        return;
      }
      break;
    case 4:
      if constexpr (kMax >= 4) {
        f(std::integral_constant<int, 4>{});
        return;
      }
      break;
    case 2:
      if constexpr (kMax >= 2) {
        f(std::integral_constant<int, 2>{});
        return;
      }
      break;
    case 1:
      f(std::integral_constant<int, 1>{});
      return;
  }
  TORCH_CHECK(false, message("groupnorm: no kernel for vector width ", v));
}

// Splits `units` of `items` each (item = one vector or one row of `item_bytes`)
// over teams of CTAs. Sets team, slice, kept, grid and smem.
void plan_teams(Plan& p, const void* kernel, int device, int64_t items, size_t item_bytes,
                int stat_groups, int red_entries, size_t acc, const Request& req) {
  const DeviceInfo& dev = device_info(device);
  const size_t limit = dynamic_smem_limit(kernel, device);
  const size_t overhead = shared_bytes(0, red_entries, stat_groups, acc);
  TORCH_CHECK(overhead + 16 <= limit, message("groupnorm: ", stat_groups,
                                              " groups need more shared memory than a block has"));
  // shared_bytes() rounds the slice up to 16 bytes: stay under the limit after that.
  const int64_t most_items = int64_t((limit - overhead) / 16 * 16 / item_bytes);
  const int64_t min_items = std::max<int64_t>(1, kMinSliceBytes / int64_t(item_bytes));
  const auto smem_for = [&](int64_t kept_items) {
    return shared_bytes(kept_items * item_bytes, red_entries, stat_groups, acc);
  };
  const auto capacity = [&](int64_t kept_items) {
    return int64_t(blocks_per_sm(kernel, device, p.threads, smem_for(kept_items))) * dev.sms;
  };
  const int64_t max_team = dev.cooperative ? capacity(0) : 1;
  // Shared memory per CTA when kTargetBlocksPerSm share an SM (fewer, if
  // registers or threads already limit residency).
  const int resident =
      std::max<int>(1, std::min<int64_t>(kTargetBlocksPerSm, capacity(0) / dev.sms));
  const size_t per_sm = size_t(dev.smem_per_sm) / resident;
  const int64_t budget_items = std::min<int64_t>(
      per_sm > overhead + 1024 ? (per_sm - overhead - 1024) / item_bytes : 0, most_items);

  int64_t T, kept, teams = p.units;
  if (req.team > 0) {
    T = std::min<int64_t>(req.team, items);
    TORCH_CHECK(T <= max_team,
                message("groupnorm: a team of ", req.team,
                        " CTAs cannot be co-resident on this device (at most ", max_team, ")"));
    kept = std::min((items + T - 1) / T, most_items);
    while (T > 1 && kept > 0 && capacity(kept) < T) kept /= 2;
    p.why = "team forced to " + std::to_string(T);
  } else {
    // Every team does the same number of rounds (a ragged last round would
    // leave most of the grid idle): the fewest rounds that leave each team
    // t_fit CTAs, then as many CTAs per team as the grid holds while slices
    // stay above kMinSliceBytes.
    const int64_t t_fit = budget_items > 0 ? (items + budget_items - 1) / budget_items : items + 1;
    const int64_t cap =
        std::min(max_team, capacity(std::min(items, std::max<int64_t>(budget_items, 1))));
    if (t_fit <= cap) {
      const int64_t rounds = (p.units + cap / t_fit - 1) / (cap / t_fit);
      teams = (p.units + rounds - 1) / rounds;
      T = std::max(t_fit, std::min(cap / teams, std::max<int64_t>(1, items / min_items)));
      kept = (items + T - 1) / T;
      p.why =
          "on chip: " + std::to_string(teams) + " team(s), " + std::to_string(rounds) + " round(s)";
    } else {
      // A unit larger than the shared memory of every resident CTA together:
      // one team of all of them, each keeping its budget and re-reading the
      // rest of its slice (from L2, mostly: kept loads stream past it).
      teams = 1;
      T = std::max<int64_t>(1, std::min({max_team, capacity(budget_items), items}));
      kept = T == 1 ? most_items : budget_items;
      p.why = "unit larger than on-chip memory: partly re-read";
    }
  }
  p.slice = (items + T - 1) / T;
  p.team = int((items + p.slice - 1) / p.slice);  // no empty slices
  p.kept = std::min(p.slice, kept);
  p.smem = smem_for(p.kept);
  if (p.team == 1) {
    p.grid = std::min(p.units, kMaxGrid);
    TORCH_CHECK(capacity(p.kept) > 0, message("groupnorm: kernel does not fit on this device (",
                                              p.smem, " bytes of shared memory)"));
  } else {
    teams = std::min(teams, capacity(p.kept) / p.team);
    TORCH_CHECK(teams >= 1,
                message("groupnorm: a team of ", p.team, " CTAs cannot be co-resident"));
    p.grid = teams * p.team;
  }
}

// Name of a team or reference plan's kernel (describe_plan words the others).
const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::Contiguous:
      return "contiguous";
    case Kernel::ChannelsLast:
      return "channels_last";
    default:
      return "reference";
  }
}

// Groups of fewer pieces stay with the team kernel, which reads a small group
// once with one CTA and no atomics: the stream kernel was measured (and won)
// only with 8 pieces a group or more (benchmarks/README.md).
constexpr int64_t kStreamMinPieces = 8;

// One launch for units of `pieces` pieces of `piece_bytes` each: statistics
// `lag` pieces ahead of the normalisation (forward_stream.cu). The lag covers
// at least one unit, so that every statistics item of a unit comes before its
// normalise items, and the items in flight (one piece per resident CTA), so
// that a normalise item rarely waits; beyond that, a longer lag leaves L2
// less likely to hold a piece at its second read. Measured best
// (benchmarks/README.md): for contiguous pieces on an H100, the larger of a
// unit and the resident CTAs plus a quarter of the latter (the sum of the
// two, or a quarter of L2 more, was up to 2 points of the floor slower on
// KernelBench L1-35); for channels-last rows (`rows`) on an H200, a unit plus
// the larger of the resident CTAs and a quarter of L2 (a "front"), and on an
// H100 (run AC) a unit plus three fronts where a unit's partials are merged
// once: the two-level merge holds up the unit's first normalise items, and
// the longer lag was 1.2-2.8 points of the floor faster on all six such
// shapes measured (the video shape in channels-last: 55.0 -> 56.7 %), while
// one front stayed best where every normalise item merges (three fronts were
// 5-7 points slower on the two such shapes measured).
// The caller sets the kernel, threads, slice and shared memory.
void plan_stream(Plan& p, const void* kernel, int64_t pieces, int64_t piece_bytes, bool rows,
                 int fronts, int device, const Request& req) {
  const DeviceInfo& dev = device_info(device);
  const int64_t total = p.units * pieces;
  p.pieces = pieces;
  p.kept = 0;
  const int64_t resident = int64_t(blocks_per_sm(kernel, device, p.threads, p.smem)) * dev.sms;
  TORCH_CHECK(resident > 0, "groupnorm: the stream kernel does not fit on this device");
  p.grid = std::min({resident, 2 * total, kMaxGrid});
  const int64_t l2_pieces = int64_t(dev.l2_bytes) / 4 / piece_bytes;
  const int64_t lag = req.team > 0 ? req.team
                      : rows       ? pieces + fronts * std::max(resident, l2_pieces)
                                   : std::max(pieces, resident) + resident / 4;
  // lag >= pieces keeps the ticket order deadlock-free (stream_order.cuh).
  p.lag = std::min(total, std::max(pieces, lag));
  // Units between the normalising and the statistics front, and one more.
  p.slots = std::min(p.units, (p.lag + 2 * p.grid + pieces - 1) / pieces + 1);
}

// Partials (mean, M2 per group) of a channels-last stream piece may take at
// most this share of the piece's bytes: with more groups, the ring and the
// merges outweigh the gain, and the team kernel keeps them.
constexpr int64_t kMaxPartialShare = 16;

// The least bytes of a row that a block of whole channels-last groups keeps
// (the team kernel's and the stream kernel's units), so that its reads stay
// coalesced. 128 bytes, measured on an H100 against 64 and 256 for the team
// kernel (run P): 1x128x512x512 bf16 0.116 ms against 0.161 and 0.128 (0.142
// uncut), 2x320x64x64 f16 0.028 against 0.025 and 0.036 (0.029 uncut).
constexpr int64_t kMinBlockRowBytes = 128;

// The most blocks of whole groups a channels-last row can be cut into with
// at least kMinBlockRowBytes each, stopping once the input holds max_units
// units (sample, block).
int group_blocks(const Shape& s, int64_t max_units) {
  int blocks = 1;
  for (int b = 2; b <= s.G && s.N * blocks < max_units; ++b) {
    if (s.G % b != 0) continue;
    if ((s.C / b) * int64_t(s.elem) < kMinBlockRowBytes) break;
    blocks = b;
  }
  return blocks;
}

// The most the partials a channels-last normalise item merges itself may
// take, as a share of its piece's bytes (merge=each). Measured on an H100
// (benchmarks/README.md, run AB): with partials of 1/128-1/32 of a piece
// (float32, units of 16 pieces) "each" was 9-10 points of the floor faster
// than the two-level merge; with 1/4 or more (bfloat16, 128-512 pieces of
// 4 groups) 9-19 points slower, and slower still with narrower vectors.
constexpr int64_t kEachMergeShare = 8;

// Channels-last input of at least an eighth of L2, with 16-byte vectors,
// units (sample, block of groups) of kStreamMinPieces pieces or more and few
// enough groups takes the stream kernel over rows
// (forward_stream_channels_last.cu), before the registers and team kernels;
// `kernel="stream"` forces it for any shape whose unit's row fits one block.
// Why an eighth (benchmarks/README.md, run AC, H100): from 8 to 48 MiB, on
// units of 16 pieces or more, the stream beat the registers and team kernels
// by 1-23 points of the floor (16x256x64x64 bf16: 32 -> 54 %) except on two
// float32 shapes (2x256x64x64 and 4x256x64x64: 1.5 and 2.7 points slower);
// at 4 MiB it was 0.6 points slower, and on units of 1-2 pieces (the SD UNet
// deep blocks at larger batches) far slower, which kStreamMinPieces excludes.
// Blocks: as many as the groups allow with rows of at least
// kMinBlockRowBytes, the smallest units that still read whole 128-byte lines.
// Measured on an H100 (benchmarks/README.md, run U): 38-56 % of the floor
// without blocks, 44-62 % with them on the suite's shapes and others. A
// single sample needs at least two units, each at most a quarter of L2: with
// larger ones (1x128x512x512 bf16, two 32 MiB units) the stream read most of
// it twice and the team kernel, which keeps part of it on chip, was faster
// (38 against 36 %). Narrower vectors were twice as slow as the team kernel.
// Returns whether p is set.
template <typename scalar_t>
bool plan_stream_channels_last(Plan& p, const Shape& s, int device, const Request& req) {
  const bool forced = req.kernel == "stream";
  if (!s.channels_last || !(forced || (req.kernel == "auto" && req.team == 0))) return false;
  const int blocks = group_blocks(s, std::numeric_limits<int64_t>::max());
  const int64_t unit_C = s.C / blocks;
  const int G = s.G / blocks;  // per unit
  // V divides C / G: a thread's channels lie in one group.
  const int v = widest_vector(s.elem, s.x_addr, {s.C, s.C / s.G}, kContiguousVecBytes);
  const int64_t cols = unit_C / v;
  TORCH_CHECK_VALUE(!forced || cols <= kStreamThreads,
                    message("groupnorm: the stream kernel for channels-last input needs C / ",
                            blocks * v, " <= ", kStreamThreads, ", got C = ", s.C));
  if (cols > kStreamThreads) return false;
  const size_t acc = sizeof(acc_t<scalar_t>);
  const int rows_per_step = int(kStreamThreads / cols);
  const int64_t rows_per_piece = int64_t(rows_per_step) * kStreamItems;
  const void* kernel = nullptr;
  with_vec<scalar_t, kContiguousVecBytes>(
      v, [&](auto vv) { kernel = stream_channels_last_kernel<scalar_t, decltype(vv)::value>(); });
  const int64_t pieces = (s.HxW + rows_per_piece - 1) / rows_per_piece;
  const int64_t piece_bytes = rows_per_piece * unit_C * int64_t(s.elem);
  const int64_t bytes = s.bytes();
  const int64_t l2 = device_info(device).l2_bytes;
  const int64_t unit_bytes = bytes / (s.N * blocks);
  const bool chosen =
      forced || (8 * bytes >= l2 && s.N * blocks >= 2 && (s.N >= 2 || unit_bytes <= l2 / 4) &&
                 v * int64_t(s.elem) == 16 && pieces >= kStreamMinPieces &&
                 2 * G * int64_t(acc) * kMaxPartialShare <= piece_bytes);
  if (!chosen) return false;
  p.kernel = Kernel::StreamChannelsLast;
  p.vec = v;
  p.blocks = blocks;
  p.units = s.N * blocks;
  p.rows_per_step = rows_per_step;
  p.threads = int((cols * rows_per_step + kWarp - 1) / kWarp * kWarp);
  p.slice = rows_per_piece;
  p.smem = stream_rows_shared_bytes(rows_per_step, int(cols), G, acc);
  // Every normalise item merges its unit's piece partials itself when they
  // are at most kEachMergeShare of its piece's bytes (one chunk: its arrival
  // count is the unit's); else chunks of pieces are merged, then the chunks,
  // by the CTAs that complete them (forward_stream_channels_last.cu).
  p.each_merges = pieces * 2 * G * int64_t(acc) * kEachMergeShare <= piece_bytes;
  p.chunk = p.each_merges ? pieces : std::max<int64_t>(1, kChunkPartials / G);
  plan_stream(p, kernel, pieces, piece_bytes, true, p.each_merges ? 1 : 3, device, req);
  p.why = forced ? (req.team > 0 ? "stream requested, lag forced" : "stream requested")
                 : "input at least an eighth of L2's size";
  return true;
}

// Channels-last samples too small to give every CTA of the grid a unit of
// its own are cut into blocks of whole groups (forward_channels_last.cu):
// each unit then fits one CTA, with no team barrier (on an H100 the team
// kernel took 19-20 us on 8x1280x8x8 and 2x1280x16x16, twice the contiguous
// kernel on the same bytes: benchmarks/README.md, run O; those shapes now take
// the registers kernel). A block's row keeps at least kMinBlockRowBytes, so
// that its reads stay coalesced; blocks stop once there are two units per SM.
int channels_last_blocks(const Shape& s, int device) {
  return group_blocks(s, 2 * int64_t(device_info(device).sms));
}

template <typename scalar_t, int V, int K>
const void* registers_kernel() {
  return reinterpret_cast<const void*>(&groupnorm_forward_registers_kernel<scalar_t, V, K>);
}

// Groups of at most kRegistersMaxThreads * kRegistersManyItems vectors (128
// KiB with 16-byte vectors) take the registers kernel (forward_registers.cu):
// one CTA per group reads x once, with no team barrier, no workspace to clear
// and no shared slice. Threads are sized for about kRegistersFewItems vectors
// each: more threads put more loads in flight at once, which is what a
// latency-bound launch needs. Measured on an H100 against the team kernels
// (benchmarks/README.md, run P), faster on every group that fits: 8x1280x8x8
// bf16 0.0098 -> 0.0076 ms contiguous and 0.0127 -> 0.0082 channels-last,
// 4x512x64x64 f16 (128 KiB groups) 0.025 -> 0.022 and 0.034 -> 0.028.
// Inputs at least as large as L2 take it only in the few-items form on
// contiguous groups (512x1280x8x8 bf16: 0.142 -> 0.064 ms, 88 % of the
// floor): a channels-last group's rows are D channels of a C-wide row, and on
// that shape in channels-last those partial rows made it 0.169 ms against
// 0.137 for the team kernel, whose CTAs read whole rows; the many-items form
// runs one CTA per SM, unmeasured against the stream kernel there.
//
// Channels-last inputs of at least an eighth of L2 whose units the stream
// kernel takes never get here (choose_plan asks plan_stream_channels_last
// first).
//
// Larger groups, up to kRegistersMaxRanks * kRegistersMaxThreads *
// kRegistersManyItems vectors, can be shared by a cluster of `ranks` CTAs
// where the device has clusters: kRegistersClusterThreads threads each (two
// CTAs of 128 registers a thread fit an SM) while kRegistersMaxRanks of those
// suffice, kRegistersMaxThreads otherwise. The automatic plan takes clusters
// only for channels-last inputs of at most kRegistersClusterMaxBytes whose
// group rows hold at least kRegistersClusterMinRowBytes. Measured on an H100
// against the team kernels (run Q): 2x320x64x64 f16 (20-byte rows) 0.0213
// against 0.0284 ms, 1x256x128x128 f16 0.033 against 0.035. Slower with rows
// of 8 bytes (2x64x128x128 f32: 0.051 against 0.028) and on larger inputs
// (8x320x64x64 f16: 0.068 against 0.042; 2x640x64x64 f16: 0.036 against
// 0.031); from 14 % faster to 20 % slower on contiguous ones, where the team
// kernel reads whole slices; 1-19 % slower than the stream and team kernels
// on inputs at least as large as L2 (4x512x128x128 bf16, 128x64x126x126 f32,
// 16x256x16000 f32).
constexpr int kRegistersClusterThreads = 256;
constexpr int64_t kRegistersClusterMaxBytes = 8 << 20;
constexpr int64_t kRegistersClusterMinRowBytes = 16;

template <typename scalar_t>
bool plan_registers(Plan& p, const Shape& s, int device, const Request& req) {
  const bool forced = req.kernel == "registers";
  if (!forced && !(req.kernel == "auto" && req.team == 0)) return false;
  const int64_t D = s.C / s.G;
  const int64_t L = D * s.HxW;
  const int v = s.channels_last ? widest_vector(s.elem, s.x_addr, {s.C, D}, kContiguousVecBytes)
                                : widest_vector(s.elem, s.x_addr, {s.HxW}, kContiguousVecBytes);
  const int64_t vectors = L / v;
  const int64_t per_cta = int64_t(kRegistersMaxThreads) * kRegistersManyItems;
  const int64_t per_cluster = kRegistersMaxRanks * per_cta;
  const bool clusters = device_info(device).clusters;
  int threads = int(std::clamp<int64_t>(
      (vectors + kRegistersFewItems * kWarp - 1) / (kRegistersFewItems * kWarp) * kWarp, kWarp,
      kRegistersMaxThreads));
  int64_t ranks = 1;
  if (vectors > per_cta) {
    threads =
        vectors <= int64_t(kRegistersMaxRanks) * kRegistersClusterThreads * kRegistersManyItems
            ? kRegistersClusterThreads
            : kRegistersMaxThreads;
    ranks = (vectors + int64_t(threads) * kRegistersManyItems - 1) /
            (int64_t(threads) * kRegistersManyItems);
  }
  const bool fits = ranks == 1 || (clusters && ranks <= kRegistersMaxRanks);
  if (forced) {
    TORCH_CHECK(fits, message("groupnorm: the registers kernel holds at most ", per_cta,
                              " vectors per group in one CTA, or ", per_cluster,
                              " in a cluster of CTAs (sm_90 and later), got ", vectors, " of ", v,
                              " elements", clusters ? "" : " (no clusters on this device)"));
    TORCH_CHECK(req.team <= 1, "groupnorm: the registers kernel has no teams");
  } else if (!fits) {
    return false;
  }
  const int items = ranks > 1 || vectors > int64_t(threads) * kRegistersFewItems
                        ? kRegistersManyItems
                        : kRegistersFewItems;
  const bool large = s.bytes() >= device_info(device).l2_bytes;
  if (!forced && large && (s.channels_last || items != kRegistersFewItems)) return false;
  if (!forced && ranks > 1 &&
      !(s.channels_last && s.bytes() <= kRegistersClusterMaxBytes &&
        D * int64_t(s.elem) >= kRegistersClusterMinRowBytes)) {
    return false;
  }
  if (ranks > 1) {
    const void* k = nullptr;
    with_vec<scalar_t, kContiguousVecBytes>(v, [&](auto vv) {
      k = registers_kernel<scalar_t, decltype(vv)::value, kRegistersManyItems>();
    });
    const bool schedulable = active_clusters(k, device, threads, int(ranks)) > 0;
    TORCH_CHECK(schedulable || !forced,
                message("groupnorm: a cluster of ", ranks, " CTAs of ", threads,
                        " threads cannot be scheduled on this device (or the kernels were not "
                        "built for sm_90 or later)"));
    if (!schedulable) return false;
  }
  p.kernel = Kernel::Registers;
  p.channels_last = s.channels_last;
  p.vec = v;
  p.units = s.N * s.G;
  p.threads = threads;
  p.items = items;
  p.ranks = int(ranks);
  p.grid = std::min(p.units, kMaxGrid / ranks) * ranks;
  p.why = forced      ? "registers requested"
          : ranks > 1 ? "a group fits the registers of a cluster of CTAs"
                      : "a group fits one CTA's registers";
  return true;
}

// Which kernel runs for this shape, and why. Channels-last input of at least
// an eighth of L2 takes the stream kernel over rows first, on the terms of
// plan_stream_channels_last (16-byte vectors, units of blocks of groups);
// then groups that fit take the registers kernel (plan_registers). Other
// contiguous input takes the stream kernel when it is at least as large as
// L2 and its groups have kStreamMinPieces pieces or more (its second read of
// x then comes from L2 while the team kernel waits at team barriers; measured
// on an H200 in benchmarks/README.md), the contiguous team kernel otherwise;
// other channels-last input the channels-last team kernel, unless C is too
// wide for one thread per column (then the reference kernel, which reads any
// layout). The fast kernels use 16-byte accesses where the
// address, C/G and HxW allow, narrower ones otherwise.
template <typename scalar_t>
Plan choose_plan(const Shape& s, int device, const Request& req) {
  Plan p;
  const int64_t D = s.C / s.G;
  const size_t acc = sizeof(acc_t<scalar_t>);
  const bool want_ref = req.kernel == "reference";
  TORCH_CHECK_VALUE(want_ref || req.kernel == "auto" || req.kernel == "registers" ||
                        req.kernel == "contiguous" || req.kernel == "stream" ||
                        req.kernel == "channels_last",
                    message("groupnorm: unknown kernel '", req.kernel,
                            "' (expected auto, reference, registers, contiguous, stream or "
                            "channels_last)"));
  TORCH_CHECK_VALUE(
      s.channels_last ? req.kernel != "contiguous" : req.kernel != "channels_last",
      message("groupnorm: kernel '", req.kernel, "' does not match the input's layout (",
              s.channels_last ? "channels_last" : "contiguous", ")"));
  if (!want_ref && plan_stream_channels_last<scalar_t>(p, s, device, req)) return p;
  if (!want_ref && plan_registers<scalar_t>(p, s, device, req)) return p;
  if (!want_ref && !s.channels_last) {
    p.kernel = Kernel::Contiguous;
    p.vec = widest_vector(s.elem, s.x_addr, {s.HxW}, kContiguousVecBytes);  // one channel a vector
    p.units = s.N * s.G;
    const void* k = nullptr;
    with_vec<scalar_t, kContiguousVecBytes>(
        p.vec, [&](auto v) { k = contiguous_kernel<scalar_t, decltype(v)::value>(); });
    const int64_t items = D * s.HxW / p.vec;
    // Units of fewer vectors than a full block get the warps they fill: fewer
    // warps make each block reduction (the latency of a tiny launch) shorter.
    p.threads =
        int(std::clamp<int64_t>((items + kWarp - 1) / kWarp * kWarp, kWarp, kContiguousThreads));
    const int64_t piece_vecs = kStreamPieceVecs;
    const void* stream_k = nullptr;
    with_vec<scalar_t, kContiguousVecBytes>(
        p.vec, [&](auto v) { stream_k = stream_kernel<scalar_t, decltype(v)::value>(); });
    const bool auto_stream = req.kernel == "auto" && req.team == 0 &&
                             s.bytes() >= device_info(device).l2_bytes &&
                             items >= kStreamMinPieces * piece_vecs;
    if (req.kernel == "stream" || auto_stream) {
      p.kernel = Kernel::Stream;
      p.threads = kStreamThreads;
      p.slice = piece_vecs;
      p.smem = 0;
      const int64_t pieces = (items + piece_vecs - 1) / piece_vecs;
      plan_stream(p, stream_k, pieces, piece_vecs * int64_t(p.vec * s.elem), false, 1, device, req);
      // Every normalise item merges its unit's partials itself when fewer
      // than three quarters of the items in flight separate a unit's last
      // statistics item from its first normalise item: the completing CTA's
      // merge would often still be running (forward_stream.cu; the rule
      // picked the faster merge for 22 of 24 shape and lag pairs measured on
      // an H100, and lost at most 1.2 points of the floor on the other two).
      p.each_merges = 4 * (p.lag - pieces) < 3 * p.grid;
      p.why = auto_stream    ? "input at least L2's size"
              : req.team > 0 ? "stream requested, lag forced"
                             : "stream requested";
      return p;
    }
    plan_teams(p, k, device, items, p.vec * s.elem, 1, p.threads, acc, req);
    return p;
  }
  if (!want_ref) {
    const int blocks = channels_last_blocks(s, device);
    const int64_t C = s.C / blocks;  // a unit's channels
    int v = widest_vector(s.elem, s.x_addr, {s.C, C}, kChannelsLastVecBytes);
    if (C / v > kChannelsLastMaxThreads) {
      v = widest_vector(s.elem, s.x_addr, {s.C, C}, kChannelsLastWideVecBytes);
    }
    const int64_t cols = C / v;
    if (cols <= kChannelsLastMaxThreads) {
      p.kernel = Kernel::ChannelsLast;
      p.vec = v;
      p.blocks = blocks;
      p.rows_per_step = int(std::max<int64_t>(1, kContiguousThreads / cols));
      p.threads = int((cols * p.rows_per_step + kWarp - 1) / kWarp * kWarp);
      p.units = s.N * blocks;
      const void* k = nullptr;
      with_vec<scalar_t, kChannelsLastWideVecBytes>(
          p.vec, [&](auto v) { k = channels_last_kernel<scalar_t, decltype(v)::value>(); });
      plan_teams(p, k, device, s.HxW, C * s.elem, s.G / blocks, p.rows_per_step * int(C), acc, req);
      return p;
    }
    TORCH_CHECK(req.kernel != "channels_last",
                message("groupnorm: the channels_last kernel needs C / ", v,
                        " <= ", kChannelsLastMaxThreads, ", got C = ", s.C));
    p.why = "C too wide for one thread per column; ";
  }
  TORCH_CHECK(req.team <= 1, "groupnorm: the reference kernel has no teams");
  p.kernel = Kernel::Reference;
  p.units = s.N * s.G;
  p.grid = std::min(p.units, kMaxGrid);
  p.why += want_ref ? "reference kernel requested" : "reference kernel";
  return p;
}

std::string describe_plan(const Plan& p) {
  if (p.kernel == Kernel::Registers) {
    return std::string("registers ") + (p.channels_last ? "channels_last " : "") +
           "vec=" + std::to_string(p.vec) + " items=" + std::to_string(p.items) +
           (p.ranks > 1 ? " ranks=" + std::to_string(p.ranks) : "") +
           " grid=" + std::to_string(p.grid) + " threads=" + std::to_string(p.threads) + " (" +
           p.why + ")";
  }
  if (p.kernel == Kernel::Stream || p.kernel == Kernel::StreamChannelsLast) {
    const bool rows = p.kernel == Kernel::StreamChannelsLast;
    return std::string(rows ? "stream channels_last" : "stream") + " vec=" + std::to_string(p.vec) +
           (p.blocks > 1 ? " blocks=" + std::to_string(p.blocks) : "") +
           " pieces=" + std::to_string(p.pieces) + (rows ? " rows=" : " piece=") +
           std::to_string(p.slice) + (rows ? " chunk=" + std::to_string(p.chunk) : "") +
           " lag=" + std::to_string(p.lag) + " slots=" + std::to_string(p.slots) +
           (p.each_merges ? " merge=each" : " merge=once") + " grid=" + std::to_string(p.grid) +
           " (" + p.why + ")";
  }
  return std::string(kernel_name(p.kernel)) + " vec=" + std::to_string(p.vec) +
         (p.blocks > 1 ? " blocks=" + std::to_string(p.blocks) : "") +
         " team=" + std::to_string(p.team) + " kept=" + std::to_string(p.kept) + "/" +
         std::to_string(p.slice) + " grid=" + std::to_string(p.grid) +
         " threads=" + std::to_string(p.threads) + " smem=" + std::to_string(p.smem) + " (" +
         p.why + ")";
}

// ---------------------------------------------------------------------------
// Checks shared by every entry point. Errors name the problem and the values.
// ---------------------------------------------------------------------------
struct Checked {
  at::Tensor x;  // the tensor the kernel reads (a contiguous copy if x was neither layout)
  c10::optional<at::Tensor> gamma, beta;
  Shape shape;
};

bool is_channels_last_like(const at::Tensor& x) {
  // (N, C, *) whose memory order is N, *, C with no gaps: channels_last,
  // channels_last_3d, and the same for any number of trailing dims.
  if (x.dim() < 3) return false;
  const int64_t C = x.size(1);
  if (C != 1 && x.stride(1) != 1) return false;
  int64_t expected = C;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    if (x.size(d) != 1 && x.stride(d) != expected) return false;
    expected *= x.size(d);
  }
  return x.size(0) == 1 || x.stride(0) == expected;
}

c10::optional<at::Tensor> check_affine(const c10::optional<at::Tensor>& t, const char* name,
                                       const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return c10::nullopt;
  const int64_t C = x.size(1);
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == C,
                    message("groupnorm: ", name, " must have shape [", C,
                            "] (one value per channel), got ", t->sizes()));
  TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(),
                   message("groupnorm: ", name, " has dtype ", t->scalar_type(),
                           " but input has dtype ", x.scalar_type()));
  TORCH_CHECK_VALUE(t->device() == x.device(), message("groupnorm: ", name, " is on ", t->device(),
                                                       " but input is on ", x.device()));
  return t->contiguous();
}

Checked check_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& gamma,
                     const c10::optional<at::Tensor>& beta, int64_t groups, double eps) {
  TORCH_CHECK_VALUE(x.defined(), "groupnorm: input is undefined");
  TORCH_CHECK_VALUE(x.is_cuda(), message("groupnorm: input must be a CUDA tensor, got one on ",
                                         x.device(), " (group_norm() handles CPU tensors)"));
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
      message("groupnorm: input dtype must be float32, float16, bfloat16 or float64, got ", dtype));
  TORCH_CHECK_VALUE(x.dim() >= 2,
                    message("groupnorm: input must have shape (N, C, *), got ", x.sizes()));
  const int64_t C = x.size(1);
  TORCH_CHECK_VALUE(groups > 0, message("groupnorm: num_groups must be positive, got ", groups));
  TORCH_CHECK_VALUE(C % groups == 0, message("groupnorm: num_channels (", C,
                                             ") must be divisible by num_groups (", groups, ")"));
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0,
                    message("groupnorm: eps must be finite and >= 0, got ", eps));
  Checked c;
  c.gamma = check_affine(gamma, "weight", x);
  c.beta = check_affine(beta, "bias", x);
  const bool contiguous = x.is_contiguous();
  const bool channels_last = !contiguous && is_channels_last_like(x);
  c.x = contiguous || channels_last ? x : x.contiguous();
  int64_t HxW = 1;
  for (int64_t d = 2; d < x.dim(); ++d) HxW *= x.size(d);
  c.shape = Shape{x.size(0),
                  C,
                  HxW,
                  int(groups),
                  channels_last,
                  size_t(x.element_size()),
                  reinterpret_cast<uintptr_t>(c.x.data_ptr())};
  return c;
}

// ---------------------------------------------------------------------------
// Launch.
// ---------------------------------------------------------------------------
template <typename A>
TeamWorkspace<A> make_workspace(const Plan& p, int stat_groups, const at::Tensor& like,
                                at::Tensor& storage, cudaStream_t stream) {
  TeamWorkspace<A> ws{nullptr, nullptr, nullptr, nullptr};
  if (p.team == 1) return ws;
  const int64_t teams = p.grid / p.team;
  const int64_t counters = round_up_to_16(2 * teams * int64_t(sizeof(int)));
  const int64_t partial = teams * 2 * p.team * stat_groups * 2;
  const int64_t result = teams * 2 * stat_groups * 2;
  storage = at::empty({counters + (partial + result) * int64_t(sizeof(A))},
                      like.options().dtype(at::kByte));
  auto* base = storage.data_ptr<uint8_t>();
  C10_CUDA_CHECK(cudaMemsetAsync(base, 0, counters, stream));
  ws.arrived = reinterpret_cast<int*>(base);
  ws.published = ws.arrived + teams;
  ws.partial = reinterpret_cast<A*>(base + counters);
  ws.result = ws.partial + partial;
  return ws;
}

template <typename Kern, typename... Args>
void launch(const Plan& p, Kern kernel, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(p.grid));
  config.blockDim = dim3(unsigned(p.threads));
  config.dynamicSmemBytes = p.smem;
  config.stream = stream;
  // Teams wait on each other: every CTA must be resident at once, which a
  // cooperative launch guarantees (or refuses with an error, never a hang).
  cudaLaunchAttribute cooperative;
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = p.team > 1 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

template <typename scalar_t>
void run_forward(const Plan& p, const Checked& c, at::Tensor& y, at::Tensor& mean, at::Tensor& rstd,
                 double eps, cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const Shape& s = c.shape;
  const scalar_t* x = c.x.data_ptr<scalar_t>();
  const scalar_t* gamma = c.gamma ? c.gamma->data_ptr<scalar_t>() : nullptr;
  const scalar_t* beta = c.beta ? c.beta->data_ptr<scalar_t>() : nullptr;
  scalar_t* out = y.data_ptr<scalar_t>();
  A* mean_p = mean.data_ptr<A>();
  A* rstd_p = rstd.data_ptr<A>();
  const int D = int(s.C / s.G);
  at::Tensor storage;
  switch (p.kernel) {
    case Kernel::Contiguous: {
      const auto ws = make_workspace<A>(p, 1, y, storage, stream);
      const int64_t slice_elems = p.slice * p.vec;
      const bool fast_div = s.HxW + slice_elems < (int64_t(1) << 31);
      const FastDivider hxw_div(fast_div ? uint32_t(s.HxW) : 1u);
      with_vec<scalar_t, kContiguousVecBytes>(p.vec, [&](auto v) {
        launch(p, &groupnorm_forward_contiguous_kernel<scalar_t, decltype(v)::value>, stream, x,
               gamma, beta, out, mean_p, rstd_p, ws, p.units, int64_t(D) * s.HxW, s.HxW, s.G, D,
               p.team, slice_elems, p.kept, hxw_div, fast_div, A(eps));
      });
      break;
    }
    case Kernel::ChannelsLast: {
      const int unit_groups = s.G / p.blocks;
      const auto ws = make_workspace<A>(p, unit_groups, y, storage, stream);
      with_vec<scalar_t, kChannelsLastWideVecBytes>(p.vec, [&](auto v) {
        launch(p, &groupnorm_forward_channels_last_kernel<scalar_t, decltype(v)::value>, stream, x,
               gamma, beta, out, mean_p, rstd_p, ws, p.units, s.HxW, int(s.C), p.blocks,
               int(s.C / p.blocks), unit_groups, D, p.rows_per_step, p.team, p.slice, p.kept,
               A(eps));
      });
      break;
    }
    case Kernel::Stream: {
      const int64_t L = int64_t(D) * s.HxW;
      const int64_t total = p.units * p.pieces;
      const int64_t counters = stream_counter_bytes(p.units);
      storage = at::empty({counters + p.slots * p.pieces * 2 * int64_t(sizeof(A))},
                          y.options().dtype(at::kByte));
      auto* base = storage.data_ptr<uint8_t>();
      C10_CUDA_CHECK(cudaMemsetAsync(base, 0, counters, stream));
      const StreamWorkspace ws = stream_workspace(base, p.units);
      A* partial = reinterpret_cast<A*>(base + counters);
      const bool fast_div = L < (int64_t(1) << 31);
      const FastDivider hxw_div(fast_div ? uint32_t(s.HxW) : 1u);
      const StreamOrder order{total, p.lag};
      with_vec<scalar_t, kContiguousVecBytes>(p.vec, [&](auto v) {
        constexpr int V = decltype(v)::value;
        auto kernel = p.each_merges ? &groupnorm_stream_kernel<scalar_t, V, true>
                                    : &groupnorm_stream_kernel<scalar_t, V, false>;
        kernel<<<unsigned(p.grid), kStreamThreads, 0, stream>>>(
            x, gamma, beta, out, mean_p, rstd_p, partial, ws, L, s.HxW, s.G, D, p.pieces, p.slots,
            order, hxw_div, fast_div, A(eps));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      break;
    }
    case Kernel::StreamChannelsLast: {
      const int64_t pieces = p.pieces;
      const int64_t chunks = (pieces + p.chunk - 1) / p.chunk;
      const int64_t counters = stream_rows_counter_bytes(p.units, chunks);
      const int unit_groups = s.G / p.blocks;
      const int64_t partials = p.slots * (pieces + chunks) * unit_groups * 2;
      storage = at::empty({counters + partials * int64_t(sizeof(A))}, y.options().dtype(at::kByte));
      auto* base = storage.data_ptr<uint8_t>();
      C10_CUDA_CHECK(cudaMemsetAsync(base, 0, counters, stream));
      const StreamRowsWorkspace ws = stream_rows_workspace(base, p.units, chunks);
      A* piece_partial = reinterpret_cast<A*>(base + counters);
      A* chunk_partial = piece_partial + p.slots * pieces * unit_groups * 2;
      const StreamOrder order{p.units * pieces, p.lag};
      with_vec<scalar_t, kContiguousVecBytes>(p.vec, [&](auto v) {
        constexpr int V = decltype(v)::value;
        auto kernel = p.each_merges ? &groupnorm_stream_channels_last_kernel<scalar_t, V, true>
                                    : &groupnorm_stream_channels_last_kernel<scalar_t, V, false>;
        kernel<<<unsigned(p.grid), unsigned(p.threads), p.smem, stream>>>(
            x, gamma, beta, out, mean_p, rstd_p, piece_partial, chunk_partial, ws, s.HxW, int(s.C),
            p.blocks, unit_groups, D, p.rows_per_step, pieces, p.chunk, p.slots, order, A(eps));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      break;
    }
    case Kernel::Registers: {
      with_vec<scalar_t, kContiguousVecBytes>(p.vec, [&](auto v) {
        constexpr int V = decltype(v)::value;
        const auto kernel =
            p.items == kRegistersFewItems
                ? &groupnorm_forward_registers_kernel<scalar_t, V, kRegistersFewItems>
                : &groupnorm_forward_registers_kernel<scalar_t, V, kRegistersManyItems>;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(unsigned(p.grid));
        config.blockDim = dim3(unsigned(p.threads));
        config.stream = stream;
        cudaLaunchAttribute cluster;
        cluster.id = cudaLaunchAttributeClusterDimension;
        cluster.val.clusterDim.x = unsigned(p.ranks);
        cluster.val.clusterDim.y = 1;
        cluster.val.clusterDim.z = 1;
        config.attrs = &cluster;
        config.numAttrs = p.ranks > 1 ? 1 : 0;
        C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, x, gamma, beta, out, mean_p, rstd_p,
                                          p.units, int(s.HxW), s.C, s.G, D, s.channels_last,
                                          p.ranks, A(eps)));
      });
      break;
    }
    case Kernel::Reference: {
      const int64_t stride_n = s.C * s.HxW;
      const int64_t stride_c = s.channels_last ? 1 : s.HxW;
      const int64_t stride_s = s.channels_last ? s.C : 1;
      groupnorm_forward_reference_kernel<scalar_t>
          <<<unsigned(p.grid), kReferenceThreads, 0, stream>>>(x, gamma, beta, out, mean_p, rstd_p,
                                                               s.N, s.HxW, s.G, D, stride_n,
                                                               stride_c, stride_s, A(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    }
  }
}

}  // namespace groupnorm

// Returns [y, mean, rstd]; mean and rstd are [N, G] in the accumulation type
// (float, or double for double input). `kernel` and `team` force a path for
// tests and tuning: "auto" and 0 let choose_plan decide.
std::vector<at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                                const std::string& kernel, int64_t team) {
  using namespace groupnorm;
  Checked c = check_inputs(x, weight, bias, groups, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto acc_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // c.x is dense (contiguous or channels-last-like), so y gets its exact strides.
  at::Tensor y = at::empty_like(c.x);
  at::Tensor mean = at::empty({c.shape.N, groups}, x.options().dtype(acc_dtype));
  at::Tensor rstd = at::empty({c.shape.N, groups}, x.options().dtype(acc_dtype));
  if (x.numel() == 0) return {y, mean, rstd};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const Request req{kernel, team};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "groupnorm_forward", [&] {
        const Plan p = choose_plan<scalar_t>(c.shape, x.device().index(), req);
        run_forward<scalar_t>(p, c, y, mean, rstd, eps, stream);
      });
  return {y, mean, rstd};
}

// The plan forward() would run for these arguments, as text.
std::string plan(const at::Tensor& x, int64_t groups, const std::string& kernel, int64_t team) {
  using namespace groupnorm;
  Checked c = check_inputs(x, c10::nullopt, c10::nullopt, groups, 0.0);
  if (x.numel() == 0) return "empty input: no launch";
  const c10::cuda::CUDAGuard guard(x.device());
  std::string text;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "groupnorm_plan", [&] {
    text = describe_plan(choose_plan<scalar_t>(c.shape, x.device().index(), Request{kernel, team}));
  });
  return text;
}
