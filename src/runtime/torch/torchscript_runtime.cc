#include "runtime/torch/torchscript_runtime.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/cuda.h>
#include <torch/script.h>

#include "common/device.h"
#include "common/log.h"
#include "common/process_memory.h"
#include "runtime/internal/batch_check.h"
#include "runtime/torch/cuda_memory.h"
#include "runtime/torch/huge_pages.h"

namespace shoal {
namespace {

using internal::ErrorSummary;

bool StartsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// An out-of-range index in a model fed token ids is bad input, not a bug.
// The interpreter rethrows everything as RuntimeError, so look at the text.
Status Classify(const std::string& what, const std::string& msg) {
  if (StartsWith(msg, "IndexError") || StartsWith(msg, "ValueError") ||
      msg.find("index out of range") != std::string::npos) {
    return InvalidArgument(what + ": " + msg);
  }
  return Internal(what + ": " + msg);
}

// libtorch throws; this is the edge where exceptions become Status.
// `text` (may be null) receives the whole text thrown, which the status
// carries only in Summary's short form.
Status FromException(const std::string& what, std::exception_ptr e, std::string* text = nullptr) {
  std::string ignored;
  std::string& full = text != nullptr ? *text : ignored;
  try {
    std::rethrow_exception(e);
  } catch (const c10::IndexError& ex) {
    full = ex.what_without_backtrace();
    return InvalidArgument(what + ": " + ErrorSummary(full));
  } catch (const c10::ValueError& ex) {
    full = ex.what_without_backtrace();
    return InvalidArgument(what + ": " + ErrorSummary(full));
  } catch (const c10::Error& ex) {
    full = ex.what_without_backtrace();
    return Classify(what, ErrorSummary(full));
  } catch (const std::exception& ex) {
    full = ex.what();
    return Classify(what, ErrorSummary(full));
  } catch (...) {
    return Internal(what + ": unknown exception");
  }
}

// Parameter names (suffixes) of embedding tables in common exports:
// BERT-style encoders, LLaMA/OPT-style, GPT-2-style and others.
constexpr std::string_view kEmbeddingTableNames[] = {"word_embeddings.weight", "embed_tokens.weight", "wte.weight",
                                                     "tok_embeddings.weight", "token_embedding.weight"};
constexpr std::string_view kPositionTableNames[] = {"position_embeddings.weight", "wpe.weight",
                                                    "embed_positions.weight"};
constexpr std::string_view kTokenTypeTableNames[] = {"token_type_embeddings.weight"};

// The rows of the first 2-D parameter named (or ending in ".") one of
// `names`; 0: none.
template <size_t N>
int64_t TableRows(const torch::jit::Module& module, const std::string_view (&names)[N]) {
  for (const auto& p : module.named_parameters()) {
    if (p.value.dim() != 2) continue;
    const std::string& name = p.name;
    for (const std::string_view table : names) {
      const bool nested = name.size() > table.size() && name.ends_with(table) &&
                          name[name.size() - table.size() - 1] == '.';
      if (name == table || nested) return p.value.size(0);
    }
  }
  return 0;
}

// CUDA devices that have failed in this process, by index: their context
// stays failed for every model on them, so the first fault is kept for the
// life of the process.
class DeviceFaults {
 public:
  static DeviceFaults& Get() {
    static DeviceFaults faults;
    return faults;
  }
  // Keeps the first fault of `index`; returns the kept one.
  Status Record(int index, const Status& fault) {
    std::lock_guard<std::mutex> lock(mu_);
    return faults_.emplace(index, fault).first->second;
  }
  Status Of(int index) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = faults_.find(index);
    return it == faults_.end() ? Status::Ok() : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<int, Status> faults_;
};

}  // namespace

namespace internal {

std::string ErrorSummary(const std::string& s) {
  if (s.find("TorchScript interpreter") == std::string::npos) return s.substr(0, s.find('\n'));
  // The last line that names an error ("RuntimeError: ...", at the start of
  // the line: the traceback's code lines are indented); CUDA's hints may
  // follow it. Else the last line that is not blank.
  std::string_view last_error, last_line;
  std::string_view rest = s;
  while (!rest.empty()) {
    const size_t newline = rest.find('\n');
    std::string_view line = rest.substr(0, newline);
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.remove_suffix(1);
    if (!line.empty()) {
      last_line = line;
      const size_t colon = line.find(": ");
      const std::string_view name = line.substr(0, colon);
      const bool names_error =
          colon != std::string_view::npos && colon > 0 &&
          (name.ends_with("Error") || name.ends_with("Exception")) &&
          name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.") ==
              std::string_view::npos;
      if (names_error) last_error = line;
    }
    if (newline == std::string_view::npos) break;
    rest.remove_prefix(newline + 1);
  }
  if (!last_error.empty()) return std::string(last_error);
  return last_line.empty() ? s : std::string(last_line);
}

void StartCudaOn(int device) {
  CudaUseDevice(device);
  c10::InferenceMode guard;
  const auto on = torch::TensorOptions(torch::kFloat32).device(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device)));
  const auto a = torch::ones({64, 64}, on);
  const auto x = torch::ones({2, 16, 64}, on);
  // matmul: cuBLAS and its workspace; a linear layer with a bias on 3-D
  // input, as in a model: cuBLASLt and its own workspace in newer libtorch.
  (void)(a.matmul(a).sum() + at::linear(x, a, torch::zeros({64}, on)).sum()).item<float>();
}

