// The CUDA caching allocator's figures, for measuring what a model holds on
// a GPU. Built with them only when libtorch has CUDA (CMake defines
// SHOAL_WITH_CUDA when it finds c10_cuda); otherwise BuiltWithCuda() is
// false, CudaAllocatedBytes() -1 and CudaReleaseCachedMemory() does
// nothing. Torch-free header.
#pragma once

#include <cstdint>

namespace shoal {

// Whether this build links libtorch's CUDA allocator.
bool BuiltWithCuda();
// Bytes of live tensors the CUDA caching allocator holds on `device`
// (allocated, not merely reserved); -1 without CUDA or before CUDA has
// started on that device.
int64_t CudaAllocatedBytes(int device);
// Returns the allocator's unused cached blocks to the driver, so memory a
// released model held is free for the next one and for other processes.
void CudaReleaseCachedMemory();

}  // namespace shoal
