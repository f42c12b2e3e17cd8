// The CUDA caching allocator's figures, for measuring what a model holds on
// a GPU. Built with them only when libtorch has CUDA (CMake defines
// SHOAL_WITH_CUDA when it finds c10_cuda); otherwise every call reports
// "unknown". Torch-free header.
#pragma once

#include <cstdint>

namespace shoal {

// Whether this build links libtorch's CUDA allocator.
bool BuiltWithCuda();
// Bytes of live tensors the CUDA caching allocator holds on `device`
// (allocated, not merely reserved); -1 without CUDA.
int64_t CudaAllocatedBytes(int device);
// Bytes the allocator has reserved from the driver on `device` (live
// tensors plus its cache); -1 without CUDA.
int64_t CudaReservedBytes(int device);
// Returns the allocator's unused cached blocks to the driver, so memory a
// released model held is free for the next one and for other processes.
void CudaReleaseCachedMemory();

}  // namespace shoal