std::string DeviceFaultLine(std::string_view text) {
  // CUDA's "sticky" errors: after one, every call in the context fails.
  // Others (an invalid launch configuration, an argument, out of memory, a
  // cuBLAS handle that could not be allocated) leave it working.
  constexpr std::string_view kSticky[] = {
      "device-side assert triggered",   "an illegal memory access was encountered",
      "unspecified launch failure",     "misaligned address",
      "an illegal instruction was encountered", "invalid program counter",
      "hardware stack error",           "uncorrectable ECC error",
      "the launch timed out",           "CUBLAS_STATUS_EXECUTION_FAILED",
      "CUDNN_STATUS_EXECUTION_FAILED",  "operation not supported on global/shared address space",
      "uncorrectable NVLink error",     "unknown error"};
  while (!text.empty()) {
    const size_t newline = text.find('\n');
    const std::string_view line = text.substr(0, newline);
    // "CUDA error: ..." (runtime API, cuBLAS), "CUDA driver error: ..."
    // (driver API), "cuDNN error: ...".
    if (line.find("CUDA error") != std::string_view::npos || line.find("CUDA driver error") != std::string_view::npos ||
        line.find("cuDNN error") != std::string_view::npos) {
      for (const std::string_view sticky : kSticky)
        if (line.find(sticky) != std::string_view::npos) return std::string(line);
    }
    if (newline == std::string_view::npos) break;
    text.remove_prefix(newline + 1);
  }
  return {};
}

}  // namespace internal

