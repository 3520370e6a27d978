// The translation unit load_inline compiles: every entry point in bindings.cpp.
#include "backward_host.cu"
#include "forward_host.cu"
