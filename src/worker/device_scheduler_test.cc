#include "worker/device_scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shoal {

// Reaches into the scheduler to create the one interleaving a test cannot
// force from outside: a waiter that is granted a slot and cancelled before
// it wakes.
class DeviceSchedulerTestPeer {
 public:
  // Takes a slot without a Turn, as a running forward pass would.
  static void OccupySlot(DeviceScheduler& s) {
    std::lock_guard<std::mutex> lock(s.mu_);
    ++s.running_;
  }
  // Under one hold of the lock: sets `cancel`, then frees the slot taken by
  // OccupySlot(), which grants it. A waiter can only see both at once.
  static void CancelThenFreeSlot(DeviceScheduler& s, std::atomic<bool>& cancel) {
    std::lock_guard<std::mutex> lock(s.mu_);
    cancel = true;
    s.ReleaseSlotsLocked(1);
  }
  static uint64_t HandedBack(const DeviceScheduler& s) {
    std::lock_guard<std::mutex> lock(s.mu_);
    return s.handed_back_;
  }
};

namespace {

using Turn = DeviceScheduler::Turn;

// Polls `pred` until it holds; false after 5 s so a bug fails the test
// instead of hanging it.
bool WaitUntil(const std::function<bool()>& pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

DeviceSchedulerOptions Options(int slots, double backlog_weight = 1.0) {
  DeviceSchedulerOptions o;
  o.slots = slots;
  o.backlog_weight = backlog_weight;
  return o;
}

struct Request {
  std::string model;
  int64_t oldest_enqueued_mono_us = 0;
  int64_t backlog = 0;
};

// With the only slot held by the caller's `held` turn, queues `requests` one
// by one (each queued before the next arrives, so arrival order is the
// vector's), releases `held` and returns the order the slot went round in.
// The clock does not move, so every grant compares the same ages.
std::vector<std::string> GrantOrder(DeviceScheduler& s, Turn held,
                                    const std::vector<Request>& requests) {
  std::mutex mu;
  std::vector<std::string> order;  // guarded by mu
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, r = requests[i]] {
      auto turn = s.Acquire(r.model, r.oldest_enqueued_mono_us, r.backlog);
      if (!turn.ok()) return;
      // Recorded while holding the only slot, so this is grant order.
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(r.model);
    });
    EXPECT_TRUE(WaitUntil([&] { return s.waiting() == static_cast<int>(i + 1); }));
  }
  held.Release();
  for (auto& t : threads) t.join();
  return order;
}

TEST(DeviceSchedulerOptions, ValidateRejectsBadValues) {
  EXPECT_TRUE(Options(1, 0.0).Validate().ok());
  EXPECT_TRUE(Options(4, 2.5).Validate().ok());
  EXPECT_EQ(Options(0).Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Options(-3).Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Options(1, -0.5).Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Options(1, std::numeric_limits<double>::quiet_NaN()).Validate().code(),
            StatusCode::kInvalidArgument);
}

