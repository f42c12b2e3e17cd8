// ProgressKeeper against a real nats-server: notes go to the watched ack
// subjects only, only once a watch has lived an interval, and stop with it.
#include "worker/progress_keeper.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <nats/nats.h>

#include "queue/nats_client.h"
#include "support/test_env.h"

namespace shoal {
namespace {

using namespace std::chrono_literals;

struct Seen {
  std::mutex mu;
  std::vector<std::string> notes;  // "subject data"
};

TEST(ProgressKeeperTest, NotesLongWatchesUntilTheyEnd) {
  shoal::testing::TestNatsServer server;
  NatsOptions no;
  no.url = server.url();
  auto c = NatsClient::Connect(no);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto client = std::move(c).value();
  Seen seen;
  auto sub = client->Subscribe("_ack.>", [](natsConnection*, natsSubscription*, natsMsg* m, void* p) {
    auto* s = static_cast<Seen*>(p);
    std::lock_guard<std::mutex> lock(s->mu);
    s->notes.push_back(std::string(natsMsg_GetSubject(m)) + " " + std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m)));
    natsMsg_Destroy(m);
  }, &seen);
  ASSERT_TRUE(sub.ok());
  auto count = [&](const std::string& note) {
    std::lock_guard<std::mutex> lock(seen.mu);
    return std::count(seen.notes.begin(), seen.notes.end(), note);
  };

  ProgressKeeper keeper(client.get(), 50);
  {
    auto brief = keeper.Start({"_ack.brief"});
  }  // ended before an interval: never noted
  {
    auto none = keeper.Start({"", ""});  // pushed work: nothing to note
    auto watch = keeper.Start({"_ack.a", "", "_ack.b"});
    std::this_thread::sleep_for(400ms);
  }
  ASSERT_TRUE(client->Flush(2000).ok());
  std::this_thread::sleep_for(100ms);
  const auto a = count("_ack.a +WPI"), b = count("_ack.b +WPI");
  EXPECT_GE(a, 3);  // ~7 intervals, the first skipped
  EXPECT_EQ(a, b);
  EXPECT_EQ(count("_ack.brief +WPI"), 0);
  EXPECT_EQ(keeper.notes_sent(), static_cast<uint64_t>(a + b));
  std::this_thread::sleep_for(200ms);  // the watch ended: no more notes
  EXPECT_EQ(count("_ack.a +WPI"), a);

  // Finish stops one message's notes while other watches go on; a watch
  // assigned over another stops the one it replaces.
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    seen.notes.clear();
  }
  {
    auto kept = keeper.Start({"_ack.kept"});
    auto handed_back_watch = keeper.Start({"_ack.handed_back"});
    ProgressKeeper::Watch single = keeper.Start({"_ack.replaced"});
    std::this_thread::sleep_for(150ms);
    handed_back_watch.Finish();
    single = keeper.Start({"_ack.replacement"});
    ASSERT_TRUE(client->Flush(2000).ok());
    std::this_thread::sleep_for(50ms);
    const auto handed_back = count("_ack.handed_back +WPI"), replaced = count("_ack.replaced +WPI");
    std::this_thread::sleep_for(300ms);
    ASSERT_TRUE(client->Flush(2000).ok());
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(count("_ack.handed_back +WPI"), handed_back) << "noted after Finish returned";
    EXPECT_EQ(count("_ack.replaced +WPI"), replaced) << "noted after its watch was replaced";
    EXPECT_GE(count("_ack.kept +WPI"), handed_back + 3);
    EXPECT_GE(count("_ack.replacement +WPI"), 3);
  }
}

}  // namespace
}  // namespace shoal
