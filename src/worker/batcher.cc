#include "worker/batcher.h"

#include <algorithm>

namespace shoal {

Batcher::Batcher(const BatchingConfig& config, const Clock* clock) : config_(config), clock_(clock) {}

void Batcher::Add(std::unique_ptr<PendingWork> work) {
  held_tokens_ += work->tokens;
  held_rows_ += work->row_count();
  items_.push_back(std::move(work));
}

int64_t Batcher::FreeTokens() const { return std::max<int64_t>(0, config_.max_batch_tokens - held_tokens_); }
int64_t Batcher::FreeRows() const { return std::max<int64_t>(0, config_.max_batch_size - held_rows_); }

int64_t Batcher::OldestPublishedMonoUs() const {
  int64_t oldest = 0;
  for (const auto& w : items_)
    if (oldest == 0 || w->published_mono_us < oldest) oldest = w->published_mono_us;
  return oldest;
}

int64_t Batcher::UsUntilReady() const {
  if (items_.empty()) return -1;
  if (held_tokens_ >= config_.max_batch_tokens || held_rows_ >= config_.max_batch_size) return 0;
  int64_t waited = clock_->NowMonoUs() - items_.front()->enqueued_mono_us;
  return std::max<int64_t>(0, config_.max_wait_us - waited);
}

std::vector<std::unique_ptr<PendingWork>> Batcher::Take(int64_t token_cap, bool* capped, size_t max_messages) {
  std::vector<std::unique_ptr<PendingWork>> out;
  int64_t tokens = 0, rows = 0;
  const int64_t max_tokens = token_cap > 0 ? std::min(token_cap, config_.max_batch_tokens) : config_.max_batch_tokens;
  if (capped != nullptr) *capped = false;
  while (!items_.empty() && (max_messages == 0 || out.size() < max_messages)) {
    auto& next = items_.front();
    int64_t t = next->tokens, r = next->row_count();
    if (!out.empty() && (tokens + t > max_tokens || rows + r > config_.max_batch_size)) {
      if (capped != nullptr) *capped = tokens + t <= config_.max_batch_tokens && rows + r <= config_.max_batch_size;
      break;
    }
    tokens += t;
    rows += r;
    held_tokens_ -= t;
    held_rows_ -= r;
    out.push_back(std::move(next));
    items_.pop_front();
  }
  return out;
}

std::vector<std::vector<RowRef>> PlanForwardPasses(
    const std::vector<std::unique_ptr<PendingWork>>& batch, int64_t max_tokens, int max_rows) {
  std::vector<RowRef> all;
  for (int i = 0; i < static_cast<int>(batch.size()); ++i)
    for (int r = 0; r < static_cast<int>(batch[i]->rows.size()); ++r)
      all.push_back({i, r, static_cast<int>(batch[i]->rows[r].size())});
  std::stable_sort(all.begin(), all.end(), [](const RowRef& a, const RowRef& b) { return a.len < b.len; });
  std::vector<std::vector<RowRef>> passes;
  std::vector<RowRef> cur;
  for (const RowRef& row : all) {
    // Sorted ascending, so this row is the longest of the pass if added.
    int64_t cost = static_cast<int64_t>(cur.size() + 1) * row.len;
    if (!cur.empty() && (cost > max_tokens || static_cast<int>(cur.size()) >= max_rows)) {
      passes.push_back(std::move(cur));
      cur.clear();
    }
    cur.push_back(row);
  }
  if (!cur.empty()) passes.push_back(std::move(cur));
  return passes;
}

}  // namespace shoal
