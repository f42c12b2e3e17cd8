# shoal_torch_cuda(target): compiles `target` with SHOAL_WITH_CUDA when the
# libtorch found by find_package(Torch) has CUDA (its TorchConfig finds
# c10_cuda, already part of TORCH_LIBRARIES). Then TorchScript models can
# run on a GPU (--device cuda) and are measured with the CUDA caching
# allocator's figures. Debian's libtorch is CPU-only: then --device cuda is
# refused with a clear error.
function(shoal_torch_cuda target)
  if(C10_CUDA_LIBRARY OR TARGET c10_cuda)
    message(STATUS "libtorch has CUDA (${C10_CUDA_LIBRARY}): GPU workers enabled")
    target_compile_definitions(${target} PRIVATE SHOAL_WITH_CUDA)
  else()
    message(STATUS "libtorch has no CUDA: TorchScript runs on the CPU only")
  endif()
endfunction()
