#include "worker/cancelled_requests.h"

#include <string>

#include <gtest/gtest.h>

namespace shoal {
namespace {

TEST(CancelledRequests, RemembersForAWhileAndABoundedNumber) {
  CancelledRequests c;
  c.Add("r1", 0);
  c.Add("", 0);  // no id: nothing
  EXPECT_TRUE(c.Contains("r1"));
  EXPECT_FALSE(c.Contains(""));
  EXPECT_FALSE(c.Contains("r2"));
  c.Add("r1", 1);  // again: still one entry
  EXPECT_EQ(c.size(), 1u);
  // Forgotten once its time is up (checked as notices come).
  c.Add("r2", CancelledRequests::kRememberUs);
  EXPECT_FALSE(c.Contains("r1"));
  EXPECT_TRUE(c.Contains("r2"));
  // A flood keeps the newest kMaxRemembered.
  for (size_t i = 0; i < CancelledRequests::kMaxRemembered + 10; ++i)
    c.Add("flood" + std::to_string(i), CancelledRequests::kRememberUs + 1);
  EXPECT_EQ(c.size(), CancelledRequests::kMaxRemembered);
  EXPECT_FALSE(c.Contains("r2"));
  EXPECT_FALSE(c.Contains("flood0"));
  EXPECT_TRUE(c.Contains("flood" + std::to_string(CancelledRequests::kMaxRemembered + 9)));
}

}  // namespace
}  // namespace shoal
