#include "common/byte_budget.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>

namespace shoal {
namespace {

TEST(ByteBudget, TakesWhatFitsAndOneLargerPayloadAlone) {
  MetricsRegistry metrics;
  Gauge* gauge = metrics.GetGauge("held_bytes", "");
  ByteBudget budget(100, gauge);
  ByteBudget::Hold a = budget.Take(60);
  ASSERT_TRUE(a.held());
  EXPECT_FALSE(budget.Take(41).held());  // 101 > 100
  ByteBudget::Hold b = budget.Take(40);
  ASSERT_TRUE(b.held());
  EXPECT_EQ(budget.held(), 100);
  EXPECT_EQ(gauge->Value(), 100);
  a.Reset();
  b = ByteBudget::Hold();  // move-assigning gives the old hold's bytes back
  EXPECT_EQ(budget.held(), 0);
  EXPECT_EQ(gauge->Value(), 0);
  // Larger than the whole limit: taken when nothing else is held, alone.
  ByteBudget::Hold huge = budget.Take(500);
  ASSERT_TRUE(huge.held());
  EXPECT_FALSE(budget.Take(1).held());
}

TEST(ByteBudget, ATakeWaitsForBytesGivenBack) {
  ByteBudget budget(10);
  auto first = std::make_unique<ByteBudget::Hold>(budget.Take(10));
  auto waiting = std::async(std::launch::async, [&] { return budget.Take(5, 10'000).held(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  first.reset();  // destroyed: its bytes are given back
  EXPECT_TRUE(waiting.get());
  EXPECT_EQ(budget.held(), 0);  // the waiter's hold was a temporary
}

// First come, first served: a large take that found no room keeps its place
// (its ticket), and smaller takes that would fit do not go ahead of it.
TEST(ByteBudget, AWaitingTakeIsNotOvertaken) {
  ByteBudget budget(100);
  ByteBudget::Hold first = budget.Take(40);
  ByteBudget::Ticket big_ticket;
  EXPECT_FALSE(budget.Take(90, 0, &big_ticket).held());  // 130 > 100: waits, in line
  EXPECT_TRUE(big_ticket.waiting());
  ByteBudget::Ticket small_ticket;
  EXPECT_FALSE(budget.Take(10, 0, &small_ticket).held());  // would fit, but the big one came first
  first.Reset();
  EXPECT_FALSE(budget.Take(10, 0, &small_ticket).held());  // still behind it
  ByteBudget::Hold big = budget.Take(90, 0, &big_ticket);
  ASSERT_TRUE(big.held());
  EXPECT_FALSE(big_ticket.waiting());
  EXPECT_TRUE(budget.Take(10, 0, &small_ticket).held());  // now first in line, and fits
  // A waiter that gives up (its ticket destroyed) holds no one back.
  {
    ByteBudget::Ticket gone;
    EXPECT_FALSE(budget.Take(50, 0, &gone).held());
  }
  big.Reset();
  EXPECT_TRUE(budget.Take(60).held());
}

TEST(ByteBudget, UnboundedTakesEverything) {
  ByteBudget budget(0);
  ByteBudget::Hold a = budget.Take(int64_t{1} << 40);
  ByteBudget::Hold b = budget.Take(int64_t{1} << 40);
  EXPECT_TRUE(a.held() && b.held());
  EXPECT_EQ(budget.held(), int64_t{2} << 40);
}

}  // namespace
}  // namespace shoal
