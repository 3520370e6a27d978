// Memory-model primitives for CTAs that wait on each other (teams and the
// stream kernels' arrival counts), at GPU scope, and for kernels that wait
// on the kernel before them.
#pragma once

namespace groupnorm {

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Adds v to *p with acquire and release semantics; returns the old value.
// Its release publishes what was written before it (by this thread, or by
// the block before a barrier); its acquire, for the CTA that completes a
// unit, every other CTA's.
__device__ __forceinline__ int add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

// Programmatic dependent launch (sm_90+; no-ops below): a kernel launched
// with LaunchShape::after_previous may start while the kernel before it on
// the stream still runs, so it calls griddep_wait() before it reads what that
// kernel writes or writes what it reads; the wait returns once that kernel
// has ended and its writes are visible. griddep_release() lets the next such
// kernel launch once every CTA of this one has called it (or ended).
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

}  // namespace groupnorm
