// Host side of the backward: checks, the choice between the four-launch
// backward and the stream kernel with its tiling (plan_backward, the one place
// that decides), and the launches on the current stream.
#include <ATen/ops/zeros.h>

#include "backward.cu"
#include "backward_stream.cu"
#include "backward_stream_channels_last.cu"
#include "forward_host.cu"

namespace groupnorm {

// A piece of a row is never cut below this many bytes of each input: smaller
// pieces add partial sums faster than they add parallelism.
constexpr int64_t kMinChunkBytes = 32 * 1024;
// Pieces per SM the tiling aims for when rows are few (about two waves of
// resident CTAs): enough to fill the GPU, few enough partials to add up.
constexpr int64_t kTilesPerSm = 16;
constexpr int64_t kMaxChunks = 1024;

struct BackwardPlan {
  bool channels_last = false;
  bool stream = false;  // one launch (backward_stream*.cu) instead of four
  int vec = 1;
  BackwardTiles tiles{};
  int64_t grid = 0;
  int64_t lag = 0;  // stream: tiles the sums run ahead of dx
  std::string why;
};

template <typename scalar_t>
const void* backward_stream_kernel(int vec, bool channels_last) {
  const void* kernel = nullptr;
  with_vec<scalar_t, 16>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    kernel = channels_last
                 ? reinterpret_cast<const void*>(
                       &groupnorm_backward_stream_channels_last_kernel<scalar_t, V>)
                 : reinterpret_cast<const void*>(&groupnorm_backward_stream_kernel<scalar_t, V>);
  });
  return kernel;
}

const void* backward_stream_kernel(c10::ScalarType dtype, int vec, bool channels_last) {
  const void* kernel = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "groupnorm_backward_plan", [&] {
    kernel = backward_stream_kernel<scalar_t>(vec, channels_last);
  });
  return kernel;
}

// Rows of a channels-last stream tile whose unit's row is `cols` vectors.
int64_t stream_rows_per_tile(int cols) {
  return int64_t(kBackwardThreads / cols) * kStreamBackwardItems;
}

// The stream backward, tiles and grid. Contiguous: rows cut into tiles of at
// most kStreamBackwardTileVecs vectors, a unit (sample, group) D rows.
// Channels-last: a unit is a sample or a block of `blocks` whole groups of it
// (p.vec divides C / G), cut into tiles of rows_per_step * kStreamBackwardItems
// rows. The grid is as many CTAs as are resident, and the sums run `lag`
// tiles ahead of dx: at least one unit's tiles (so that the order is
// deadlock-free), and enough tiles in flight (the grid's) that a dx item
// rarely waits, but no more: a longer lag leaves L2 less likely to hold a
// tile at its second read. Measured best on an H100 (benchmarks/README.md,
// run X), backward alone: contiguous, a unit plus half the resident CTAs, up to the larger of
// a unit and the resident CTAs (0.6-1.6 points of the floor above that
// larger one, which KernelBench L1-35's unit of 256 tiles keeps: a unit plus
// half the CTAs was 14 points slower there); channels-last, the larger of a
// unit and the resident CTAs (up to 2.8 points above a unit plus half).
void plan_backward_stream(BackwardPlan& p, const Shape& s, c10::ScalarType dtype, int device,
                          int64_t lag, int blocks) {
  BackwardTiles& t = p.tiles;
  const DeviceInfo& dev = device_info(device);
  p.stream = true;
  int64_t unit_tiles = 0;
  if (!s.channels_last) {
    t.rows = s.N * s.C;
    t.row_items = s.HxW / p.vec;
    t.chunks = (t.row_items + kStreamBackwardTileVecs - 1) / kStreamBackwardTileVecs;
    t.chunk = (t.row_items + t.chunks - 1) / t.chunks;
    t.tiles = t.rows * t.chunks;
    unit_tiles = (s.C / s.G) * t.chunks;
  } else {
    t.rows = s.N;
    t.row_items = s.HxW;
    t.cblocks = blocks;
    t.block_cols = int(s.C / blocks / p.vec);
    t.chunk = stream_rows_per_tile(t.block_cols);
    t.chunks = (s.HxW + t.chunk - 1) / t.chunk;
    t.tiles = s.N * blocks * t.chunks;
    unit_tiles = t.chunks;
  }
  const int64_t resident =
      int64_t(blocks_per_sm(backward_stream_kernel(dtype, p.vec, s.channels_last), device,
                            kBackwardThreads, 0)) *
      dev.sms;
  TORCH_CHECK(resident > 0, "groupnorm backward: the stream kernel does not fit on this device");
  p.grid = std::min({resident, 2 * t.tiles, kMaxGrid});
  const int64_t in_flight =
      s.channels_last ? p.grid : std::min(unit_tiles + p.grid / 2, std::max(unit_tiles, p.grid));
  p.lag = std::min(t.tiles, std::max(unit_tiles, lag > 0 ? lag : in_flight));
}

