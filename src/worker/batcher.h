// Batcher: decides when the work a worker has pulled becomes a batch, and
// how a batch is cut into forward passes. Pure logic over an injected Clock,
// not thread-safe (the worker guards it with its own mutex).
//
// Budget is in tokens: a batch takes the oldest pulled work until its tokens
// reach max_batch_tokens or its rows max_batch_size. It flushes when full or
// when the oldest item has waited max_wait_us. Rows are then sorted by length
// and split so that each forward pass's padded cost (rows x longest row)
// stays within max_batch_tokens.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/model_config.h"
#include "queue/nats_client.h"
#include "wire/work_message.h"
#include "common/byte_budget.h"
#include "worker/progress_keeper.h"

namespace shoal {

// One pulled message, tokenized and waiting to run.
struct PendingWork {
  Delivery delivery{nullptr, nullptr};
  wire::WorkHeaders headers;
  std::vector<std::vector<int32_t>> rows;  // token ids incl. [CLS]/[SEP]
  // Text pairs: per row, where the second text starts (token type 1 from
  // there). Empty for single texts.
  std::vector<int32_t> second_starts;
  std::vector<int32_t> token_counts;       // per row (after truncation)
  // Item work (a runtime that takes whole inputs): the inputs, untokenized.
  // Each counts as one row and one token of the batch budget.
  std::vector<std::string> items;
  bool truncated_any = false;
  int64_t tokens = 0;                      // sum of row lengths
  int64_t enqueued_mono_us = 0;           // when the worker pulled it
  int64_t published_mono_us = 0;          // when the gateway queued it (clock's monotonic time)
  // Keeps pulled work ours from its pull until it is answered, however
  // long it waits behind other passes: notes it in progress to JetStream.
  ProgressKeeper::Watch progress;
  // Its payload's share of the worker's bound on payloads fetched from the
  // blob store (empty for a payload that came in the message).
  ByteBudget::Hold payload_hold;
  bool streamed = false;  // partial output went to its caller

  int64_t row_count() const { return static_cast<int64_t>(items.empty() ? rows.size() : items.size()); }
};

class Batcher {
 public:
  Batcher(const BatchingConfig& config, const Clock* clock);

  void Add(std::unique_ptr<PendingWork> work);
  size_t size() const { return items_.size(); }
  int64_t held_tokens() const { return held_tokens_; }
  int64_t held_rows() const { return held_rows_; }
  // Tokens the worker may still pull before holding a full batch.
  int64_t FreeTokens() const;
  // Rows the worker may still pull before holding a full batch.
  int64_t FreeRows() const;
  // The earliest published_mono_us of the work held (0 when none).
  int64_t OldestPublishedMonoUs() const;
  // -1: nothing held; 0: a batch is ready now; else microseconds to wait.
  int64_t UsUntilReady() const;
  // Removes the next batch: oldest first, at least one item, then as many
  // as fit the token and row budget. `token_cap` > 0 lowers the token
  // budget of this batch only; `capped` (may be null) is set when the cap
  // left out an item the budget would have taken. `max_messages` > 0
  // also bounds the number of messages taken.
  std::vector<std::unique_ptr<PendingWork>> Take(int64_t token_cap = 0, bool* capped = nullptr,
                                                 size_t max_messages = 0);

 private:
  BatchingConfig config_;
  const Clock* clock_;
  std::deque<std::unique_ptr<PendingWork>> items_;
  int64_t held_tokens_ = 0;
  int64_t held_rows_ = 0;
};

// A row of some item in a batch.
struct RowRef {
  int item = 0;
  int row = 0;
  int len = 0;
};

// Sorts every row of `batch` by length and splits them into forward passes
// with rows <= max_rows and rows * longest <= max_tokens (a single row longer
// than max_tokens still gets a pass of its own).
std::vector<std::vector<RowRef>> PlanForwardPasses(
    const std::vector<std::unique_ptr<PendingWork>>& batch, int64_t max_tokens, int max_rows);

}  // namespace shoal
