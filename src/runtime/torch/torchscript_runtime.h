// TorchScriptRuntime ("torchscript"): runs a TorchScript encoder in-process
// with libtorch, on the CPU or on the CUDA GPU named by ModelConfig::device
// (when libtorch has CUDA). The model takes (input_ids i64 [B,T], attention_mask
// i64 [B,T]) and returns last_hidden_state [B,T,H] (a tensor, the first
// element of a tuple, or a dict entry), or already-pooled [B,H]. Pooling and
// L2 normalisation follow the ModelConfig. libtorch headers stay inside the
// .cc; this header is safe to include anywhere.
//
// Threads: a pass runs on TokenBatch::threads intra-op threads when it is
// set, else on the model's intra_op_threads (one per hardware thread when
// 0). The count is set per calling thread (OpenMP), so executors of
// different models can run passes of different widths at once.
// Not thread-safe: one caller at a time (see Runtime).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "runtime/runtime.h"

namespace shoal {

// Whether TorchScript models can run on `device` ("cpu", "cuda[:N]"): OK for
// the CPU; for a GPU, kUnavailable (reason device_unavailable) when this
// build's libtorch has no CUDA or does not see that device; kInvalidArgument
// for a malformed name.
Status CheckTorchDevice(const std::string& device);

class TorchScriptRuntime final : public Runtime {
 public:
  TorchScriptRuntime();
  ~TorchScriptRuntime() override;

  // Loads config.ModelPath() onto config.device, sets intra-op threads
  // (config.intra_op_threads, or one per hardware thread when 0), runs
  // warm-up forwards and records the memory it cost. Blocks for the load (0.1-1 s for MiniLM).
  // kNotFound: no model file; kInvalidArgument: bad config or the model's
  // width disagrees with config.dim; kUnavailable: the device is not there
  // (see CheckTorchDevice); kInternal: libtorch failed to load or run.
  Status Load(const ModelConfig& config) override;
  // One forward pass; blocks for its duration. kInvalidArgument for bad
  // shapes, seq_len over max_seq_len or token ids the model rejects;
  // kUnavailable before Load(); kInternal for other libtorch failures.
  Result<Embeddings> Run(const TokenBatch& batch) override;
  // True on the CPU; on a GPU a pass takes the whole device.
  bool TakesThreadCount() const override;
  void Unload() override;
  // What load and warm-up left resident, at least the size of the model's
  // parameters and buffers: growth of process RSS on the CPU; on a GPU, growth
  // of the bytes the CUDA caching allocator has allocated on the device.
  // Activations of large batches are not included.
  int64_t MemoryBytes() const override;
  // False on a GPU.
  bool FootprintIsHostMemory() const override;
  int Dim() const override;
  // On a GPU, false once the device has failed in this process (see
  // DeviceHealth); always true on the CPU.
  bool Available() const override;
  // Not OK (kUnavailable, reason device_fault) once any model's pass or
  // load on this runtime's GPU has hit a CUDA error that leaves the
  // process's CUDA context unusable (internal::DeviceFaultLine). Later passes
  // and loads on that GPU return the same at once, without touching it.
  Status DeviceHealth() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace internal {
// The line of a libtorch error's full text (TorchScript traceback and CUDA
// hints included) that reports a CUDA error leaving the process's CUDA
// context failing every later call ("sticky"): a device-side assert, an
// illegal memory access or instruction, a launch failure or timeout, a
// misaligned address, an ECC error, a failed cuBLAS or cuDNN execution,
// from the runtime or the driver API. Empty when there is none: other CUDA
// errors (out of memory, an invalid launch configuration or argument)
// leave the context working.
std::string DeviceFaultLine(std::string_view text);
// The line of a libtorch error's text that says what failed: the first
// line, or for a TorchScript interpreter error (a traceback first) its last
// line that names an error ("RuntimeError: ..."), not the hints CUDA adds
// after it; else its last line that is not blank.
std::string ErrorSummary(const std::string& text);
// Starts CUDA on `device` for the calling thread (its context, the caching
// allocator, the thread's cuBLAS and cuBLASLt handles and workspaces) and
// makes it the thread's current device, so that a model's load measured
// after it counts only the model. Throws what libtorch throws.
void StartCudaOn(int device);
}  // namespace internal

}  // namespace shoal