// Whether channels-last input at least as large as L2, planned as the stream
// backward (p), takes it by default: 16-byte vectors, tiles of at least
// 128 bytes of each channel (its pairs, 8 bytes a channel, stay within 1/16
// of the tile: a row of 256 vectors leaves tiles of 8 rows), and units of at
// most half as many tiles as the grid (the resident CTAs): at a lag of the
// grid, a unit's last sums item is then at least half of it ahead of its
// first dx item, which rarely waits. Measured on an H100
// (benchmarks/README.md, run X), backward alone: 57-72 % of the floor
// against 43-56 % for the four launches on units of 21-64 tiles; the video
// shape, 2x512x16x64x64 bf16 (units of 256 tiles, as many as the resident
// CTAs), was slower than the four launches at every lag (36-40 % against
// 48 %): its dx items waited at short lags and missed L2 at long ones.
bool auto_stream_channels_last(const BackwardPlan& p, const Shape& s) {
  return p.vec * int64_t(s.elem) == 16 && p.tiles.chunk * int64_t(s.elem) >= 128 &&
         2 * p.tiles.chunks <= p.grid;
}

// Contiguous input at least as large as L2, with 16-byte vectors and rows of
// whole tiles or more, takes the stream backward when dx is wanted, and so
// does channels-last input by auto_stream_channels_last; smaller inputs are
// read from L2 the second time anyway (the dx kernels walk the tiles in
// reverse). kernel: "auto", "passes" (the four launches) or "stream"; lag > 0
// forces the stream kernel's lag.
// addr: the addresses of x and dy OR-ed (both must allow the vector width).
BackwardPlan plan_backward(const Shape& s, c10::ScalarType dtype, uintptr_t addr, int device,
                           bool need_dx, const std::string& kernel, int64_t lag) {
  TORCH_CHECK_VALUE(kernel == "auto" || kernel == "passes" || kernel == "stream",
                    message("groupnorm backward: kernel must be \"auto\", \"passes\" or "
                            "\"stream\", got \"",
                            kernel, "\""));
  TORCH_CHECK_VALUE(lag >= 0, message("groupnorm backward: lag must be >= 0, got ", lag));
  TORCH_CHECK_VALUE(kernel != "stream" || need_dx,
                    "groupnorm backward: the stream kernel needs dx wanted");
  BackwardPlan p;
  p.channels_last = s.channels_last;
  BackwardTiles& t = p.tiles;
  const int64_t target = int64_t(device_info(device).sms) * kTilesPerSm;
  const bool large = s.bytes() >= device_info(device).l2_bytes;
  if (!s.channels_last) {
    p.vec = widest_vector(s.elem, addr, {s.HxW});
    const bool auto_stream = kernel == "auto" && need_dx && large &&
                             p.vec * int64_t(s.elem) == 16 &&
                             s.HxW / p.vec >= kStreamBackwardTileVecs;
    if (kernel == "stream" || auto_stream) {
      plan_backward_stream(p, s, dtype, device, lag, 1);
      p.why = kernel == "stream" ? "stream requested" : "input at least L2's size";
      return p;
    }
    t.rows = s.N * s.C;
    t.row_items = s.HxW / p.vec;
    if (t.row_items <= kWarpRowVecs) {
      t.warp_rows = 1;
      t.chunk = t.row_items;
      t.chunks = 1;
      t.tiles = (t.rows + kBackwardWarps - 1) / kBackwardWarps;
    } else {
      const int64_t min_chunk =
          std::max<int64_t>(kBackwardThreads, kMinChunkBytes / (p.vec * int64_t(s.elem)));
      const int64_t most = std::max<int64_t>(1, std::min(kMaxChunks, t.row_items / min_chunk));
      const int64_t want = std::min(most, std::max<int64_t>(1, (target + t.rows - 1) / t.rows));
      t.chunk = (t.row_items + want - 1) / want;
      t.chunks = (t.row_items + t.chunk - 1) / t.chunk;
      t.tiles = t.rows * t.chunks;
    }
  } else {
    // The stream kernel's vectors divide C / G (a thread's channels lie in
    // one group), with its units' blocks of whole groups as in the forward.
    const int stream_vec = widest_vector(s.elem, addr, {s.C, s.C / s.G});
    const int blocks = group_blocks(s, std::numeric_limits<int64_t>::max());
    const int64_t stream_cols = s.C / blocks / stream_vec;
    TORCH_CHECK_VALUE(kernel != "stream" || stream_cols <= kBackwardThreads,
                      message("groupnorm backward: the stream kernel for channels-last input "
                              "needs C / ",
                              blocks * stream_vec, " <= ", kBackwardThreads, ", got C = ", s.C,
                              " (kernel=\"passes\" takes any C)"));
    if (kernel == "stream" ||
        (kernel == "auto" && need_dx && large && stream_cols <= kBackwardThreads)) {
      BackwardPlan sp = p;
      sp.vec = stream_vec;
      plan_backward_stream(sp, s, dtype, device, lag, blocks);
      if (kernel == "stream" || auto_stream_channels_last(sp, s)) {
        sp.why = kernel == "stream" ? "stream requested"
                                    : "input at least L2's size, units of at most half the grid";
        return sp;
      }
    }
    p.vec = widest_vector(s.elem, addr, {s.C});
    const int64_t cols = s.C / p.vec;
    t.rows = s.N;
    t.row_items = s.HxW;
    t.block_cols = int(std::min<int64_t>(cols, kBackwardThreads));
    t.cblocks = int((cols + t.block_cols - 1) / t.block_cols);
    const int64_t trows = kBackwardThreads / t.block_cols;
    const int64_t row_bytes = int64_t(t.block_cols) * p.vec * int64_t(s.elem);
    const int64_t min_rows = std::max<int64_t>(trows, kMinChunkBytes / row_bytes);
    const int64_t most = std::max<int64_t>(1, std::min(kMaxChunks, s.HxW / min_rows));
    const int64_t per_sample = s.N * t.cblocks;
    const int64_t want =
        std::min(most, std::max<int64_t>(1, (target + per_sample - 1) / per_sample));
    t.chunk = (s.HxW + want - 1) / want;
    t.chunks = (s.HxW + t.chunk - 1) / t.chunk;
    t.tiles = s.N * t.chunks * t.cblocks;
  }
  p.grid = std::min(t.tiles, kMaxGrid);
  p.why = kernel == "passes" ? "passes requested" : "the default";
  return p;
}

