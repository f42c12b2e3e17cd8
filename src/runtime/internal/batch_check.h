// Shape checks on a TokenBatch shared by the runtime adapters.
#pragma once

#include <string>

#include "runtime/runtime.h"

namespace shoal::internal {

// kInvalidArgument unless rows, seq_len and the vectors agree. A positive
// max_seq_len also bounds seq_len.
inline Status CheckBatch(const TokenBatch& b, int max_seq_len) {
  if (b.rows <= 0 || b.seq_len <= 0) {
    return InvalidArgument("token batch is empty (rows=" + std::to_string(b.rows) +
                           ", seq_len=" + std::to_string(b.seq_len) + ")");
  }
  const size_t n = static_cast<size_t>(b.rows) * static_cast<size_t>(b.seq_len);
  if (b.input_ids.size() != n || b.attention_mask.size() != n) {
    return InvalidArgument("token batch: expected " + std::to_string(n) +
                           " ids and mask entries, got " + std::to_string(b.input_ids.size()) +
                           " and " + std::to_string(b.attention_mask.size()));
  }
  if (!b.token_type_ids.empty() && b.token_type_ids.size() != n) {
    return InvalidArgument("token batch: expected " + std::to_string(n) + " token type ids, got " +
                           std::to_string(b.token_type_ids.size()));
  }
  if (max_seq_len > 0 && b.seq_len > max_seq_len) {
    return InvalidArgument("token batch: seq_len " + std::to_string(b.seq_len) +
                               " exceeds the model's max_seq_len " + std::to_string(max_seq_len),
                           "input_too_long");
  }
  return Status::Ok();
}

}  // namespace shoal::internal
