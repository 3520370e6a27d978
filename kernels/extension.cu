// Every translation unit of the library as one, for a plain nvcc build and
// the KernelBench export (load_inline compiles a single CUDA string). The
// loader instead compiles each file on its own, in parallel, with
// bindings.cpp as the Python module.
#include "counter_slots.cu"
#include "counters.cpp"
#include "device.cpp"
#include "errors.cpp"
#include "launch_backward.cu"
#include "launch_forward_registers_many.cu"
#include "launch_forward_small.cu"
#include "launch_forward_stream.cu"
#include "launch_forward_stream_channels_last.cu"
#include "launch_forward_team.cu"
#include "library.cpp"
#include "ops.cpp"
#include "plan_backward.cpp"
#include "plan_forward.cpp"
