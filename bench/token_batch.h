// A deterministic batch of token ids for the runtime benchmarks: every row
// [CLS] ... [SEP], `seq_len` tokens, no padding.
#pragma once

#include "runtime/runtime.h"

namespace shoal::bench {

inline TokenBatch MakeBatch(int rows, int seq_len) {
  TokenBatch b;
  b.rows = rows;
  b.seq_len = seq_len;
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < seq_len; ++t) {
      b.input_ids.push_back(t == 0 ? 101 : t == seq_len - 1 ? 102 : 1000 + (r * 31 + t * 7) % 20000);
      b.attention_mask.push_back(1);
    }
  return b;
}

}  // namespace shoal::bench
