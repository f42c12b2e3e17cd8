#include "runtime/sim/sim_runtime.h"

#include <chrono>
#include <cmath>
#include <thread>

namespace shoal {

SimRuntime::SimRuntime(Sleeper sleeper) : sleep_(std::move(sleeper)) {
  if (!sleep_) sleep_ = [](int64_t us) { std::this_thread::sleep_for(std::chrono::microseconds(us)); };
}

Status SimRuntime::Load(const ModelConfig& config) {
  if (config.dim <= 0) return InvalidArgument("model " + config.name + ": the sim runtime needs \"dim\" > 0");
  config_ = config;
  sleep_(config_.sim.load_ms * 1000);
  return Status::Ok();
}

int64_t SimRuntime::CostUs(int rows, int seq_len) const {
  return config_.sim.fixed_us +
         static_cast<int64_t>(std::llround(config_.sim.per_padded_token_us * static_cast<double>(rows) * seq_len));
}

Result<Embeddings> SimRuntime::Run(const TokenBatch& batch) {
  if (batch.rows <= 0 || batch.seq_len <= 0 ||
      batch.input_ids.size() != static_cast<size_t>(batch.rows) * batch.seq_len) {
    return InvalidArgument("sim runtime: malformed batch");
  }
  if (config_.sim.max_batch_rows > 0 && batch.rows > config_.sim.max_batch_rows) {
    return InvalidArgument("sim runtime: " + std::to_string(batch.rows) + " rows exceed max_batch_rows " +
                           std::to_string(config_.sim.max_batch_rows));
  }
  sleep_(CostUs(batch.rows, batch.seq_len));
  Embeddings out;
  out.rows = batch.rows;
  out.dim = config_.dim;
  out.data.resize(static_cast<size_t>(out.rows) * out.dim);
  for (int r = 0; r < batch.rows; ++r) {
    // FNV-1a over the row's real tokens seeds a small generator.
    uint64_t h = 1469598103934665603ull;
    for (int t = 0; t < batch.seq_len; ++t) {
      const size_t i = static_cast<size_t>(r) * batch.seq_len + t;
      if (!batch.attention_mask.empty() && batch.attention_mask[i] == 0) continue;
      h = (h ^ static_cast<uint64_t>(batch.input_ids[i])) * 1099511628211ull;
    }
    float* row = out.data.data() + static_cast<size_t>(r) * out.dim;
    double norm = 0;
    for (int k = 0; k < out.dim; ++k) {
      h ^= h >> 33;
      h *= 0xff51afd7ed558ccdull;
      h ^= h >> 33;
      row[k] = static_cast<float>(static_cast<double>(h >> 11) / 9007199254740992.0 - 0.5);
      norm += static_cast<double>(row[k]) * row[k];
    }
    const float inv = norm > 0 ? static_cast<float>(1.0 / std::sqrt(norm)) : 0.f;
    for (int k = 0; k < out.dim; ++k) row[k] *= inv;
  }
  return out;
}

}  // namespace shoal
