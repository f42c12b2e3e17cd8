// The CUDA caching allocator's figures, for measuring what a model holds on
// a GPU. Built with them only when libtorch has CUDA (CMake defines
// SHOAL_WITH_CUDA when it finds c10_cuda); otherwise BuiltWithCuda() is
// false, CudaAllocatedBytes() -1, and CudaUseDevice() and
// CudaReleaseCachedMemory() do nothing. Torch-free header.
#pragma once

#include <cstdint>

namespace shoal {

// Whether this build links libtorch's CUDA allocator.
bool BuiltWithCuda();
// Bytes of live tensors the CUDA caching allocator holds on `device`
// (allocated, not merely reserved); -1 without CUDA or before CUDA has
// started on that device.
int64_t CudaAllocatedBytes(int device);
// Makes `device` the calling thread's current CUDA device, where it is not
// already. Every thread that works on a model's GPU calls it first:
// libtorch and the CUDA runtime fall back to device 0 on a thread that never
// set one, and on a worker for cuda:N that would start a CUDA context (a
// few hundred MiB) on another worker's GPU. Never restores the previous
// device (restoring device 0 is what would start its context).
void CudaUseDevice(int device);
// Returns the allocator's unused cached blocks to the driver, so memory a
// released model held is free for the next one and for other processes.
// Frees on `device`'s context (CudaUseDevice first).
void CudaReleaseCachedMemory(int device);

}  // namespace shoal
