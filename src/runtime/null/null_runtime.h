// NullRuntime ("null"): runs no model. Returns deterministic pseudo-random
// embeddings derived from each row's real tokens, so the whole serving path
// can be measured without model cost. Same tokens give the same vector
// regardless of padding or batch position. For an item task (ocr,
// generate) it takes whole inputs and answers each with {bytes: <size>},
// which measures the binary path (transport, blob offload) alone. Not
// thread-safe (see Runtime).
#pragma once

#include "runtime/runtime.h"

namespace shoal {

class NullRuntime final : public Runtime {
 public:
  static constexpr int kDefaultDim = 384;

  // Records dim (config.dim, or kDefaultDim when 0) and normalisation. Never
  // touches the filesystem.
  Status Load(const ModelConfig& config) override;
  // O(rows * (seq_len + dim)); kInvalidArgument on inconsistent shapes,
  // kUnavailable before Load().
  Result<Embeddings> Run(const TokenBatch& batch) override;
  bool TakesItems() const override { return items_; }
  Result<std::vector<std::string>> RunItems(const std::vector<std::string>& items,
                                            const PartialSink& partial) override;
  void Unload() override { loaded_ = false; }
  int64_t MemoryBytes() const override { return 0; }
  int Dim() const override { return dim_; }

 private:
  bool loaded_ = false;
  int dim_ = 0;
  bool normalize_ = true;
  bool items_ = false;
};

}  // namespace shoal