Status CheckTorchDevice(const std::string& device) {
  ASSIGN_OR_RETURN(const Device d, ParseDevice(device));
  if (!d.cuda) return Status::Ok();
  if (!BuiltWithCuda()) {
    return Unavailable("device " + d.ToString() +
                           ": this build of Shoal uses a libtorch without CUDA (Debian's libtorch is CPU-only); "
                           "build it against a CUDA libtorch (docs/operations.md, \"GPU workers\")",
                       "device_unavailable");
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (d.index >= count) {
    return Unavailable("device " + d.ToString() + " is not available: libtorch sees " + std::to_string(count) +
                           " CUDA device(s)",
                       "device_unavailable");
  }
  return Status::Ok();
}

struct TorchScriptRuntime::Impl {
  ModelConfig config;
  torch::jit::Module module;
  torch::Device device{torch::kCPU};
  bool loaded = false;
  int dim = 0;
  int64_t vocab_size = 0;  // 0: unknown, only negative ids are rejected
  int64_t token_types = 0;  // rows of the segment table; 0: unknown, not checked
  int threads = 1;
  int64_t memory_bytes = 0;
  // forward(input_ids, attention_mask, token_type_ids): BERT-style pair
  // models (cross-encoders) take segment ids as a third input.
  bool takes_token_types = false;
  // OpenMP keeps the thread count per thread, and libtorch copies its global
  // value into a thread only at that thread's first parallel op; a thread
  // that ran torch work before Load() keeps its old count. Re-apply whenever
  // Run() comes from a thread other than the one that last applied it.
  std::thread::id threads_applied_on;

  void ApplyThreads() {
    if (threads_applied_on == std::this_thread::get_id()) return;
    at::set_num_threads(threads);
    threads_applied_on = std::this_thread::get_id();
  }

  // This pass's thread count, for the calling thread only. at::get_num_threads
  // first runs libtorch's once-per-thread set-up (which would otherwise reset
  // the count at the thread's first parallel op); omp_set_num_threads then
  // changes only this thread's count, where at::set_num_threads would also
  // rebuild libtorch's process-wide thread pool whenever the count changes.
  // Drops the module; on a GPU, also hands the allocator's now unused cached
  // blocks back to the driver.
  // After a device fault the cache stays: the process is about to end.
  void Release() {
    if (device.is_cuda() && Fault().ok()) {
      try {
        CudaUseDevice(device.index());  // the module's tensors are freed on its context
      } catch (...) {
        // Shows again, and is handled, when the cache is emptied below.
      }
    }
    module = torch::jit::Module();
    if (!device.is_cuda() || !Fault().ok()) return;
    try {
      CudaReleaseCachedMemory(device.index());
    } catch (...) {
      // A fault that shows here first is recorded like one in a pass.
      const Status failed = Failed("emptying the CUDA cache of " + device.str(), std::current_exception());
      if (failed.reason() != "device_fault") LOG_WARN("torchscript", failed.message());
    }
  }

  // The fault of this runtime's GPU; OK on the CPU or while the GPU works.
  Status Fault() const {
    return device.is_cuda() ? DeviceFaults::Get().Of(device.index()) : Status::Ok();
  }

  // What a libtorch exception means for the caller: FromException's status,
  // or, for a CUDA error that leaves the context unusable, the device's
  // fault (recorded first).
  Status Failed(const std::string& what, std::exception_ptr e) const {
    std::string text;
    const Status failed = FromException(what, e, &text);
    if (!device.is_cuda()) return failed;
    const std::string line = internal::DeviceFaultLine(text);
    if (line.empty()) return failed;
    const Status fault = DeviceFaults::Get().Record(
        device.index(), Unavailable(what + ": device " + device.str() +
                                        " failed, and this process cannot use it again: " + line,
                                    "device_fault"));
    LOG_ERROR("torchscript", fault.message());
    return fault;
  }

  static void ThreadsForPass(int n) {
    if (at::get_num_threads() != n) omp_set_num_threads(n);
  }

  // Returns the pooled [rows, H] float tensor. Throws (caller converts).
  Result<at::Tensor> Forward(const TokenBatch& batch) {
    // from_blob borrows the caller's buffers; the traced graph only reads them.
    const auto ids = torch::from_blob(const_cast<int64_t*>(batch.input_ids.data()),
                                      {batch.rows, batch.seq_len}, torch::kInt64);
    const auto mask_cpu = torch::from_blob(const_cast<int64_t*>(batch.attention_mask.data()),
                                           {batch.rows, batch.seq_len}, torch::kInt64);
    c10::InferenceMode guard;
    // On a GPU the inputs are copied over (to(kCPU) is a no-op on the CPU).
    const auto mask = mask_cpu.to(device);
    std::vector<c10::IValue> inputs = {ids.to(device), mask};
    if (takes_token_types) {
      if (batch.token_type_ids.empty()) {
        inputs.emplace_back(torch::zeros({batch.rows, batch.seq_len}, torch::TensorOptions(torch::kInt64).device(device)));
      } else {
        inputs.emplace_back(torch::from_blob(const_cast<int64_t*>(batch.token_type_ids.data()),
                                             {batch.rows, batch.seq_len}, torch::kInt64)
                                .to(device));
      }
    }
    const c10::IValue out = module.forward(std::move(inputs));

    at::Tensor hidden;
    if (out.isTensor()) {
      hidden = out.toTensor();
    } else if (out.isTuple() && !out.toTupleRef().elements().empty() &&
               out.toTupleRef().elements()[0].isTensor()) {
      hidden = out.toTupleRef().elements()[0].toTensor();
    } else if (out.isGenericDict()) {
      const auto dict = out.toGenericDict();
      // Embedders name their output one of two ways; classification heads
      // (score, classify) return "logits".
      static const std::vector<std::string> kEmbedKeys = {"last_hidden_state", "sentence_embedding"};
      static const std::vector<std::string> kHeadKeys = {"logits"};
      for (const std::string& key : config.task == "embed" ? kEmbedKeys : kHeadKeys) {
        auto it = dict.find(c10::IValue(key));
        if (it != dict.end() && it->value().isTensor()) {
          hidden = it->value().toTensor();
          break;
        }
      }
      if (!hidden.defined()) {
        return Internal("model output dict has no '" + std::string(config.task == "embed" ? "last_hidden_state" : "logits") + "' tensor");
      }
    } else {
      return Internal("model output must be a tensor, a tuple starting with one, or a "
                      "dict; got " + out.tagKind());
    }

    hidden = hidden.to(torch::kFloat32);
    if (config.task != "embed") {
      // Scores and class logits: one row per input, no pooling.
      if (hidden.dim() == 1 && hidden.size(0) == batch.rows) hidden = hidden.unsqueeze(1);
      if (hidden.dim() != 2 || hidden.size(0) != batch.rows) {
        return Internal("a " + config.task + " model must return [" + std::to_string(batch.rows) +
                        ", labels] logits; got shape " + c10::str(hidden.sizes()));
      }
      return hidden.contiguous();
    }
    at::Tensor pooled;
    if (hidden.dim() == 3 && hidden.size(0) == batch.rows && hidden.size(1) == batch.seq_len) {
      if (config.pooling == "cls") {
        pooled = hidden.select(1, 0);
      } else {
        const auto m = mask.to(torch::kFloat32).unsqueeze(-1);
        pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9);
      }
    } else if (hidden.dim() == 2 && hidden.size(0) == batch.rows) {
      pooled = hidden;  // the model pools itself
    } else {
      return Internal("model output has shape " + c10::str(hidden.sizes()) + ", expected [" +
                      std::to_string(batch.rows) + ", " + std::to_string(batch.seq_len) +
                      ", H] or [" + std::to_string(batch.rows) + ", H]");
    }
    if (config.normalize) {
      pooled = pooled / pooled.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12);
    }
    return pooled.contiguous();
  }
};

