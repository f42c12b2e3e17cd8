// ModelConfig: what a model directory declares about itself in `shoal.json`
// (name, task, runtime, artifacts, limits, pooling, tokenizer, batching
// defaults). Workers load it from disk; the gateway learns it through the
// catalog. Plain data plus Validate(); parsing lives in model_config.cc.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace shoal {

struct TokenizerConfig {
  std::string type = "wordpiece";  // only "wordpiece" today
  std::string vocab_file = "vocab.txt";  // relative to the model directory
  bool lowercase = true;
  bool strip_accents = true;
  bool tokenize_chinese_chars = true;
};

struct BatchingConfig {
  int64_t max_batch_tokens = 8192;  // padded tokens (rows * longest) per batch
  int max_batch_size = 64;          // rows per batch
  int64_t max_wait_us = 2000;       // how long to wait to fill a batch
};

// How to run an out-of-process runtime ("runtime": "process"): the worker
// starts `command` (argv; a relative program path is taken from the model
// directory) in `cwd` (default: the model directory) with `env` added, and
// speaks docs/runtime-protocol.md with it over a Unix socket.
struct ProcessConfig {
  std::vector<std::string> command;
  std::vector<std::pair<std::string, std::string>> env;
  std::string cwd;
  int64_t start_timeout_ms = 60000;    // spawn to a loaded model
  int64_t request_timeout_ms = 60000;  // one batch
  int64_t max_frame_bytes = int64_t{64} << 20;
  int64_t health_interval_ms = 1000;   // liveness checks (ping when idle)
  int64_t max_restart_backoff_ms = 10000;
  // Consecutive restarts that fail to start the process (spawn, connect,
  // hello or load) before the runtime gives up and the model is marked
  // failed; 0: never give up.
  int max_failed_starts = 5;
};

// The simulated accelerator ("runtime": "sim"): batch time = fixed_us +
// per_padded_token_us x rows x seq_len, spent sleeping. Defaults: MiniLM-L6
// on libtorch, 2 threads, measured on a 2-vCPU machine (BENCHMARKS.md).
struct SimConfig {
  int64_t fixed_us = 11000;
  double per_padded_token_us = 166;
  int max_batch_rows = 0;                        // 0: no limit
  int64_t memory_bytes = int64_t{96} << 20;      // footprint it reports
  int64_t load_ms = 300;
};

struct ModelConfig {
  // Upper bounds Validate() enforces: beyond them a value is a mistake that
  // would exhaust memory (dim, rows per batch) or overflow a clock (waits).
  static constexpr int kMaxDim = 1 << 20;
  static constexpr int kMaxBatchSize = 65536;
  static constexpr int64_t kMaxWaitUs = 60'000'000;
  // Of the name as NATS sees it (see Validate): 255 less "shoal_".
  static constexpr size_t kMaxNameTokenBytes = 249;

  std::string name;                 // public model id, e.g. "minilm-l6"
  // What the model computes. From tokenized text, one row of floats per
  // input: "embed" (a vector), "score" (a pair -> one relevance score;
  // cross-encoders) or "classify" (a text -> one probability per label).
  // From whole inputs the runtime takes itself (WorkBody::items): "ocr" (an
  // image -> text with word boxes) or "generate" (a completion request).
  std::string task = "embed";
  // "torchscript" | "process" | "sim" | "null" | "tesseract" | "openai"
  std::string runtime = "torchscript";
  std::string model_file = "model.pt";  // relative to dir
  std::string dir;                  // absolute directory, filled by the loader
  int max_seq_len = 256;            // tokens incl. [CLS]/[SEP]
  int dim = 0;                      // embedding width
  std::string pooling = "mean";     // "mean" | "cls"
  bool normalize = true;            // L2-normalise embeddings (task embed)
  // Applied by the worker to the model's raw output rows: "none",
  // "sigmoid" or "softmax". Empty: by task (embed none, score sigmoid,
  // classify softmax).
  std::string activation;
  std::vector<std::string> labels;  // classify: one name per output column
  int intra_op_threads = 0;         // 0: worker default
  // Where a "torchscript" model runs: "cpu" or "cuda[:N]". Set by the
  // worker (--device), not read from shoal.json: a worker serves one device.
  std::string device = "cpu";
  TokenizerConfig tokenizer;
  BatchingConfig batching;
  ProcessConfig process;            // runtime "process" only
  SimConfig sim;                    // runtime "sim" only
  std::string config_json;          // the whole shoal.json, as read

  Status Validate() const;
  // `activation`, or the task's default when it is empty.
  std::string EffectiveActivation() const;
  // Whether inputs are text pairs ([CLS] a [SEP] b [SEP]).
  bool TakesPairs() const { return task == "score"; }
  // Whether the task's inputs are whole items rather than tokenized text.
  bool ItemTask() const { return task == "ocr" || task == "generate"; }
  std::string ModelPath() const { return dir + "/" + model_file; }
  std::string VocabPath() const { return dir + "/" + tokenizer.vocab_file; }
};

// Whether a model name's byte `c` stands as it is in the name's NATS form
// (wire::ModelToToken, the queue subject and consumer name); any other byte
// is written as three ('~' and two hex digits).
inline bool KeptInModelToken(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

// Parses a shoal.json document; `dir` is recorded as the model directory.
Result<ModelConfig> ParseModelConfig(const std::string& json_text,
                                     const std::string& dir);
// Reads `<dir>/shoal.json`.
Result<ModelConfig> LoadModelConfig(const std::string& dir);
// Every immediate subdirectory of `repo_dir` that holds a shoal.json.
Result<std::vector<ModelConfig>> LoadModelRepository(const std::string& repo_dir);

// Serialises the fields the gateway needs (catalog entry) as JSON.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace shoal
