#include "device.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace groupnorm {

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

namespace {

// The attributes of the code of `kernel` that runs on `device`.
const cudaFuncAttributes& kernel_attributes(const void* kernel, int device) {
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, cudaFuncAttributes> cache;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_pair(kernel, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return cache.emplace(key, attributes).first->second;  // map entries never move
}

}  // namespace

size_t dynamic_smem_limit(const void* kernel, int device) {
  return size_t(device_info(device).smem_per_block) -
         kernel_attributes(kernel, device).sharedSizeBytes;
}

int blocks_per_sm(const void* kernel, int device, int threads, size_t smem) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const size_t limit = dynamic_smem_limit(kernel, device);
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(kernel, device, threads, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const auto limit_key = std::make_tuple(kernel, device, -1, size_t(0));
  if (cache.find(limit_key) == cache.end()) {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
    cache[limit_key] = 0;
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  cache[key] = blocks;
  return blocks;
}

bool dependent_launch(const void* kernel, int device) {
  return device_info(device).clusters && kernel_attributes(kernel, device).ptxVersion >= 90;
}

int active_clusters(const void* kernel, int device, int threads, int ranks) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(kernel, device, threads, ranks);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (kernel_attributes(kernel, device).ptxVersion < 90) return cache.emplace(key, 0).first->second;
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

}  // namespace groupnorm
