// ModelConfig: what a model directory declares about itself in `shoal.json`
// (name, task, runtime, artifacts, limits, pooling, tokenizer, batching
// defaults). Workers load it from disk; the gateway learns it through the
// catalog. Plain data plus Validate(); parsing lives in model_config.cc.
#pragma once

#include <cstdint>
#include <string>
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

struct ModelConfig {
  std::string name;                 // public model id, e.g. "minilm-l6"
  std::string task = "embed";       // only "embed" today
  std::string runtime = "torchscript";  // "torchscript" | "null"
  std::string model_file = "model.pt";  // relative to dir
  std::string dir;                  // absolute directory, filled by the loader
  int max_seq_len = 256;            // tokens incl. [CLS]/[SEP]
  int dim = 0;                      // embedding width
  std::string pooling = "mean";     // "mean" | "cls"
  bool normalize = true;            // L2-normalise embeddings
  int intra_op_threads = 0;         // 0: worker default
  TokenizerConfig tokenizer;
  BatchingConfig batching;

  Status Validate() const;
  std::string ModelPath() const { return dir + "/" + model_file; }
  std::string VocabPath() const { return dir + "/" + tokenizer.vocab_file; }
};

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
