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

TEST(ByteBudget, UnboundedTakesEverything) {
  ByteBudget budget(0);
  ByteBudget::Hold a = budget.Take(int64_t{1} << 40);
  ByteBudget::Hold b = budget.Take(int64_t{1} << 40);
  EXPECT_TRUE(a.held() && b.held());
  EXPECT_EQ(budget.held(), int64_t{2} << 40);
}

}  // namespace
}  // namespace shoal
