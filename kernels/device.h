// Device facts, read once per device, and the per-kernel occupancy queries
// the planner makes (cached: plans are made on every call). The kernel
// queries act on the current device: callers hold a guard for `device`.
#pragma once

#include <cstddef>

namespace groupnorm {

struct DeviceInfo {
  int sms = 0;
  int smem_per_sm = 0;     // bytes of shared memory per multiprocessor
  int smem_per_block = 0;  // opt-in maximum for one block
  int l2_bytes = 0;
  bool cooperative = false;  // co-resident launches (team barrier) allowed
  bool clusters = false;     // thread-block clusters (sm_90+)
};

const DeviceInfo& device_info(int device);

// Dynamic shared memory one block of `kernel` may ask for: the device's opt-in
// maximum less the kernel's static shared memory.
size_t dynamic_smem_limit(const void* kernel, int device);

// Blocks of `kernel` resident on one SM with this many threads and bytes of
// dynamic shared memory; raises the kernel's shared-memory limit to the
// device's opt-in maximum the first time it is seen on a device.
int blocks_per_sm(const void* kernel, int device, int threads, size_t smem);

// Clusters of `ranks` CTAs of `kernel` the device can run at once; 0 when
// such a cluster cannot be scheduled or the kernel was built without clusters.
int active_clusters(const void* kernel, int device, int threads, int ranks);

// Whether `kernel` may launch as a programmatic dependent (LaunchShape::
// after_previous): an sm_90+ device running code built for sm_90+. Code
// JIT-compiled there from older PTX has no griddep_wait, so it would read the
// previous kernel's results before they are visible.
bool dependent_launch(const void* kernel, int device);

}  // namespace groupnorm