TEST(DeviceScheduler, FreeSlotIsGrantedAtOnce) {
  FakeClock clock;
  DeviceScheduler s(Options(1), &clock);
  auto turn = s.Acquire("a", 0, 0);
  ASSERT_TRUE(turn.ok());
  EXPECT_TRUE(turn->valid());
  EXPECT_EQ(s.running(), 1);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.turns_granted("a"), 1u);
  EXPECT_EQ(s.turns_granted("b"), 0u);
  turn->Release();
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, SecondAcquireBlocksUntilFirstTurnIsReleased) {
  FakeClock clock;
  DeviceScheduler s(Options(1), &clock);
  auto first = s.Acquire("a", 0, 0);
  ASSERT_TRUE(first.ok());

  std::atomic<bool> got{false};
  std::thread t([&] {
    auto second = s.Acquire("b", 0, 0);
    ASSERT_TRUE(second.ok());
    got = true;
    EXPECT_EQ(s.running(), 1);
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  // Queued and not granted: it cannot have returned.
  EXPECT_FALSE(got.load());
  EXPECT_EQ(s.running(), 1);
  EXPECT_EQ(s.turns_granted("b"), 0u);

  first->Release();
  t.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(s.turns_granted("b"), 1u);
  EXPECT_EQ(s.running(), 0);
  EXPECT_EQ(s.waiting(), 0);
}

TEST(DeviceScheduler, GrantsOldestWorkFirst) {
  FakeClock clock;
  clock.AdvanceUs(10'000);
  DeviceScheduler s(Options(1), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());
  // Ages at 10 ms: young 1 ms, oldest 3 ms, middle 2 ms; equal backlogs.
  auto order = GrantOrder(s, std::move(*held),
                          {{"young", 9'000, 5}, {"oldest", 7'000, 5}, {"middle", 8'000, 5}});
  EXPECT_EQ(order, (std::vector<std::string>{"oldest", "middle", "young"}));
}

TEST(DeviceScheduler, EqualAgesLargerBacklogWins) {
  FakeClock clock;
  clock.AdvanceUs(10'000);
  DeviceScheduler s(Options(1), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());
  // All aged 5 ms; weights 1+log2(2)=2, 1+log2(101)=7.66, 1+log2(11)=4.46.
  auto order = GrantOrder(s, std::move(*held),
                          {{"b1", 5'000, 1}, {"b100", 5'000, 100}, {"b10", 5'000, 10}});
  EXPECT_EQ(order, (std::vector<std::string>{"b100", "b10", "b1"}));
}

TEST(DeviceScheduler, TiesGoToTheEarliestWaiter) {
  FakeClock clock;
  clock.AdvanceUs(10'000);
  DeviceScheduler s(Options(1), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());
  auto order = GrantOrder(s, std::move(*held),
                          {{"first", 4'000, 7}, {"second", 4'000, 7}, {"third", 4'000, 7}});
  EXPECT_EQ(order, (std::vector<std::string>{"first", "second", "third"}));
}

TEST(DeviceScheduler, OldWorkBeatsBigBacklogOfFreshWork) {
  // Weight 1. "fresh": age 1 ms, backlog 1000 -> 1 ms * (1 + log2(1001))
  // = 1 ms * 10.97 = 10.97 ms. "old": age 20 ms, backlog 0 -> 20 ms * 1 =
  // 20 ms. 20 > 10.97, so the old work goes first even though it arrived last.
  FakeClock clock;
  clock.AdvanceUs(100'000);
  DeviceScheduler s(Options(1, 1.0), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());
  auto order = GrantOrder(s, std::move(*held), {{"fresh", 99'000, 1000}, {"old", 80'000, 0}});
  EXPECT_EQ(order, (std::vector<std::string>{"old", "fresh"}));
}

TEST(DeviceScheduler, BigBacklogBeatsSlightlyOlderWork) {
  // The converse, showing the weight is applied: "old" aged 10 ms, backlog 0
  // -> 10 ms; "fresh" aged 1 ms, backlog 1000 -> 10.97 ms (see above). 10.97
  // > 10, so "fresh" wins although "old" arrived first.
  FakeClock clock;
  clock.AdvanceUs(100'000);
  DeviceScheduler s(Options(1, 1.0), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());
  auto order = GrantOrder(s, std::move(*held), {{"old", 90'000, 0}, {"fresh", 99'000, 1000}});
  EXPECT_EQ(order, (std::vector<std::string>{"fresh", "old"}));
}

TEST(DeviceScheduler, ZeroBacklogWeightIsOldestFirst) {
  // Weight 0: backlog does not count, so 2 ms beats 1 ms with backlog 1000.
  FakeClock clock;
  clock.AdvanceUs(100'000);
  DeviceScheduler s(Options(1, 0.0), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());
  auto order = GrantOrder(s, std::move(*held), {{"fresh", 99'000, 1000}, {"old", 98'000, 0}});
  EXPECT_EQ(order, (std::vector<std::string>{"old", "fresh"}));
}

TEST(DeviceScheduler, ColdModelIsNotStarvedByHotModels) {
  // Two hot models (backlog 500, re-queuing fresh work as soon as their turn
  // ends) and one cold request arriving at t=0. Each turn lasts 1 ms of fake
  // time. At release k (t = k ms) the waiting hot model queued 1 ms ago with
  // fresh work: priority 1 ms * (1 + log2(501)) = 1 ms * 9.97 = 9.97 ms; the
  // cold request: k ms * 1. The cold request wins at k = 10, so it is the
  // 11th turn (index 10), after 10 hot turns. This is the weight alone: the
  // bound on overtakes (OldestWaiterIsOvertakenAtMostMaxOvertakesTimes) is
  // lifted.
  FakeClock clock;
  DeviceSchedulerOptions options = Options(1, 1.0);
  options.max_overtakes = 1000;
  DeviceScheduler s(options, &clock);

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> log;  // grant order; guarded by mu
  size_t released = 0;           // turns the test let finish; guarded by mu
  // Runs while holding a turn: records it and waits for the test to end it.
  auto run_turn = [&](const std::string& model) {
    std::unique_lock<std::mutex> lock(mu);
    log.push_back(model);
    const size_t mine = log.size();
    cv.wait(lock, [&] { return released >= mine; });
  };
  auto hot = [&](const std::string& model) {
    while (true) {
      auto turn = s.Acquire(model, clock.NowMonoUs(), 500);
      if (!turn.ok()) return;
      run_turn(model);
    }
  };
  auto log_size = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return log.size();
  };

  std::thread hot_a(hot, "hot_a");
  ASSERT_TRUE(WaitUntil([&] { return log_size() == 1; }));
  std::thread hot_b(hot, "hot_b");
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  std::thread cold([&] {
    auto turn = s.Acquire("cold", clock.NowMonoUs(), 0);
    ASSERT_TRUE(turn.ok());
    run_turn("cold");
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 2; }));

  size_t cold_index = 0;
  for (size_t turn = 1; turn <= 50 && cold_index == 0; ++turn) {
    clock.AdvanceUs(1'000);
    {
      std::lock_guard<std::mutex> lock(mu);
      released = turn;
    }
    cv.notify_all();
    // Step only once the next turn is running and the model that just ran
    // has queued again, so every grant sees the same set of waiters: until
    // the cold request runs, that is always two (the other hot one and the
    // cold one, or both hot ones while the cold one runs).
    ASSERT_TRUE(WaitUntil([&] {
      std::lock_guard<std::mutex> lock(mu);
      return log.size() == turn + 1 && s.waiting() == 2;
    }));
    std::lock_guard<std::mutex> lock(mu);
    if (log.back() == "cold") cold_index = turn;
  }
  EXPECT_GT(cold_index, 0u) << "cold request never served in 50 turns";
  EXPECT_LE(cold_index, 10u);
  EXPECT_EQ(s.turns_granted("cold"), 1u);
  EXPECT_EQ(s.turns_granted("hot_a") + s.turns_granted("hot_b"), cold_index);

  {
    std::lock_guard<std::mutex> lock(mu);
    released = std::numeric_limits<size_t>::max();
  }
  cv.notify_all();
  s.Shutdown();
  hot_a.join();
  hot_b.join();
  cold.join();
  EXPECT_EQ(s.running(), 0);
  EXPECT_EQ(s.waiting(), 0);
}

// In overload a hot model's oldest work is as old as a cold model's, and
// its backlog weight keeps it ahead for ever: "cold" aged 50 ms, backlog 0
// -> 50 ms; each "hot" aged 40 ms, backlog 1000 -> 40 ms * 10.97 = 439 ms.
// The weight lets younger work overtake the oldest waiter at most
// max_overtakes times in a row.
TEST(DeviceScheduler, OldestWaiterIsOvertakenAtMostMaxOvertakesTimes) {
  const std::vector<Request> requests = {{"cold", 50'000, 0},  {"h1", 60'000, 1000}, {"h2", 60'000, 1000},
                                         {"h3", 60'000, 1000}, {"h4", 60'000, 1000}, {"h5", 60'000, 1000},
                                         {"h6", 60'000, 1000}};
  auto order_with = [&](int max_overtakes) {
    FakeClock clock;
    clock.AdvanceUs(100'000);
    DeviceSchedulerOptions options = Options(1);
    options.max_overtakes = max_overtakes;
    DeviceScheduler s(options, &clock);
    auto held = s.Acquire("holder", 0, 0);
    EXPECT_TRUE(held.ok());
    return GrantOrder(s, std::move(*held), requests);
  };
  EXPECT_EQ(order_with(4), (std::vector<std::string>{"h1", "h2", "h3", "h4", "cold", "h5", "h6"}));
  EXPECT_EQ(order_with(DeviceSchedulerOptions{}.max_overtakes),
            (std::vector<std::string>{"h1", "h2", "h3", "h4", "cold", "h5", "h6"}));  // the default
  EXPECT_EQ(order_with(0), (std::vector<std::string>{"cold", "h1", "h2", "h3", "h4", "h5", "h6"}));
  EXPECT_EQ(order_with(1000), (std::vector<std::string>{"h1", "h2", "h3", "h4", "h5", "h6", "cold"}));

  DeviceSchedulerOptions bad = Options(1);
  bad.max_overtakes = -1;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(DeviceScheduler, TwoSlotsRunTwoAtOnceAndAThirdWaits) {
  FakeClock clock;
  DeviceScheduler s(Options(2), &clock);
  auto a = s.Acquire("a", 0, 0);
  auto b = s.Acquire("b", 0, 0);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(s.running(), 2);

  std::atomic<bool> got{false};
  std::thread t([&] {
    auto c = s.Acquire("c", 0, 0);
    ASSERT_TRUE(c.ok());
    got = true;
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  EXPECT_FALSE(got.load());
  EXPECT_EQ(s.running(), 2);

  b->Release();
  t.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(s.turns_granted("c"), 1u);
  EXPECT_EQ(s.running(), 1);  // a still runs; c has released
  a->Release();
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, PassAloneOnTheDeviceTakesItsMaxWidth) {
  FakeClock clock;
  DeviceScheduler s(Options(4), &clock);
  auto lone = s.Acquire("a", 0, 0, nullptr, {1, 4});
  ASSERT_TRUE(lone.ok());
  EXPECT_EQ(lone->width(), 4);
  EXPECT_EQ(s.running(), 4);
  lone->Release();
  // A max above the slots is clamped to them; a max below min counts as min.
  auto wide = s.Acquire("a", 0, 0, nullptr, {1, 9});
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(wide->width(), 4);
  wide->Release();
  auto odd = s.Acquire("a", 0, 0, nullptr, {3, 2});
  ASSERT_TRUE(odd.ok());
  EXPECT_EQ(odd->width(), 3);
  odd->Release();
  EXPECT_EQ(s.running(), 0);
  EXPECT_EQ(Turn().width(), 0);
}

TEST(DeviceScheduler, PassThatFindsOthersRunningTakesItsMinWidth) {
  FakeClock clock;
  DeviceScheduler s(Options(2), &clock);
  auto a = s.Acquire("a", 0, 0, nullptr, {1, 2});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->width(), 2);
  // b waits for a's two slots, and once granted runs on one: it met
  // competition, so the models now share the device side by side.
  std::atomic<int> b_width{-1};
  std::atomic<bool> release_b{false};
  std::thread tb([&] {
    auto b = s.Acquire("b", 0, 0, nullptr, {1, 2});
    ASSERT_TRUE(b.ok());
    b_width = b->width();
    ASSERT_TRUE(WaitUntil([&] { return release_b.load(); }));
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  a->Release();
  ASSERT_TRUE(WaitUntil([&] { return b_width.load() >= 0; }));
  EXPECT_EQ(b_width.load(), 1);
  // a comes back while b runs: one slot is free and nobody waits, so it
  // starts at once on that one slot.
  auto again = s.Acquire("a", 0, 0, nullptr, {1, 2});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->width(), 1);
  EXPECT_EQ(s.running(), 2);
  release_b = true;
  tb.join();
  again->Release();
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, CancelledWideWaiterLetsTheNarrowOnesBehindItIn) {
  FakeClock clock;
  DeviceScheduler s(Options(2), &clock);
  auto running = s.Acquire("running", 0, 0);  // one slot of two
  ASSERT_TRUE(running.ok());
  std::atomic<bool> cancel_whole{false};
  std::atomic<bool> whole_done{false};
  std::thread whole([&] {
    auto t = s.Acquire("whole", -1'000, 0, &cancel_whole, {2, 2});
    EXPECT_EQ(t.status().reason(), "cancelled");
    whole_done = true;
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  std::atomic<bool> narrow_got{false};
  std::thread narrow([&] {
    auto t = s.Acquire("narrow", 0, 0, nullptr, {1, 1});
    ASSERT_TRUE(t.ok());
    narrow_got = true;
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 2; }));
  EXPECT_FALSE(narrow_got.load());  // held back behind "whole"
  cancel_whole = true;
  ASSERT_TRUE(WaitUntil([&] { return whole_done.load(); }));
  // The free slot goes to "narrow" now, while "running" still holds its own.
  ASSERT_TRUE(WaitUntil([&] { return narrow_got.load(); }));
  EXPECT_EQ(s.turns_granted("narrow"), 1u);
  whole.join();
  narrow.join();
  running->Release();
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, WideWaiterIsNotOvertakenByNarrowerOnes) {
  FakeClock clock;
  DeviceScheduler s(Options(2), &clock);
  auto a = s.Acquire("a", 0, 0);
  auto b = s.Acquire("b", 0, 0);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  std::mutex mu;
  std::vector<std::string> order;  // guarded by mu
  // "whole" needs both slots and has the oldest work; "narrow" arrives later
  // with younger work and needs one.
  std::thread whole([&] {
    auto t = s.Acquire("whole", -1'000, 0, nullptr, {2, 2});
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(t->width(), 2);
    std::lock_guard<std::mutex> lock(mu);
    order.push_back("whole");
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  std::thread narrow([&] {
    auto t = s.Acquire("narrow", 0, 0, nullptr, {1, 1});
    ASSERT_TRUE(t.ok());
    std::lock_guard<std::mutex> lock(mu);
    order.push_back("narrow");
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 2; }));
  // One slot frees: "narrow" would fit but "whole" is first in line.
  a->Release();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(s.waiting(), 2);
  EXPECT_EQ(s.running(), 1);
  b->Release();
  whole.join();
  narrow.join();
  EXPECT_EQ(order, (std::vector<std::string>{"whole", "narrow"}));
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, ShutdownWakesWaitersWithShuttingDown) {
  FakeClock clock;
  DeviceScheduler s(Options(1), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());

  std::vector<Status> results(2);
  std::vector<std::thread> threads;
  const std::string models[] = {"m0", "m1"};
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      auto turn = s.Acquire(models[i], 0, 0);
      results[i] = turn.ok() ? Status::Ok() : turn.status();
    });
  }
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 2; }));
  s.Shutdown();
  for (auto& t : threads) t.join();
  for (const Status& st : results) {
    EXPECT_EQ(st.code(), StatusCode::kUnavailable);
    EXPECT_EQ(st.reason(), "shutting_down");
  }
  EXPECT_EQ(s.waiting(), 0);

  // The held turn survives shutdown; a new caller is refused at once even
  // though a slot is free after the release.
  EXPECT_TRUE(held->valid());
  held->Release();
  EXPECT_EQ(s.running(), 0);
  auto late = s.Acquire("late", 0, 0);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().reason(), "shutting_down");
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, CancelFlagStopsWaiting) {
  FakeClock clock;
  DeviceScheduler s(Options(1), &clock);
  auto held = s.Acquire("holder", 0, 0);
  ASSERT_TRUE(held.ok());

  std::atomic<bool> cancel{false};
  Status result;
  std::thread t([&] {
    auto turn = s.Acquire("m", 0, 0, &cancel);
    result = turn.ok() ? Status::Ok() : turn.status();
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  // Nobody notifies: the waiter finds the flag by polling.
  cancel = true;
  t.join();
  EXPECT_EQ(result.code(), StatusCode::kUnavailable);
  EXPECT_EQ(result.reason(), "cancelled");
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.running(), 1);
  EXPECT_EQ(s.turns_granted("m"), 0u);

  // Already cancelled on arrival: refused even with a free slot.
  held->Release();
  auto again = s.Acquire("m", 0, 0, &cancel);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().reason(), "cancelled");
  EXPECT_EQ(s.running(), 0);
}

TEST(DeviceScheduler, WaiterCancelledAfterGrantHandsTheSlotOn) {
  FakeClock clock;
  clock.AdvanceUs(10'000);
  DeviceScheduler s(Options(1), &clock);
  DeviceSchedulerTestPeer::OccupySlot(s);

  std::atomic<bool> cancel_b{false};
  Status b_result;
  std::thread b([&] {
    // Oldest work: it is the one granted when the slot frees.
    auto turn = s.Acquire("b", 0, 0, &cancel_b);
    b_result = turn.ok() ? Status::Ok() : turn.status();
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 1; }));
  std::atomic<bool> c_got{false};
  std::thread c([&] {
    auto turn = s.Acquire("c", 5'000, 0);
    ASSERT_TRUE(turn.ok());
    c_got = true;
  });
  ASSERT_TRUE(WaitUntil([&] { return s.waiting() == 2; }));

  DeviceSchedulerTestPeer::CancelThenFreeSlot(s, cancel_b);
  // If b kept the slot, c would wait forever: shut down to end the test.
  const bool c_ran = WaitUntil([&] { return c_got.load(); });
  if (!c_ran) s.Shutdown();
  b.join();
  c.join();
  ASSERT_TRUE(c_ran) << "the slot granted to the cancelled waiter leaked";
  EXPECT_EQ(b_result.reason(), "cancelled");
  EXPECT_EQ(DeviceSchedulerTestPeer::HandedBack(s), 1u);  // b was granted, then gave it back
  EXPECT_TRUE(c_got.load());
  EXPECT_EQ(s.turns_granted("b"), 0u);
  EXPECT_EQ(s.turns_granted("c"), 1u);
  // No slot leaked: nothing runs, and a new caller gets the slot at once.
  EXPECT_EQ(s.running(), 0);
  EXPECT_EQ(s.waiting(), 0);
  auto d = s.Acquire("d", 0, 0);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(s.running(), 1);
}

TEST(DeviceScheduler, TurnMovesAndReleasesOnce) {
  FakeClock clock;
  DeviceScheduler s(Options(2), &clock);

  Turn empty;
  EXPECT_FALSE(empty.valid());
  empty.Release();  // no-op
  EXPECT_EQ(s.running(), 0);

  auto a = s.Acquire("a", 0, 0);
  ASSERT_TRUE(a.ok());
  Turn moved(std::move(*a));
  EXPECT_FALSE(a->valid());
  EXPECT_TRUE(moved.valid());
  EXPECT_EQ(s.running(), 1);

  // Move-assigning onto a held turn releases the one it held.
  auto b = s.Acquire("b", 0, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(s.running(), 2);
  moved = std::move(*b);
  EXPECT_EQ(s.running(), 1);
  EXPECT_TRUE(moved.valid());
  EXPECT_FALSE(b->valid());

  moved.Release();
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(s.running(), 0);
  moved.Release();  // idempotent: must not free a slot it no longer holds
  a->Release();
  b->Release();
  EXPECT_EQ(s.running(), 0);

  {
    auto scoped = s.Acquire("c", 0, 0);
    ASSERT_TRUE(scoped.ok());
    EXPECT_EQ(s.running(), 1);
  }
  EXPECT_EQ(s.running(), 0);  // destructor released it
}

}  // namespace
}  // namespace shoal