std::string describe_backward_plan(const BackwardPlan& p) {
  const BackwardTiles& t = p.tiles;
  std::string text = std::string(p.stream ? "stream " : "passes ") +
                     (p.channels_last ? "channels_last" : "contiguous") +
                     " vec=" + std::to_string(p.vec) + " chunks=" + std::to_string(t.chunks) +
                     " chunk=" + std::to_string(t.chunk) + " tiles=" + std::to_string(t.tiles);
  if (p.stream) {
    if (p.channels_last) text += " blocks=" + std::to_string(t.cblocks);
    text += " grid=" + std::to_string(p.grid) + " lag=" + std::to_string(p.lag);
  } else if (p.channels_last) {
    text += " cblocks=" + std::to_string(t.cblocks) + " cols=" + std::to_string(t.block_cols);
  } else {
    text += t.warp_rows ? " (a warp per row)" : " (a CTA per chunk)";
  }
  return text + " (" + p.why + ")";
}

// The affine kernel: dgamma and dbeta from the per-sample affine pairs.
template <typename scalar_t>
void launch_backward_affine(const acc_t<scalar_t>* affine_pairs, scalar_t* dgamma, scalar_t* dbeta,
                            int64_t N, int C, cudaStream_t stream) {
  groupnorm_backward_affine_kernel<scalar_t>
      <<<unsigned((C + 255) / 256), 256, 0, stream>>>(affine_pairs, dgamma, dbeta, N, C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One allocation holds the counters (zeroed), the kernel's pairs and the
// affine partials; then the stream kernel and, for dgamma and dbeta, the
// affine kernel.
template <typename scalar_t>
void run_backward_stream(const BackwardPlan& p, const Shape& s, const scalar_t* dy,
                         const scalar_t* x, const acc_t<scalar_t>* mean,
                         const acc_t<scalar_t>* rstd, const scalar_t* gamma, scalar_t* dx,
                         scalar_t* dgamma, scalar_t* dbeta, const at::Tensor& like,
                         cudaStream_t stream) {
  using A = acc_t<scalar_t>;
  const BackwardTiles& t = p.tiles;
  const int64_t NC = s.N * s.C;
  const bool need_affine = dgamma != nullptr;
  const int64_t units = p.channels_last ? s.N * t.cblocks : s.N * s.G;
  const int64_t counters = stream_counter_bytes(units);
  // Contiguous: tile pairs [N, C, chunks]. Channels-last: group pairs
  // [N, chunks, G] and, for the affine partials, channel pairs [N, chunks, C].
  const int64_t tile_pairs =
      p.channels_last ? 2 * s.N * t.chunks * (s.G + (need_affine ? s.C : 0)) : 2 * NC * t.chunks;
  const int64_t bytes = counters + int64_t(sizeof(A)) * (tile_pairs + (need_affine ? 2 * NC : 0));
  at::Tensor storage = at::empty({bytes}, like.options().dtype(at::kByte));
  auto* base = storage.data_ptr<uint8_t>();
  C10_CUDA_CHECK(cudaMemsetAsync(base, 0, counters, stream));
  const StreamWorkspace ws = stream_workspace(base, units);
  A* pairs = reinterpret_cast<A*>(base + counters);
  A* affine_pairs = need_affine ? pairs + tile_pairs : nullptr;
  const StreamOrder order{t.tiles, p.lag};
  // L2 priorities on 16-byte loads (evict_last at the first read, evict_first
  // at the second): 2-17 points of the floor faster for float and bfloat16
  // on an H100 (benchmarks/README.md, run S).
  const bool l2_hints = p.vec * sizeof(scalar_t) == 16;
  with_vec<scalar_t, 16>(p.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (p.channels_last) {
      A* group_pairs = pairs;
      A* channel_pairs = need_affine ? pairs + 2 * s.N * t.chunks * s.G : nullptr;
      groupnorm_backward_stream_channels_last_kernel<scalar_t, V>
          <<<unsigned(p.grid), kBackwardThreads, 0, stream>>>(dy, x, mean, rstd, gamma, group_pairs,
                                                              channel_pairs, affine_pairs, dx, ws,
                                                              t, int(s.C), s.G, order, l2_hints);
    } else {
      groupnorm_backward_stream_kernel<scalar_t, V>
          <<<unsigned(p.grid), kBackwardThreads, 0, stream>>>(dy, x, mean, rstd, gamma, pairs,
                                                              affine_pairs, dx, ws, t, int(s.C),
                                                              s.G, order, l2_hints);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (need_affine)
    launch_backward_affine<scalar_t>(affine_pairs, dgamma, dbeta, s.N, int(s.C), stream);
}

template <typename scalar_t>
void run_backward(const BackwardPlan& p, const Shape& s, const scalar_t* dy, const scalar_t* x,
                  const acc_t<scalar_t>* mean, const acc_t<scalar_t>* rstd, const scalar_t* gamma,
                  scalar_t* dx, scalar_t* dgamma, scalar_t* dbeta, const at::Tensor& like,
                  cudaStream_t stream) {
  if (p.stream) {
    run_backward_stream<scalar_t>(p, s, dy, x, mean, rstd, gamma, dx, dgamma, dbeta, like, stream);
    return;
  }
  using A = acc_t<scalar_t>;
  const BackwardTiles& t = p.tiles;
  const int C = int(s.C), G = s.G, D = C / G;
  const int64_t NC = s.N * s.C;
  // One allocation for every temporary: chunk partials, the coefficient table
  // and the per-sample affine partials.
  const int64_t partial_count = 2 * NC * t.chunks;
  const bool need_affine = dgamma != nullptr;
  const int64_t bytes = int64_t(sizeof(Coef<A>)) * (dx ? NC : 0) +
                        int64_t(sizeof(A)) * (partial_count + (need_affine ? 2 * NC : 0));
  at::Tensor storage = at::empty({bytes}, like.options().dtype(at::kByte));
  auto* base = storage.data_ptr<uint8_t>();
  Coef<A>* coef = dx ? reinterpret_cast<Coef<A>*>(base) : nullptr;
  A* partial = reinterpret_cast<A*>(base + (dx ? NC * sizeof(Coef<A>) : 0));
  A* affine_pairs = need_affine ? partial + partial_count : nullptr;

  const unsigned grid = unsigned(p.grid);
  with_vec<scalar_t, 16>(p.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (p.channels_last) {
      groupnorm_backward_sums_channels_last_kernel<scalar_t, V>
          <<<grid, kBackwardThreads, 0, stream>>>(dy, x, mean, partial, t, C, D);
    } else {
      groupnorm_backward_sums_contiguous_kernel<scalar_t, V>
          <<<grid, kBackwardThreads, 0, stream>>>(dy, x, mean, partial, t, C, D);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const PartialLayout at{t.chunks, s.C * t.chunks, p.channels_last ? 1 : t.chunks,
                         p.channels_last ? s.C : 1};
  groupnorm_backward_coefficients_kernel<scalar_t>
      <<<unsigned(std::min(s.N * G, kMaxGrid)), kBackwardThreads, 0, stream>>>(
          partial, mean, rstd, gamma, affine_pairs, coef, s.N, C, G, s.HxW, at);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (need_affine) launch_backward_affine<scalar_t>(affine_pairs, dgamma, dbeta, s.N, C, stream);
  if (dx == nullptr) return;
  with_vec<scalar_t, 16>(p.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (p.channels_last) {
      groupnorm_backward_dx_channels_last_kernel<scalar_t, V>
          <<<grid, kBackwardThreads, 0, stream>>>(dy, x, coef, dx, t, C);
    } else {
      groupnorm_backward_dx_contiguous_kernel<scalar_t, V>
          <<<grid, kBackwardThreads, 0, stream>>>(dy, x, coef, dx, t);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace groupnorm

// Returns [dx, dweight, dbias]; each is an empty tensor when not asked for.
// dy may have any strides: when they differ from x's it is copied into x's
// layout first.
std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                                 int64_t groups, bool need_dx, bool need_affine,
                                 const std::string& kernel, int64_t lag) {
  using namespace groupnorm;
  Checked c = check_inputs(x, weight, c10::nullopt, groups, 0.0);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK_VALUE(dy.defined() && dy.sizes() == x.sizes(),
                    message("groupnorm backward: grad_output must have the input's shape ",
                            x.sizes(), ", got ", dy.defined() ? dy.sizes() : c10::IntArrayRef{}));
  TORCH_CHECK_TYPE(dy.scalar_type() == x.scalar_type(),
                   message("groupnorm backward: grad_output has dtype ", dy.scalar_type(),
                           " but input has dtype ", x.scalar_type()));
  TORCH_CHECK_VALUE(dy.device() == x.device(),
                    message("groupnorm backward: grad_output is on ", dy.device(),
                            " but input is on ", x.device()));
  const auto acc_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t N = c.shape.N, C = c.shape.C, HxW = c.shape.HxW;
  for (const at::Tensor* t : {&mean, &rstd}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == N && t->size(1) == groups &&
                          t->scalar_type() == acc_dtype && t->device() == x.device() &&
                          t->is_contiguous(),
                      message("groupnorm backward: mean and rstd must be contiguous [", N, ", ",
                              groups, "] ", c10::toString(acc_dtype), " tensors on ", x.device()));
  }
  if (!need_dx && !need_affine) {  // nothing to compute: no launch
    return {at::empty({0}, x.options()), at::empty({0}, x.options()), at::empty({0}, x.options())};
  }
  const at::Tensor& xk = c.x;
  at::Tensor dyk = dy;
  if (dy.strides() != xk.strides()) {
    dyk = at::empty_like(xk);
    dyk.copy_(dy);
  }
  at::Tensor dx = need_dx ? at::empty_like(xk) : at::empty({0}, x.options());
  const auto affine_options = x.options();
  at::Tensor dgamma = at::empty({0}, affine_options), dbeta = at::empty({0}, affine_options);
  if (need_affine) {
    dgamma = N * HxW == 0 ? at::zeros({C}, affine_options) : at::empty({C}, affine_options);
    dbeta = N * HxW == 0 ? at::zeros({C}, affine_options) : at::empty({C}, affine_options);
  }
  if (x.numel() == 0) return {dx, dgamma, dbeta};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const BackwardPlan p = plan_backward(c.shape, x.scalar_type(),
                                       c.shape.x_addr | reinterpret_cast<uintptr_t>(dyk.data_ptr()),
                                       x.device().index(), need_dx, kernel, lag);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "groupnorm_backward", [&] {
        using A = acc_t<scalar_t>;
        run_backward<scalar_t>(p, c.shape, dyk.data_ptr<scalar_t>(), xk.data_ptr<scalar_t>(),
                               mean.data_ptr<A>(), rstd.data_ptr<A>(),
                               c.gamma ? c.gamma->data_ptr<scalar_t>() : nullptr,
                               need_dx ? dx.data_ptr<scalar_t>() : nullptr,
                               need_affine ? dgamma.data_ptr<scalar_t>() : nullptr,
                               need_affine ? dbeta.data_ptr<scalar_t>() : nullptr, x, stream);
      });
  return {dx, dgamma, dbeta};
}

// The kernel and tiling backward() would use for an input like x (grad_output
// laid out and aligned as x, dx wanted), as text.
std::string backward_plan(const at::Tensor& x, int64_t groups, const std::string& kernel,
                          int64_t lag) {
  using namespace groupnorm;
  Checked c = check_inputs(x, c10::nullopt, c10::nullopt, groups, 0.0);
  if (x.numel() == 0) return "empty input: no launch";
  const c10::cuda::CUDAGuard guard(x.device());
  return describe_backward_plan(plan_backward(c.shape, x.scalar_type(), c.shape.x_addr,
                                              x.device().index(), true, kernel, lag));
}
