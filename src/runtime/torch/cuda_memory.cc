#include "runtime/torch/cuda_memory.h"

#ifdef SHOAL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace shoal {

#ifdef SHOAL_WITH_CUDA

bool BuiltWithCuda() { return true; }

// Index 0 of each StatArray is StatType::AGGREGATE (both pools).
int64_t CudaAllocatedBytes(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return stats.allocated_bytes[0].current;
}

int64_t CudaReservedBytes(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return stats.reserved_bytes[0].current;
}

void CudaReleaseCachedMemory() { c10::cuda::CUDACachingAllocator::emptyCache(); }

#else

bool BuiltWithCuda() { return false; }
int64_t CudaAllocatedBytes(int) { return -1; }
int64_t CudaReservedBytes(int) { return -1; }
void CudaReleaseCachedMemory() {}

#endif

}  // namespace shoal
