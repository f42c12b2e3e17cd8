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

// A model holding a claim tops its waiting work up while nobody else needs
// room, but not while a model with queued work waits for it: otherwise
// holders whose passes each take part of their work would keep their claims
// (and the room) for as long as their own queues last.
TEST(PullGateTest, HoldersStopToppingUpWhileAQueuedModelWaits) {
  using P = PullGate::Puller;
  PullGate gate(1);
  gate.Take();  // the holder's work waits for the device
  EXPECT_TRUE(gate.WaitForRoom(0, nullptr, P::kHolder));
  EXPECT_FALSE(gate.WaitForRoom(0, nullptr, P::kIdle));

  std::atomic<bool> stop{false};
  std::atomic<int> idle{-1}, queued{-1};
  std::thread idle_puller([&] { idle = gate.WaitForRoom(60000, &stop, P::kIdle) ? 1 : 0; });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_TRUE(gate.WaitForRoom(0, nullptr, P::kHolder));  // an idle model does not hold it back
  EXPECT_EQ(gate.queued_waiting(), 0);

  std::thread queued_puller([&] { queued = gate.WaitForRoom(60000, &stop, P::kQueued) ? 1 : 0; });
  for (int i = 0; i < 500 && gate.queued_waiting() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(gate.queued_waiting(), 1);
  EXPECT_FALSE(gate.WaitForRoom(30, nullptr, P::kHolder));  // no top-up now
  EXPECT_EQ(queued.load(), -1);

  gate.Release();  // the holder's pass went to the device: room for both
  queued_puller.join();
  idle_puller.join();
  EXPECT_EQ(queued.load(), 1);
  EXPECT_EQ(idle.load(), 1);
  EXPECT_EQ(gate.queued_waiting(), 0);
  gate.Take();
  EXPECT_TRUE(gate.WaitForRoom(0, nullptr, P::kHolder));  // nobody waits again
}

}  // namespace
}  // namespace shoal
