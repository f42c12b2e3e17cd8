#include "worker/batcher.h"

#include <gtest/gtest.h>

namespace shoal {
namespace {

std::unique_ptr<PendingWork> Work(const FakeClock& clock, std::vector<int> row_lens) {
  auto w = std::make_unique<PendingWork>();
  for (int len : row_lens) {
    w->rows.push_back(std::vector<int32_t>(len, 7));
    w->tokens += len;
  }
  w->enqueued_mono_us = clock.NowMonoUs();
  return w;
}

BatchingConfig Config(int64_t tokens, int rows, int64_t wait_us) {
  BatchingConfig c;
  c.max_batch_tokens = tokens;
  c.max_batch_size = rows;
  c.max_wait_us = wait_us;
  return c;
}

TEST(Batcher, EmptyIsNeverReady) {
  FakeClock clock;
  Batcher b(Config(100, 8, 1000), &clock);
  EXPECT_EQ(b.UsUntilReady(), -1);
  EXPECT_TRUE(b.Take().empty());
}

TEST(Batcher, WaitsForMaxWaitThenFlushes) {
  FakeClock clock;
  Batcher b(Config(100, 8, 1000), &clock);
  b.Add(Work(clock, {10}));
  EXPECT_EQ(b.UsUntilReady(), 1000);
  clock.AdvanceUs(400);
  EXPECT_EQ(b.UsUntilReady(), 600);
  clock.AdvanceUs(600);
  EXPECT_EQ(b.UsUntilReady(), 0);
  auto batch = b.Take();
  ASSERT_EQ(batch.size(), 1u);
  EXPECT_EQ(b.held_tokens(), 0);
}

TEST(Batcher, FlushesWhenTokenBudgetIsFull) {
  FakeClock clock;
  Batcher b(Config(100, 64, 1'000'000), &clock);
  b.Add(Work(clock, {60}));
  EXPECT_GT(b.UsUntilReady(), 0);
  EXPECT_EQ(b.FreeTokens(), 40);
  b.Add(Work(clock, {50}));
  EXPECT_EQ(b.UsUntilReady(), 0);
  EXPECT_EQ(b.FreeTokens(), 0);
  // The second item does not fit the budget with the first: it waits.
  auto first = b.Take();
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0]->tokens, 60);
  EXPECT_EQ(b.held_tokens(), 50);
}

