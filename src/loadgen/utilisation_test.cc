#include "loadgen/utilisation.h"

#include <gtest/gtest.h>

namespace shoal::loadgen {
namespace {

// What a gateway's GET /v1/workers answers (extra fields are ignored).
const char* kBefore = R"({"object":"list","data":[
  {"id":"w-1","busy_seconds":10.0,"device_slots":1,"models":["tiny-bert"]},
  {"id":"w-2","busy_seconds":4.0,"device_slots":2,"heartbeat_unix_ms":4000},
  {"id":"w-3","busy_seconds":7.5},
  {"busy_seconds":1.0}]})";
const char* kAfter = R"({"object":"list","data":[
  {"id":"w-1","busy_seconds":11.5,"device_slots":1},
  {"id":"w-2","busy_seconds":5.0,"device_slots":2,"heartbeat_unix_ms":6000},
  {"id":"w-3","busy_seconds":1.0},
  {"id":"w-4","busy_seconds":3.0,"device_slots":1}]})";

TEST(Utilisation, ParsesTheWorkersList) {
  auto w = ParseWorkers(kBefore);
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->size(), 3u);  // the entry without an id is skipped
  EXPECT_EQ((*w)[0].id, "w-1");
  EXPECT_DOUBLE_EQ((*w)[1].busy_seconds, 4.0);
  EXPECT_EQ((*w)[1].device_slots, 2);
  EXPECT_EQ((*w)[1].heartbeat_unix_ms, 4000);
  EXPECT_EQ((*w)[0].heartbeat_unix_ms, 0);  // missing: unknown
  EXPECT_EQ((*w)[2].device_slots, 1);  // missing: one slot
}

TEST(Utilisation, RejectsNonListAnswers) {
  EXPECT_EQ(ParseWorkers("not json").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseWorkers(R"({"error":{"message":"no route"}})").status().code(), StatusCode::kInvalidArgument);
}

TEST(Utilisation, IsBusyTimeOverElapsedTimesSlots) {
  auto before = ParseWorkers(kBefore);
  auto after = ParseWorkers(kAfter);
  ASSERT_TRUE(before.ok() && after.ok());
  auto u = Utilisation(*before, *after, 2.0);
  // w-1: 1.5 s busy over 2 s with 1 slot; w-2: 1 s over 2 s x 2 slots;
  // w-3 restarted (busy went down) and w-4 is new: both left out.
  ASSERT_EQ(u.size(), 2u);
  EXPECT_DOUBLE_EQ(u.at("w-1"), 0.75);
  EXPECT_DOUBLE_EQ(u.at("w-2"), 0.25);
  // Over a shorter interval the same busy time saturates at 1.
  EXPECT_DOUBLE_EQ(Utilisation(*before, *after, 1.0).at("w-1"), 1.0);
  // w-2's busy time is over its heartbeats, 2 s apart, however far apart
  // the samples were taken.
  EXPECT_DOUBLE_EQ(Utilisation(*before, *after, 1.0).at("w-2"), 0.25);
  EXPECT_TRUE(Utilisation(*before, *after, 0).empty());
}

TEST(UtilisationTracker, BuildsSeriesAndWindowMeans) {
  UtilisationTracker t;
  t.Add(0, {{"w", 0, 1}});
  t.Add(1, {{"w", 0.5, 1}});
  t.Add(2, {{"w", 1.5, 1}});
  t.Add(3, {{"w", 1.75, 1}});
  const auto& s = t.series().at("w");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_DOUBLE_EQ(s[0].t_s, 0.5);
  EXPECT_DOUBLE_EQ(s[0].utilisation, 0.5);
  EXPECT_DOUBLE_EQ(s[1].utilisation, 1.0);
  EXPECT_DOUBLE_EQ(s[2].utilisation, 0.25);
  EXPECT_DOUBLE_EQ(t.MeanOver(1, 3).at("w"), 1.25 / 2);
  EXPECT_TRUE(t.MeanOver(2.5, 2.9).empty());
}

// A Shoal gateway passes on busy_seconds as of each worker's heartbeat
// (every 2 s), sampled every second: the time base is the heartbeat, and a
// sample whose heartbeat has not advanced measured nothing. A fully busy
// worker read 1, 0, 1, 0 (2 s of busy time in one 1 s interval, clamped,
// then none) and a half-busy one the same.
TEST(UtilisationTracker, UsesEachWorkersHeartbeatAsItsTimeBase) {
  UtilisationTracker t;
  // Half busy, heartbeat every 2 s; samples every second, arriving 0.3 s
  // after a heartbeat or 1.3 s after it.
  const int64_t hb0 = 1'700'000'000'000;
  for (int i = 0; i <= 8; ++i) {
    WorkerBusy w{"w", 0.5 * 2 * (i / 2), 1, hb0 + 2000 * (i / 2)};
    t.Add(0.3 + i, {w});
  }
  const auto& s = t.series().at("w");
  ASSERT_EQ(s.size(), 4u);  // one per new heartbeat, between the samples that brought them
  for (size_t k = 0; k < s.size(); ++k) {
    EXPECT_DOUBLE_EQ(s[k].utilisation, 0.5);
    EXPECT_DOUBLE_EQ(s[k].t_s, 1.3 + 2 * static_cast<double>(k));
  }
  EXPECT_DOUBLE_EQ(t.MeanOver(0, 9).at("w"), 0.5);
  // A window of 1.5 s holds one new heartbeat: measured from the one before.
  EXPECT_DOUBLE_EQ(t.MeanOver(3, 4.5).at("w"), 0.5);
  // Without heartbeats (another server), the samples' own times.
  UtilisationTracker plain;
  plain.Add(0, {{"w", 0, 1}});
  plain.Add(2, {{"w", 1, 1}});
  EXPECT_DOUBLE_EQ(plain.series().at("w").at(0).utilisation, 0.5);
}

}  // namespace
}  // namespace shoal::loadgen