TorchScriptRuntime::TorchScriptRuntime() : impl_(std::make_unique<Impl>()) {}
TorchScriptRuntime::~TorchScriptRuntime() = default;

Status TorchScriptRuntime::Load(const ModelConfig& config) {
  Impl& s = *impl_;
  if (s.loaded) return Internal("torchscript runtime: Load() called twice for " + config.name);
  if (config.pooling != "mean" && config.pooling != "cls") {
    return InvalidArgument("model " + config.name + ": pooling must be 'mean' or 'cls'");
  }
  if (config.dim < 0 || config.intra_op_threads < 0) {
    return InvalidArgument("model " + config.name + ": dim and intra_op_threads must be >= 0");
  }
  RETURN_IF_ERROR(CheckTorchDevice(config.device));
  const Device where = ParseDevice(config.device).value();
  const std::string path = config.ModelPath();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return NotFound("model " + config.name + ": no model file at " + path, "model_file_not_found");
  }
  s.config = config;
  s.threads = config.intra_op_threads > 0
                  ? config.intra_op_threads
                  : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  s.threads_applied_on = {};
  s.ApplyThreads();

  s.device = where.cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(where.index))
                       : torch::Device(torch::kCPU);
  RETURN_IF_ERROR(s.Fault());
  const int64_t rss_before = ResidentBytes();
  int64_t gpu_before = -1;
  try {
    if (where.cuda) {
      // CUDA starts lazily: its context, the caching allocator and this
      // thread's cuBLAS handle with its workspace come with the first ops on
      // the device. Start them before measuring: none of it is the model's.
      internal::StartCudaOn(where.index);
      gpu_before = CudaAllocatedBytes(where.index);
      // Each tensor is read into host memory and copied to the device.
      s.module = torch::jit::load(path, s.device);
    } else {
      const LargeTensorsOnHugePages weights_on_huge_pages;  // when the worker turned them on
      s.module = torch::jit::load(path, torch::kCPU);
    }
    s.module.eval();
    // The schema's first argument is `self`.
    s.takes_token_types = s.module.get_method("forward").function().getSchema().arguments().size() >= 4;
  } catch (...) {
    const Status failed = s.Failed("model " + config.name + ": cannot load " + path, std::current_exception());
    s.Release();
    return failed;
  }

  // Warm-up: the profiling graph executor records shapes on the first call
  // and optimises on the second, so run twice before serving. The output also
  // gives the width when shoal.json omits it. On one thread: a load often
  // runs beside serving at a lower priority (the worker's --load-nice), and
  // a team of threads would wait at every op for its slowest member, which
  // gets the CPU last. The graph does not depend on the thread count.
  Impl::ThreadsForPass(1);
  TokenBatch warm;
  warm.rows = 2;
  warm.seq_len = std::min(16, config.max_seq_len > 0 ? config.max_seq_len : 16);
  warm.input_ids.assign(static_cast<size_t>(warm.rows) * warm.seq_len, 1);
  warm.attention_mask.assign(warm.input_ids.size(), 1);
  Result<at::Tensor> pooled = Internal("unreached");
  try {
    pooled = s.Forward(warm);
    if (pooled.ok()) pooled = s.Forward(warm);
  } catch (...) {
    pooled = s.Failed("model " + config.name + ": warm-up forward failed", std::current_exception());
  }
  if (!pooled.ok()) {
    s.Release();
    return pooled.status();
  }
  const int out_dim = static_cast<int>(pooled->size(1));
  if (config.dim > 0 && out_dim != config.dim) {
    s.Release();
    return InvalidArgument("model " + config.name + ": shoal.json says dim " +
                           std::to_string(config.dim) + " but the model returns " +
                           std::to_string(out_dim));
  }
  s.dim = out_dim;
  // Out-of-range ids fail deep inside the interpreter with a generic error;
  // when the embedding table is recognisable, reject them up front instead.
  // On a GPU this is required: there an id out of range trips a device-side
  // assert, which leaves the process's CUDA context unusable.
  // Likewise segment ids (pairs), and, on a GPU, positions past the table.
  s.vocab_size = TableRows(s.module, kEmbeddingTableNames);
  s.token_types = TableRows(s.module, kTokenTypeTableNames);
  if (where.cuda && s.vocab_size == 0) {
    s.Release();
    std::string names;
    for (const std::string_view table : kEmbeddingTableNames)
      names += std::string(names.empty() ? "" : ", ") + "*." + std::string(table);
    return InvalidArgument("model " + config.name + ": on a GPU its token embedding table must be known, so that "
                               "out-of-range ids are refused before the pass; no 2-D parameter is named " + names,
                           "vocabulary_unknown");
  }
  const int64_t positions = TableRows(s.module, kPositionTableNames);
  if (where.cuda && positions > 0 && config.max_seq_len > positions) {
    s.Release();
    return InvalidArgument("model " + config.name + ": max_seq_len " + std::to_string(config.max_seq_len) +
                               " is more than its position table's " + std::to_string(positions) +
                               " rows (on a GPU a position past it would break the device for the process)",
                           "max_seq_len_too_large");
  }

  int64_t param_bytes = 0;
  for (const auto& p : s.module.parameters()) param_bytes += p.nbytes();
  for (const auto& b : s.module.buffers()) param_bytes += b.nbytes();
  // What the load and warm-up left resident: process memory on the CPU;
  // on a GPU, the CUDA allocator's live bytes on the device (its cache of
  // freed blocks is shared by every model on the device and not counted).
  int64_t grown = ResidentBytes() - rss_before;
  if (where.cuda) {
    const int64_t gpu_after = CudaAllocatedBytes(where.index);
    grown = gpu_before >= 0 && gpu_after >= 0 ? gpu_after - gpu_before : 0;
  }
  s.memory_bytes = std::max(grown, param_bytes);
  s.loaded = true;
  return Status::Ok();
}