TEST(Batcher, FlushesWhenRowCapIsFull) {
  FakeClock clock;
  Batcher b(Config(10'000, 4, 1'000'000), &clock);
  b.Add(Work(clock, {5, 5}));
  EXPECT_GT(b.UsUntilReady(), 0);
  b.Add(Work(clock, {5, 5}));
  EXPECT_EQ(b.UsUntilReady(), 0);
  EXPECT_EQ(b.Take().size(), 2u);
}

TEST(Batcher, TakesAtMostTheMessagesAskedFor) {
  FakeClock clock;
  Batcher b(Config(100, 8, 1000), &clock);
  for (int i = 0; i < 3; ++i) b.Add(Work(clock, {5}));
  EXPECT_EQ(b.Take(0, nullptr, 1).size(), 1u);
  EXPECT_EQ(b.size(), 2u);
  EXPECT_EQ(b.held_rows(), 2);
  EXPECT_EQ(b.Take(0, nullptr, 0).size(), 2u);  // 0: the budget alone
}

TEST(Batcher, OversizedItemStillRunsAlone) {
  FakeClock clock;
  Batcher b(Config(100, 4, 1000), &clock);
  b.Add(Work(clock, {300}));
  b.Add(Work(clock, {5}));
  auto batch = b.Take();
  ASSERT_EQ(batch.size(), 1u);
  EXPECT_EQ(batch[0]->tokens, 300);
  EXPECT_EQ(b.size(), 1u);
}

TEST(Batcher, TakesOldestFirst) {
  FakeClock clock;
  Batcher b(Config(1000, 64, 1000), &clock);
  auto a = Work(clock, {3});
  a->headers.request_id = "a";
  b.Add(std::move(a));
  clock.AdvanceUs(10);
  auto c = Work(clock, {3});
  c->headers.request_id = "c";
  b.Add(std::move(c));
  auto batch = b.Take();
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[0]->headers.request_id, "a");
  EXPECT_EQ(batch[1]->headers.request_id, "c");
}

TEST(Batcher, TokenCapShortensOneBatchAndSaysSo) {
  FakeClock clock;
  Batcher b(Config(1000, 64, 1000), &clock);
  for (int i = 0; i < 6; ++i) b.Add(Work(clock, {10}));
  bool capped = false;
  auto first = b.Take(25, &capped);  // two items fit the cap
  EXPECT_EQ(first.size(), 2u);
  EXPECT_TRUE(capped);
  EXPECT_EQ(b.held_tokens(), 40);
  EXPECT_EQ(b.held_rows(), 4);
  // A cap below one item still takes the oldest one.
  auto second = b.Take(5, &capped);
  EXPECT_EQ(second.size(), 1u);
  EXPECT_TRUE(capped);
  // A cap above the budget changes nothing, and what is left fits: not capped.
  auto rest = b.Take(5000, &capped);
  EXPECT_EQ(rest.size(), 3u);
  EXPECT_FALSE(capped);
  EXPECT_EQ(b.held_tokens(), 0);
}

TEST(Batcher, TokenCapDoesNotClaimABatchTheBudgetEndedAnyway) {
  FakeClock clock;
  Batcher b(Config(30, 64, 1000), &clock);
  for (int i = 0; i < 4; ++i) b.Add(Work(clock, {10}));
  bool capped = true;
  auto batch = b.Take(100, &capped);  // the budget (30) ends it, not the cap
  EXPECT_EQ(batch.size(), 3u);
  EXPECT_FALSE(capped);
  batch = b.Take(0, &capped);  // 0: no cap
  EXPECT_EQ(batch.size(), 1u);
  EXPECT_FALSE(capped);
}

TEST(PlanForwardPasses, SortsByLengthAndRespectsPaddedCost) {
  FakeClock clock;
  std::vector<std::unique_ptr<PendingWork>> batch;
  batch.push_back(Work(clock, {40, 4}));
  batch.push_back(Work(clock, {5, 38}));
  auto passes = PlanForwardPasses(batch, /*max_tokens=*/80, /*max_rows=*/8);
  // Short rows together (4, 5), long rows together (38, 40): 2 x 40 = 80 fits.
  ASSERT_EQ(passes.size(), 2u);
  ASSERT_EQ(passes[0].size(), 2u);
  EXPECT_EQ(passes[0][0].len, 4);
  EXPECT_EQ(passes[0][1].len, 5);
  EXPECT_EQ(passes[1][0].len, 38);
  EXPECT_EQ(passes[1][1].len, 40);
  EXPECT_EQ(passes[1][1].item, 0);
  EXPECT_EQ(passes[1][1].row, 0);
  for (const auto& p : passes) {
    int longest = 0;
    for (const auto& r : p) longest = std::max(longest, r.len);
    EXPECT_LE(static_cast<int64_t>(p.size()) * longest, 80);
  }
}

TEST(PlanForwardPasses, RespectsRowCapAndKeepsEveryRow) {
  FakeClock clock;
  std::vector<std::unique_ptr<PendingWork>> batch;
  batch.push_back(Work(clock, std::vector<int>(10, 3)));
  auto passes = PlanForwardPasses(batch, 1000, 4);
  ASSERT_EQ(passes.size(), 3u);
  EXPECT_EQ(passes[0].size() + passes[1].size() + passes[2].size(), 10u);
  EXPECT_EQ(passes[2].size(), 2u);
}

}  // namespace
}  // namespace shoal
