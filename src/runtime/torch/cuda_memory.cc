#include "runtime/torch/cuda_memory.h"

#ifdef SHOAL_WITH_CUDA
#include <exception>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace shoal {

#ifdef SHOAL_WITH_CUDA

bool BuiltWithCuda() { return true; }

// Index 0 of each StatArray is StatType::AGGREGATE (both pools). The
// allocator throws for a device it has not set up (CUDA not started yet).
int64_t CudaAllocatedBytes(int device) {
  try {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].current;
  } catch (const std::exception&) {
    return -1;
  }
}

void CudaUseDevice(int device) {
  const auto index = static_cast<c10::DeviceIndex>(device);
  if (c10::cuda::current_device() != index) c10::cuda::set_device(index);
}

void CudaReleaseCachedMemory(int device) {
  CudaUseDevice(device);
  c10::cuda::CUDACachingAllocator::emptyCache();
}

#else

bool BuiltWithCuda() { return false; }
int64_t CudaAllocatedBytes(int) { return -1; }
void CudaUseDevice(int) {}
void CudaReleaseCachedMemory(int) {}

#endif

}  // namespace shoal
