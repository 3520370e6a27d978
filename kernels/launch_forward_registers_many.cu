// The registers kernel's many-items copies (launch_forward_registers.cuh),
// in units apart from its few-items ones (launch_forward_small.cu).
#include "launch_forward_registers.cuh"

namespace groupnorm {

#define GROUPNORM_INSTANTIATE_MANY(T, F) \
  GROUPNORM_INSTANTIATE_REGISTERS(T, kRegistersManyItems, F)
#define GROUPNORM_INSTANTIATE_MANYS(T) GROUPNORM_EPILOGUES(GROUPNORM_INSTANTIATE_MANY, T)
GROUPNORM_DTYPES(GROUPNORM_INSTANTIATE_MANYS)
#undef GROUPNORM_INSTANTIATE_MANYS
#undef GROUPNORM_INSTANTIATE_MANY

}  // namespace groupnorm
