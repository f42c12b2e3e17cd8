#include "runtime/null/null_runtime.h"

#include <cmath>

#include "runtime/internal/batch_check.h"

namespace shoal {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

Status NullRuntime::Load(const ModelConfig& config) {
  if (config.dim < 0) return InvalidArgument("null runtime: dim must be >= 0");
  dim_ = config.dim > 0 ? config.dim : kDefaultDim;
  normalize_ = config.normalize;
  items_ = config.ItemTask();
  loaded_ = true;
  return Status::Ok();
}

Result<Embeddings> NullRuntime::Run(const TokenBatch& batch) {
  if (!loaded_) return Unavailable("null runtime: not loaded");
  RETURN_IF_ERROR(internal::CheckBatch(batch, /*max_seq_len=*/0));
  Embeddings out;
  out.rows = batch.rows;
  out.dim = dim_;
  out.data.resize(static_cast<size_t>(batch.rows) * dim_);
  for (int r = 0; r < batch.rows; ++r) {
    // FNV-1a over the real tokens only, so padding does not change the row.
    uint64_t h = 0xCBF29CE484222325ull;
    const size_t base = static_cast<size_t>(r) * batch.seq_len;
    for (int t = 0; t < batch.seq_len; ++t) {
      if (batch.attention_mask[base + t] == 0) continue;
      h = (h ^ static_cast<uint64_t>(batch.input_ids[base + t])) * 0x100000001B3ull;
    }
    float* row = out.data.data() + static_cast<size_t>(r) * dim_;
    double sq = 0;
    for (int d = 0; d < dim_; ++d) {
      // Top 24 bits -> [-1, 1).
      const float v = static_cast<float>(SplitMix64(h) >> 40) * (2.0f / 16777216.0f) - 1.0f;
      row[d] = v;
      sq += static_cast<double>(v) * v;
    }
    if (normalize_ && sq > 0) {
      const float inv = static_cast<float>(1.0 / std::sqrt(sq));
      for (int d = 0; d < dim_; ++d) row[d] *= inv;
    }
  }
  return out;
}

Result<std::vector<std::string>> NullRuntime::RunItems(const std::vector<std::string>& items,
                                                      const PartialSink& partial) {
  (void)partial;
  if (!loaded_) return Unavailable("null runtime: not loaded");
  std::vector<std::string> out;
  out.reserve(items.size());
  for (const auto& item : items) {
    // {"bytes": size} as MessagePack: fixmap(1), fixstr "bytes", uint64.
    std::string doc = "\x81\xa5" "bytes\xcf";
    for (int shift = 56; shift >= 0; shift -= 8) doc.push_back(static_cast<char>((item.size() >> shift) & 0xff));
    out.push_back(std::move(doc));
  }
  return out;
}

}  // namespace shoal
