// SimRuntime ("runtime": "sim"): a simulated accelerator for cluster-scale
// experiments on a small machine. A batch takes
//   fixed_us + per_padded_token_us x rows x seq_len
// of wall time spent sleeping (not computing), so dozens of simulated
// devices fit on two cores; it rejects batches over max_batch_rows, counts
// memory_bytes as its footprint and takes load_ms to load. Embeddings are
// deterministic per row (a hash of its token ids), L2-normalised, so callers
// can check answers. The default profile is MiniLM-L6 on libtorch measured
// on a 2-vCPU machine (docs/BENCHMARKS.md); a GPU measurement can be given
// in shoal.json instead.
#pragma once

#include <cstdint>
#include <functional>

#include "runtime/runtime.h"

namespace shoal {

class SimRuntime final : public Runtime {
 public:
  // How the runtime waits; tests replace it to check the cost model
  // without sleeping.
  using Sleeper = std::function<void(int64_t us)>;
  explicit SimRuntime(Sleeper sleeper = nullptr);

  Status Load(const ModelConfig& config) override;
  Result<Embeddings> Run(const TokenBatch& batch) override;
  void Unload() override {}
  int64_t MemoryBytes() const override { return config_.sim.memory_bytes; }
  int Dim() const override { return config_.dim; }

  // The simulated time of one batch of this shape.
  int64_t CostUs(int rows, int seq_len) const;

 private:
  ModelConfig config_;
  Sleeper sleep_;
};

}  // namespace shoal
