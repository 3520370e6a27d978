// The host units' dispatch from a problem to the kernels' template
// arguments: its dtype's type and its epilogue switch, among those the build
// has (GROUPNORM_DTYPES, GROUPNORM_EPILOGUES in launchers.h).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "launchers.h"
#include "problem.h"

namespace groupnorm {

// The Dtype of a tensor's ScalarType, one of the four the checks let in.
inline Dtype dtype_of(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return Dtype::Float;
    case c10::ScalarType::Double:
      return Dtype::Double;
    case c10::ScalarType::Half:
      return Dtype::Half;
    case c10::ScalarType::BFloat16:
      return Dtype::BFloat16;
    default:
      TORCH_CHECK(false, "groupnorm: no kernels for ", type);
  }
}

// torch's name of a Dtype, as c10 prints its ScalarType.
inline const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::Float:
      return "Float";
    case Dtype::Double:
      return "Double";
    case Dtype::Half:
      return "Half";
    case Dtype::BFloat16:
      return "BFloat16";
  }
  return "?";
}

template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<scalar_t>{}) for the dtype of a problem; an error for a dtype
// the build has no kernels for.
template <typename F>
decltype(auto) with_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::Float:
      if constexpr (built_for_dtype<float>()) return f(TypeTag<float>{});
      break;
    case Dtype::Double:
      if constexpr (built_for_dtype<double>()) return f(TypeTag<double>{});
      break;
    case Dtype::Half:
      if constexpr (built_for_dtype<c10::Half>()) return f(TypeTag<c10::Half>{});
      break;
    case Dtype::BFloat16:
      if constexpr (built_for_dtype<c10::BFloat16>()) return f(TypeTag<c10::BFloat16>{});
      break;
  }
  TORCH_CHECK(false, "groupnorm: this build has no kernels for ", dtype_name(dtype),
              " input (a KernelBench solution is built for float32 alone)");
}

// f(TypeTag<scalar_t>{}, std::bool_constant<kFused>{}) for a problem: its
// dtype, and whether it has an epilogue (forward) or is the fused forward's
// backward.
template <typename F>
decltype(auto) with_kernel_types(const Problem& p, F&& f) {
  return with_dtype(p.dtype, [&](auto tag) {
    if (p.epilogue) {
      if constexpr (built_for_epilogue<true>()) return f(tag, std::true_type{});
    } else {
      if constexpr (built_for_epilogue<false>()) return f(tag, std::false_type{});
    }
    TORCH_CHECK(false, "groupnorm: this build has no kernels ",
                p.epilogue ? "with" : "without", " an epilogue (a KernelBench solution has "
                "those of its problem's forward alone)");
  });
}

}  // namespace groupnorm
