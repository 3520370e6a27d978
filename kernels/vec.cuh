// Element types and memory access shared by every kernel: accumulation
// types, vectors of up to 16 bytes, streaming stores, asynchronous copies to
// shared memory, L2 priorities and loads with several vectors in flight.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernel_shapes.h"

namespace groupnorm {

// Statistics are accumulated in float for half, bfloat16 and float, in double
// for double, as PyTorch's acc_type does.
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

// V consecutive elements moved as one access of V * sizeof(T) bytes (at most
// 16). Callers guarantee the alignment; the host checks it before picking V.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T val[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

// Output is written once and not read again by this kernel: evict-first keeps
// L2 for the input.
template <typename T, int V>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T, V>& v) {
  if constexpr (sizeof(T) * V == 16) {
    __stcs(reinterpret_cast<float4*>(p), *reinterpret_cast<const float4*>(&v));
  } else if constexpr (sizeof(T) * V == 8) {
    __stcs(reinterpret_cast<float2*>(p), *reinterpret_cast<const float2*>(&v));
  } else {
    *reinterpret_cast<Vec<T, V>*>(p) = v;
  }
}

// Bytes of a vector held as 32-bit words (or one 16-bit word for a 2-byte
// vector) until used: unpacked, each 16-bit element would take a register.
// Read-only inputs only: the words alias the elements' storage.
template <int kBytes>
struct alignas(kBytes) Words {
  using Word = std::conditional_t<(kBytes >= 4), uint32_t, uint16_t>;
  Word w[kBytes / sizeof(Word)];
};

// How a vector of V scalar_t is held in registers between its load and use.
template <typename scalar_t, int V>
using RawVec =
    std::conditional_t<sizeof(scalar_t) == 2, Words<sizeof(Vec<scalar_t, V>)>, Vec<scalar_t, V>>;

template <typename VecT, typename Raw>
__device__ __forceinline__ VecT as_vec(const Raw& raw) {
  if constexpr (std::is_same_v<Raw, VecT>) {
    return raw;
  } else {
    static_assert(sizeof(Raw) == sizeof(VecT), "a vector's words are its bytes");
    VecT v;
    memcpy(&v, &raw, sizeof(VecT));
    return v;
  }
}

// Starts copying one vector from global to shared memory without passing
// through registers (cp.async, sm_80 and later), so a CTA can put its whole
// kept slice in flight at once. Plain copies on older devices and for 2-byte
// vectors. copy_to_shared_wait() completes this thread's copies; a thread
// that reads back only what it copied needs no barrier before it does
// (copy_rows_whole_block's copies are read by others: a barrier follows).
template <typename VecT>
__device__ __forceinline__ void copy_to_shared_async(VecT* dst, const VecT* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(VecT) == 4 || sizeof(VecT) == 8 || sizeof(VecT) == 16) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    if constexpr (sizeof(VecT) == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" : : "r"(to), "l"(src) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;"
                   :
                   : "r"(to), "l"(src), "n"(int(sizeof(VecT)))
                   : "memory");
    }
    return;
  }
#endif
  *dst = *src;
}

__device__ __forceinline__ void copy_to_shared_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// One vector load with an L2 eviction priority: evict_last for the first
// read of a piece (L2 should still hold it at the second), evict_first for
// the second. Hints need sm_80 and 16-byte vectors; other loads are plain.
template <typename VecT>
__device__ __forceinline__ VecT load_with_l2_priority(const VecT* p, bool keep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(VecT) == 16) {
    uint64_t policy;
    if (keep) {
      asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    } else {
      asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    }
    VecT v;
    uint32_t* r = reinterpret_cast<uint32_t*>(&v);
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(p), "l"(policy));
    return v;
  }
#endif
  return *p;
}

namespace detail {
// Calls f(std::integral_constant<int, u>) for u = U, ..., kEnd - 1, so that
// register arrays indexed by u are indexed by constants.
template <int U, int kEnd>
struct Unrolled {
  template <typename F>
  __device__ __forceinline__ static void run(F&& f) {
    if constexpr (U < kEnd) {
      f(std::integral_constant<int, U>{});
      Unrolled<U + 1, kEnd>::run(f);
    }
  }
};

template <typename VecT, typename F, typename Raw, int kStreams, int kInFlight, size_t... S>
__device__ __forceinline__ void call_with_vecs(F& f, int64_t i,
                                               const Raw (&held)[kStreams][kInFlight], int u,
                                               std::index_sequence<S...>) {
  f(i, as_vec<VecT>(held[S][u])...);
}
}  // namespace detail

// Calls f(i, vec of each stream) for i = begin, begin + step, ... < end, the
// vector of a stream at streams[s] + i * stride, with kInFlight loads of
// every stream issued before the first use: input not kept on chip comes
// from L2 or DRAM, where one load at a time would leave the memory pipe idle.
// The two forms are what ptxas schedules best (docs/DESIGN.md, "load_each"):
// compile-time indices for one stream, plain unrolled loops for two, which
// keep every load of a dx kernel ahead of its first store.
template <int kInFlight, typename scalar_t, int V, typename F, typename... Streams>
__device__ __forceinline__ void load_each(int64_t begin, int64_t end, int step, int64_t stride,
                                          F&& f, const Streams*... streams) {
  using VecT = Vec<scalar_t, V>;
  using Raw = RawVec<scalar_t, V>;
  constexpr int kStreams = int(sizeof...(Streams));
  const scalar_t* base[kStreams] = {streams...};
  for (int64_t i0 = begin; i0 < end; i0 += int64_t(kInFlight) * step) {
    Raw held[kStreams][kInFlight];
    if constexpr (kStreams == 1) {
      detail::Unrolled<0, kInFlight>::run([&](auto item) {
        constexpr int u = decltype(item)::value;
        const int64_t i = i0 + int64_t(u) * step;
        if (i < end) held[0][u] = *reinterpret_cast<const Raw*>(base[0] + i * stride);
      });
      detail::Unrolled<0, kInFlight>::run([&](auto item) {
        constexpr int u = decltype(item)::value;
        const int64_t i = i0 + int64_t(u) * step;
        if (i < end) f(i, as_vec<VecT>(held[0][u]));
      });
    } else {
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t i = i0 + int64_t(u) * step;
        if (i < end) {
#pragma unroll
          for (int s = 0; s < kStreams; ++s) {
            held[s][u] = *reinterpret_cast<const Raw*>(base[s] + i * stride);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t i = i0 + int64_t(u) * step;
        if (i < end) detail::call_with_vecs<VecT>(f, i, held, u, std::make_index_sequence<kStreams>{});
      }
    }
  }
}

// n / d for 0 <= n < 2^31 with a multiply and a shift (as c10's IntDivider).
struct FastDivider {
  uint32_t magic, shift;
  __host__ explicit FastDivider(uint32_t d) {
    for (shift = 0; shift < 32; ++shift) {
      if ((1ull << shift) >= d) break;
    }
    const uint64_t one = 1;
    magic = uint32_t(((one << 32) * ((one << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    const uint32_t t = __umulhi(n, magic);
    return (t + n) >> shift;
  }
};

}  // namespace groupnorm