Result<Embeddings> TorchScriptRuntime::Run(const TokenBatch& batch) {
  Impl& s = *impl_;
  if (!s.loaded) return Unavailable("torchscript runtime: model not loaded", "model_not_loaded");
  RETURN_IF_ERROR(s.Fault());
  RETURN_IF_ERROR(internal::CheckBatch(batch, s.config.max_seq_len));
  for (const int64_t id : batch.input_ids) {
    if (id < 0 || (s.vocab_size > 0 && id >= s.vocab_size)) {
      return InvalidArgument("token id " + std::to_string(id) + " is outside the vocabulary of " +
                                 s.config.name + " (size " + std::to_string(s.vocab_size) + ")",
                             "token_out_of_range");
    }
  }
  for (const int64_t t : batch.token_type_ids) {
    if (t < 0 || (s.token_types > 0 && t >= s.token_types)) {
      return InvalidArgument("segment id " + std::to_string(t) + " is outside the token type table of " +
                                 s.config.name + " (size " + std::to_string(s.token_types) +
                                 "): it does not take text pairs",
                             "token_type_out_of_range");
    }
  }
  try {
    if (s.device.is_cuda()) CudaUseDevice(s.device.index());
    s.ApplyThreads();
    Impl::ThreadsForPass(batch.threads > 0 ? batch.threads : s.threads);
    ASSIGN_OR_RETURN(at::Tensor pooled, s.Forward(batch));
    if (pooled.is_cuda()) pooled = pooled.to(torch::kCPU);
    Embeddings out;
    out.rows = batch.rows;
    out.dim = static_cast<int>(pooled.size(1));
    out.data.resize(static_cast<size_t>(out.rows) * out.dim);
    std::memcpy(out.data.data(), pooled.data_ptr<float>(), out.data.size() * sizeof(float));
    return out;
  } catch (...) {
    return s.Failed("model " + s.config.name + ": forward failed", std::current_exception());
  }
}

void TorchScriptRuntime::Unload() {
  impl_->Release();
  impl_->loaded = false;
  impl_->memory_bytes = 0;
}

bool TorchScriptRuntime::TakesThreadCount() const { return !impl_->device.is_cuda(); }

bool TorchScriptRuntime::FootprintIsHostMemory() const { return !impl_->device.is_cuda(); }

int64_t TorchScriptRuntime::MemoryBytes() const { return impl_->memory_bytes; }

int TorchScriptRuntime::Dim() const { return impl_->dim; }

bool TorchScriptRuntime::Available() const { return impl_->Fault().ok(); }

Status TorchScriptRuntime::DeviceHealth() const { return impl_->Fault(); }

}  // namespace shoal
