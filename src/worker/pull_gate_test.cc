#include "worker/pull_gate.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace shoal {
namespace {

TEST(PullGateTest, UnboundedGateAlwaysHasRoom) {
  PullGate gate(0);
  EXPECT_FALSE(gate.bounded());
  for (int i = 0; i < 10; ++i) gate.Take();
  EXPECT_TRUE(gate.WaitForRoom(0));
}

TEST(PullGateTest, RoomUntilTheLimitIsHeldThenTimesOut) {
  PullGate gate(2);
  EXPECT_TRUE(gate.WaitForRoom(0));
  gate.Take();
  EXPECT_TRUE(gate.WaitForRoom(0));
  gate.Take();
  EXPECT_EQ(gate.held(), 2);
  EXPECT_FALSE(gate.WaitForRoom(30));  // full
  gate.Take();                         // work pulled anyway still counts
  EXPECT_EQ(gate.held(), 3);
  gate.Release();
  EXPECT_FALSE(gate.WaitForRoom(0));   // 2 of 2
  gate.Release();
  EXPECT_TRUE(gate.WaitForRoom(0));
  gate.Release();
  gate.Release();                      // never below zero
  EXPECT_EQ(gate.held(), 0);
}

TEST(PullGateTest, ReleaseWakesAWaiter) {
  PullGate gate(1);
  gate.Take();
  std::atomic<int> result{-1};
  std::thread waiter([&] { result = gate.WaitForRoom(60000) ? 1 : 0; });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(result.load(), -1);  // still waiting: no room
  gate.Release();
  waiter.join();
  EXPECT_EQ(result.load(), 1);
}

TEST(PullGateTest, StopAndShutdownEndTheWait) {
  PullGate gate(1);
  gate.Take();
  std::atomic<bool> stop{false};
  std::atomic<int> result{-1};
  std::thread stopped([&] { result = gate.WaitForRoom(60000, &stop) ? 1 : 0; });
  stop = true;
  stopped.join();
  EXPECT_EQ(result.load(), 0);

  result = -1;
  std::thread shut([&] { result = gate.WaitForRoom(60000) ? 1 : 0; });
  gate.Shutdown();
  shut.join();
  EXPECT_EQ(result.load(), 0);
  gate.Release();
  EXPECT_FALSE(gate.WaitForRoom(0));  // and every later call
}

// A holder always has room (what it pulls joins its pass); a model that
// has waited long enough with work in the queue (kStarved) has room while
// held claims are within one of the limit, so models that keep their
// claims (each pass takes part of their work) cannot lock it out.
TEST(PullGateTest, HoldersAlwaysHaveRoomAndAStarvedModelOneMore) {
  using P = PullGate::Puller;
  PullGate gate(2);
  gate.Take();
  gate.Take();  // two hot models' work waits
  EXPECT_TRUE(gate.WaitForRoom(0, nullptr, P::kHolder));
  EXPECT_FALSE(gate.WaitForRoom(0, nullptr, P::kWaiting));
  EXPECT_TRUE(gate.WaitForRoom(0, nullptr, P::kStarved));
  gate.Take();  // the starved model's work: one past the limit
  EXPECT_EQ(gate.held(), 3);
  EXPECT_FALSE(gate.WaitForRoom(0, nullptr, P::kStarved));  // only one more
  EXPECT_TRUE(gate.WaitForRoom(0, nullptr, P::kHolder));

  std::atomic<int> starved{-1};
  std::thread waiter([&] { starved = gate.WaitForRoom(60000, nullptr, P::kStarved) ? 1 : 0; });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(starved.load(), -1);
  gate.Release();  // 2 held: room for a starved model again
  waiter.join();
  EXPECT_EQ(starved.load(), 1);

  PullGate unbounded(0);
  EXPECT_TRUE(unbounded.WaitForRoom(0, nullptr, P::kStarved));
}

}  // namespace
}  // namespace shoal
