// Runtime: executes one model on one device. The worker owns one Runtime per
// loaded model and calls it from a single executor thread, so adapters need
// not be thread-safe. Adapters: "torchscript" (libtorch in-process),
// "process" (any language, in its own process over a Unix socket), "openai"
// (an upstream OpenAI-compatible server over HTTP) and "null" (no model;
// measures Shoal's own overhead).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/model_config.h"
#include "common/status.h"

namespace shoal {

// A padded, row-major batch of token ids ready for the model.
struct TokenBatch {
  int rows = 0;
  int seq_len = 0;                     // longest row; every row padded to it
  std::vector<int64_t> input_ids;      // rows * seq_len
  std::vector<int64_t> attention_mask; // rows * seq_len, 1 = real token
  // rows * seq_len, 1 = second text of a pair; empty: all 0 (single texts).
  std::vector<int64_t> token_type_ids;
  // Intra-op threads for this pass; 0: the model's configured count. Only
  // runtimes whose TakesThreadCount() is true honour it.
  int threads = 0;
};

// Row-major float32 output, one row per input row: an embedding (task
// embed), one raw score (score) or one logit per label (classify). The
// worker applies the model's activation afterwards.
struct Embeddings {
  int rows = 0;
  int dim = 0;
  std::vector<float> data;  // rows * dim
};

// Receives streamed output while Runtime::RunItems runs (generation):
// `item` indexes the batch's inputs, `chunk` is one MessagePack document.
// Called on the executor thread.
using PartialSink = std::function<void(size_t item, std::string_view chunk)>;

// Receives one input's result document (as RunItems returns it, an
// ItemError included) as soon as that input is done, while others of the
// batch still run: after all of its partial output, on the executor
// thread. RunItems still returns every result.
using ResultSink = std::function<void(size_t item, const std::string& result)>;

// What a runtime may call while RunItemsAsReady runs; any may be empty.
struct ItemCalls {
  PartialSink partial;
  ResultSink done;
  // Whether input `item`'s caller has gone (a streamed answer whose client
  // disconnected): a runtime that can stop part-way stops it and gives it
  // Cancelled() as its result. Thread-safe; cheap enough to ask per event.
  std::function<bool(size_t item)> cancelled;
};

// The result of an input whose caller went away (see ItemCalls::cancelled).
Status Cancelled();

class Runtime {
 public:
  virtual ~Runtime() = default;
  // Loads the model's artifacts. Blocks (may take seconds). Call once.
  virtual Status Load(const ModelConfig& config) = 0;
  // Runs one batch; blocks for the duration of the forward pass. Pooling and
  // normalisation follow the config given to Load(). Never throws.
  virtual Result<Embeddings> Run(const TokenBatch& batch) = 0;
  // Whether the runtime takes whole inputs (RunItems) instead of token
  // batches (Run): OCR images, generation requests, text for a backend that
  // tokenizes itself. Known after Load(). The worker then skips its
  // tokenizer and batches items.
  virtual bool TakesItems() const { return false; }
  // Runs a batch of opaque inputs (WorkBody::items); one MessagePack result
  // document per input, in order. A failure fails the whole batch; an input
  // that fails on its own gets ItemError(status) as its document instead,
  // and only its caller gets the error. `partial` (may be empty) receives
  // streamed output before the results. Never throws.
  virtual Result<std::vector<std::string>> RunItems(const std::vector<std::string>& items,
                                                    const PartialSink& partial) {
    (void)items;
    (void)partial;
    return Unprocessable("this runtime takes token batches, not whole inputs", "wrong_task");
  }
  // RunItems with each input's deadline (wall-clock ms since the epoch,
  // 0: none; an empty vector: none at all), after which its caller no
  // longer waits. A runtime that can stop part-way (OCR) gives an input it
  // could not finish in time ItemError(DeadlineExceeded) instead of
  // spending seconds on an answer nobody reads. The default ignores them.
  virtual Result<std::vector<std::string>> RunItemsBefore(const std::vector<std::string>& items,
                                                          const std::vector<int64_t>& deadlines_unix_ms,
                                                          const PartialSink& partial) {
    (void)deadlines_unix_ms;
    return RunItems(items, partial);
  }
  // RunItemsBefore that hands each input's result to `calls.done` as soon
  // as it is ready, so a caller whose answer came first need not wait for
  // the batch's longest (generation), and may stop an input whose caller
  // went away (`calls.cancelled`). The default does neither.
  virtual Result<std::vector<std::string>> RunItemsAsReady(const std::vector<std::string>& items,
                                                           const std::vector<int64_t>& deadlines_unix_ms,
                                                           const ItemCalls& calls) {
    return RunItemsBefore(items, deadlines_unix_ms, calls.partial);
  }
  // Whether batches run on this worker's device. False for a runtime that
  // forwards to a remote server: its batches take no turn on the device
  // (a long generation upstream must not stall the models computing here)
  // and do not count as device busy time.
  virtual bool UsesDevice() const { return true; }
  // How many calls of RunItemsAsReady this runtime serves at once, each
  // best given one input (a request to a server that batches for itself,
  // as an OpenAI-compatible one does). Above 1 (for a runtime that does not
  // use the device), the worker runs that many one-input calls side by
  // side and starts the next as soon as one ends, so a long generation
  // does not hold back the requests behind it. 1: one batch at a time.
  // Known after Load().
  virtual int ConcurrentCalls() const { return 1; }
  // Whether Run() computes on this host's CPU cores and honours
  // TokenBatch::threads, so a pass can run on fewer cores while other
  // models' passes use the rest. False: a pass takes the whole device.
  virtual bool TakesThreadCount() const { return false; }
  // Releases the model. Safe to call twice.
  virtual void Unload() = 0;
  // Resident memory attributed to this model, measured at load time.
  virtual int64_t MemoryBytes() const = 0;
  // Whether the model's footprint is host memory, so the worker may take
  // the process's memory growth during the load over MemoryBytes(). False
  // for a model on a GPU: its budget is the GPU's. Known after Load().
  virtual bool FootprintIsHostMemory() const { return true; }
  // Embedding width, known after Load().
  virtual int Dim() const = 0;
  // False while the runtime cannot take batches for a while (an
  // out-of-process runtime restarting); the worker then stops pulling work
  // for the model instead of burning its deliveries. Thread-safe.
  virtual bool Available() const { return true; }
  // Not OK once the runtime has given up for good (an out-of-process
  // runtime that failed to restart max_failed_starts times in a row): the
  // worker then unloads the model and marks it failed, so callers get a
  // terminal error instead of waiting for their deadline. Thread-safe.
  virtual Status Health() const { return Status::Ok(); }
  // Not OK (reason device_fault) once the device this runtime computes on
  // is unusable for the rest of the process, whichever model broke it: a
  // CUDA error such as a device-side assert leaves the process's CUDA
  // context failing every later call. Its model servers stop pulling at
  // once (Available() is false too); the worker leaves the registry and
  // asks to be restarted (WorkerOptions::on_device_fault). Thread-safe.
  virtual Status DeviceHealth() const { return Status::Ok(); }
};

// The result document of one input that failed on its own (see RunItems):
// a map {error: {code, message, reason}}.
std::string ItemError(const Status& status);
// The error an ItemError document carries; OK for any other document.
Status ParseItemError(std::string_view doc);

// Whether this build can run models on `device` ("cpu", "cuda[:N]"; see
// ModelConfig::device): kUnavailable (reason device_unavailable) for a GPU
// when libtorch has no CUDA or does not see it.
Status CheckComputeDevice(const std::string& device);

// Makes an unloaded runtime for config.runtime ("torchscript" | "process" |
// "openai" | "sim" | "null").
Result<std::unique_ptr<Runtime>> CreateRuntime(const std::string& kind);

}  // namespace shoal
