// Integration tests against a real nats-server -js on a free loopback port.
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"

#include <nats/nats.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "support/test_env.h"

namespace shoal {
namespace {

class NatsClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NatsOptions o;
    o.url = server_.url();
    auto c = NatsClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
  }
  shoal::testing::TestNatsServer server_;
  std::unique_ptr<NatsClient> client_;
};

TEST(NatsClient, ConnectFailsCleanlyWithoutServer) {
  NatsOptions o;
  auto port = PickFreePort();
  ASSERT_TRUE(port.ok());
  o.url = "nats://127.0.0.1:" + std::to_string(*port);
  o.connect_timeout_ms = 300;
  auto c = NatsClient::Connect(o);
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().ToString();
}

// A nats-server that cannot be started says why, with either spawn.
TEST(NatsServerProcess, MissingBinaryIsUnavailableWithTheReason) {
  shoal::testing::TempDir dir;
  for (const bool die_with_parent : {false, true}) {
    NatsServerOptions o;
    o.binary = "/nonexistent/nats-server";
    o.data_dir = dir.path() + "/js";
    o.die_with_parent = die_with_parent;
    auto s = NatsServerProcess::Start(o);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(s.status().message().find("No such file or directory"), std::string::npos) << s.status().ToString();
  }
}

// A server that stops reading (here SIGSTOP, as a frozen or cut-off host)
// does not block publishers for good: past write_deadline_ms the write
// fails, nats.c reconnects, and Publish returns (an error once its
// reconnect buffer is full). Without a deadline it blocked inside send()
// until the server read again.
TEST(NatsClient, AServerThatStopsReadingDoesNotBlockPublishesForGood) {
  shoal::testing::TestNatsServer server;
  NatsOptions o;
  o.url = server.url();
  o.write_deadline_ms = 300;
  auto c = NatsClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(::kill(server.process().pid(), SIGSTOP), 0);
  const std::string body(512 * 1024, 'x');
  auto publishing = std::async(std::launch::async, [&] {
    for (int i = 0; i < 4096; ++i)  // 2 GiB: far past any socket or reconnect buffer
      if (!(*c)->Publish("shoal.test.fill", body).ok()) return true;
    return false;
  });
  const bool returned = publishing.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  ::kill(server.process().pid(), SIGCONT);  // lets a blocked publish go on, so the test ends either way
  EXPECT_TRUE(returned) << "a publish blocked while the server did not read";
  EXPECT_TRUE(publishing.get()) << "every publish succeeded";
}

// A name that is nowhere says so, before anything is spawned.
TEST(NatsServerProcess, ABinaryFoundNowhereSaysWhereItWasLookedFor) {
  shoal::testing::TempDir dir;
  NatsServerOptions o;
  o.binary = "shoal-no-such-nats-server";
  o.data_dir = dir.path() + "/js";
  auto s = NatsServerProcess::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(s.status().message().find("not found on PATH nor in /usr/local/sbin, /usr/sbin or /sbin"),
            std::string::npos)
      << s.status().ToString();
}

// Debian installs nats-server in /usr/sbin, which an ordinary user's PATH
// does not hold: it is found there all the same.
TEST(NatsServerProcess, StartsWithTheSbinDirectoriesOffPath) {
  if (FindExecutable("nats-server").rfind("/usr/sbin/", 0) != 0)
    GTEST_SKIP() << "nats-server is not Debian's /usr/sbin/nats-server here";
  const char* saved = std::getenv("PATH");
  const std::string path = saved ? saved : "";
  ::setenv("PATH", "/usr/local/bin:/usr/bin:/bin", 1);
  shoal::testing::TempDir dir;
  NatsServerOptions o;
  o.data_dir = dir.path() + "/js";
  auto s = NatsServerProcess::Start(o);
  ::setenv("PATH", path.c_str(), 1);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_TRUE(PortAcceptsConnections("127.0.0.1", (*s)->port()));
}

// Something else answering on the server's port is not the server: Start
// fails (the server could not bind) instead of handing back a server that
// is someone else's.
TEST(NatsServerProcess, APortSomeoneElseHoldsIsNotTakenForTheServer) {
  shoal::testing::HeldPort held;
  ASSERT_GT(held.port(), 0);
  shoal::testing::TempDir dir;
  NatsServerOptions o;
  o.data_dir = dir.path() + "/js";
  o.port = held.port();
  auto s = NatsServerProcess::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(s.status().message().find("exited during start-up"), std::string::npos) << s.status().ToString();
}

// A server started without -js: the queue and the registry say what is
// missing instead of a bare "no responders".
TEST(NatsClient, AServerWithoutJetStreamIsNamedAsSuch) {
  shoal::testing::TempDir dir;
  NatsServerOptions so;
  so.data_dir = dir.path() + "/data";
  so.jetstream = false;
  auto server = NatsServerProcess::Start(so);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  NatsOptions o;
  o.url = (*server)->url();
  auto c = NatsClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const Status stream = EnsureWorkStream(**c, {});
  EXPECT_EQ(stream.code(), StatusCode::kUnavailable) << stream.ToString();
  EXPECT_EQ(stream.reason(), "jetstream_unavailable") << stream.ToString();
  EXPECT_NE(stream.message().find("nats-server -js"), std::string::npos) << stream.ToString();
  auto kv = KvBucket::Open(**c, "shoal_workers", 0);
  EXPECT_EQ(kv.status().reason(), "jetstream_unavailable") << kv.status().ToString();
}

// Errors that pass once the connection is back are Unavailable, so callers
// that retry transient errors retry them.
TEST(NatsClient, ConnectionStatesAreUnavailable) {
  for (natsStatus s : {NATS_NOT_YET_CONNECTED, NATS_INSUFFICIENT_BUFFER, NATS_DRAINING, NATS_CONNECTION_CLOSED,
                       NATS_CONNECTION_DISCONNECTED, NATS_NO_SERVER}) {
    EXPECT_EQ(FromNats(s, "x").code(), StatusCode::kUnavailable) << natsStatus_GetText(s);
  }
  EXPECT_EQ(FromNats(NATS_TIMEOUT, "x").code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(FromNats(NATS_ERR, "x").code(), StatusCode::kInternal);
}

TEST(NatsClient, PublishableSubjects) {
  for (const char* ok : {"a", "_INBOX.abc123", "shoal.work.tiny-bert", "a.b-c_d.$e", "x.*y.>z"})
    EXPECT_TRUE(IsPublishableSubject(ok)) << ok;
  for (const std::string& bad : std::vector<std::string>{"", "a b", "a\tb", "a\r\nPUB x 1", "a..b", ".a", "a.", "a.*", ">", "a.>.b",
                                std::string("a\x01"), std::string("a\x7f")})
    EXPECT_FALSE(IsPublishableSubject(bad)) << bad;
  EXPECT_TRUE(IsPublishableSubject(std::string(kMaxPublishSubject, 'x')));
  EXPECT_FALSE(IsPublishableSubject(std::string(kMaxPublishSubject + 1, 'x')));
}

// Refused before anything is written: nats-server would have closed the
// connection at "PUB a b c 1".
TEST_F(NatsClientTest, PublishRefusesAnUnpublishableSubjectAndKeepsTheConnection) {
  Status s = client_->Publish("a b c", "x");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.reason(), "invalid_subject");
  natsMsg* raw = nullptr;
  ASSERT_EQ(natsMsg_Create(&raw, "inbox.>", nullptr, "x", 1), NATS_OK);
  NatsMsgPtr msg(raw);
  EXPECT_EQ(client_->PublishMsg(raw).reason(), "invalid_subject");
  EXPECT_TRUE(client_->Publish("fine.subject", "x").ok());
  EXPECT_TRUE(client_->Flush(2000).ok());
  EXPECT_TRUE(client_->IsConnected());
}

TEST_F(NatsClientTest, OwnerCreatesStreamOthersVerify) {
  WorkStreamOptions so;
  so.owner = false;
  EXPECT_EQ(EnsureWorkStream(*client_, so).code(), StatusCode::kNotFound);
  so.owner = true;
  ASSERT_TRUE(EnsureWorkStream(*client_, so).ok());
  ASSERT_TRUE(EnsureWorkStream(*client_, so).ok());  // idempotent
  so.owner = false;
  EXPECT_TRUE(EnsureWorkStream(*client_, so).ok());
  auto st = GetStreamState(*client_, "SHOAL_WORK");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->msgs, 0u);
  EXPECT_TRUE(GetStreamState(*client_, "SHOAL_WORK_DLQ").ok());
}

TEST_F(NatsClientTest, FullQueueRefusesNewWork) {
  WorkStreamOptions so;
  so.max_msgs = 2;
  ASSERT_TRUE(EnsureWorkStream(*client_, so).ok());
  jsErrCode jerr = static_cast<jsErrCode>(0);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(js_Publish(nullptr, client_->js(), "shoal.work.m", "x", 1, nullptr, &jerr), NATS_OK);
  }
  natsStatus s = js_Publish(nullptr, client_->js(), "shoal.work.m", "x", 1, nullptr, &jerr);
  EXPECT_NE(s, NATS_OK);  // DiscardNew: refused, not silently dropped
  EXPECT_EQ(GetStreamState(*client_, "SHOAL_WORK")->msgs, 2u);
}

TEST_F(NatsClientTest, PullConsumerFetchesAcksAndRedelivers) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  ConsumerOptions co;
  co.ack_wait_ms = 300;
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.m", "shoal_m", co);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  // Nothing there: a fetch times out empty.
  auto empty = (*pc)->Fetch(4, 50);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());

  for (const char* body : {"a", "b", "c"}) ASSERT_TRUE(client_->Publish("shoal.work.m", body).ok());
  ASSERT_TRUE(client_->Flush(1000).ok());
  auto got = (*pc)->Fetch(10, 1000);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 3u);
  EXPECT_EQ((*got)[0].Data(), "a");
  EXPECT_EQ((*got)[0].NumDelivered(), 1u);
  ASSERT_TRUE((*got)[0].Ack().ok());
  ASSERT_TRUE((*got)[1].Term().ok());
  // The third is neither acked nor termed: it comes back after ack_wait.
  auto again = (*pc)->Fetch(10, 3000);
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->size(), 1u);
  EXPECT_EQ((*again)[0].Data(), "c");
  EXPECT_EQ((*again)[0].NumDelivered(), 2u);
  ASSERT_TRUE((*again)[0].Ack().ok());
  ASSERT_TRUE(client_->Flush(1000).ok());
}

// A real nats-server with a file store, stopped and started again on the
// same port and store while the client reconnects.
class NatsClientReconnect : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.data_dir = dir_.path() + "/data";
    auto server = NatsServerProcess::Start(options_);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    options_.port = server_->port();
    NatsOptions o;
    o.url = server_->url();
    auto client = NatsClient::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(client).value();
    ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  }
  void StopServer() {
    server_->Stop();
    ASSERT_TRUE(shoal::testing::Eventually([&] { return !client_->IsConnected(); }, std::chrono::seconds(10)));
  }
  void RestartServer() {
    auto server = NatsServerProcess::Start(options_);  // same port and store
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    ASSERT_TRUE(shoal::testing::Eventually([&] { return client_->IsConnected(); }, std::chrono::seconds(20)));
  }

  shoal::testing::TempDir dir_;
  NatsServerOptions options_;
  std::unique_ptr<NatsServerProcess> server_;
  std::unique_ptr<NatsClient> client_;
};

// While the connection is down, a fetch fails at once rather than leave a
// pull in nats.c's reconnect buffer: a worker polling through an outage
// would otherwise have all its pulls sent together on reconnect, and more
// work delivered to it than it asked for.
TEST_F(NatsClientReconnect, NoPullIsBufferedWhileDisconnected) {
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.m", "shoal_m", ConsumerOptions{});
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();

  ASSERT_NO_FATAL_FAILURE(StopServer());
  for (int i = 0; i < 5; ++i) {
    auto f = (*pc)->Fetch(10, 50);
    EXPECT_EQ(f.status().code(), StatusCode::kUnavailable) << f.status().ToString();
  }
  ASSERT_NO_FATAL_FAILURE(RestartServer());
  for (const char* body : {"a", "b", "c"}) ASSERT_TRUE(client_->Publish("shoal.work.m", body).ok());
  ASSERT_TRUE(client_->Flush(2000).ok());
  auto one = (*pc)->Fetch(1, 2000);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  ASSERT_EQ(one->size(), 1u);
  ASSERT_TRUE((*one)[0].Ack().ok());
  // Nothing else was pulled: no message waits in the subscription.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ((*pc)->Undelivered(), 0);
}

// Publishes "b" and "c" to `subject` and has the server deliver both to
// `pc` by a pull sent by hand, while no Fetch waits for them (as a pull
// answered after its Fetch gave up does to a busy worker).
void DeliverUnfetched(NatsClient& client, PullConsumer& pc, const std::string& subject, const std::string& durable) {
  jsErrCode jerr = static_cast<jsErrCode>(0);
  for (const char* data : {"b", "c"})
    ASSERT_EQ(js_Publish(nullptr, client.js(), subject.c_str(), data, 1, nullptr, &jerr), NATS_OK);
  const std::string pull = R"({"batch":2,"expires":5000000000})";
  const std::string next = "$JS.API.CONSUMER.MSG.NEXT.SHOAL_WORK." + durable;
  ASSERT_EQ(natsConnection_PublishRequest(client.conn(), next.c_str(), pc.Inbox().c_str(), pull.data(),
                                          static_cast<int>(pull.size())),
            NATS_OK);
  for (int i = 0; i < 500 && pc.Undelivered() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(pc.Undelivered(), 2);
}

// Handed back, "b" and "c" go to the next subscriber at once, not after
// AckWait.
void ExpectHandedBack(NatsClient& client, const std::string& subject, const std::string& durable,
                      const ConsumerOptions& co) {
  auto next = PullConsumer::Create(client, "SHOAL_WORK", subject, durable, co);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  std::vector<std::string> again;
  for (int i = 0; i < 10 && again.size() < 2; ++i) {
    auto got = (*next)->Fetch(2, 500);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    for (Delivery& d : *got) {
      again.emplace_back(d.Data());
      EXPECT_EQ(d.NumDelivered(), 2u);
      (void)d.Ack();
    }
  }
  EXPECT_EQ(again, (std::vector<std::string>{"b", "c"})) << "not handed back";
}

// A subscription interrupted while NATS is away (a parked consumer closed
// during a restart) keeps what the server had already sent to it: those
// deliveries are handed back on reconnect, not left unacked until AckWait.
TEST_F(NatsClientReconnect, InterruptWhileDisconnectedKeepsWhatWasQueued) {
  ConsumerOptions co;  // AckWait 30 s: a lost delivery would be back only then
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.m", "shoal_m", co);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  ASSERT_NO_FATAL_FAILURE(DeliverUnfetched(*client_, **pc, "shoal.work.m", "shoal_m"));

  ASSERT_NO_FATAL_FAILURE(StopServer());
  (*pc)->Interrupt();
  std::vector<Delivery> held = (*pc)->TakeQueued(5000);
  ASSERT_EQ(held.size(), 2u);
  for (Delivery& d : held) EXPECT_TRUE(d.Nak().ok());
  pc->reset();

  ASSERT_NO_FATAL_FAILURE(RestartServer());
  ASSERT_TRUE(client_->Flush(2000).ok());
  ExpectHandedBack(*client_, "shoal.work.m", "shoal_m", co);
}

// A durable made elsewhere that the server will not let us update is bound
// to only if it still hands out this subject with explicit acks. Filter
// subjects can be updated (nats-server 2.9.10 does so); an ack policy
// cannot, so a consumer that acks nothing is refused (on a stream of
// limits retention: a work queue refuses such consumers itself).
TEST_F(NatsClientTest, AnExistingDurableIsBoundOnlyIfItAcksThisSubject) {
  jsStreamConfig sc;
  jsStreamConfig_Init(&sc);
  sc.Name = "OTHER";
  const char* subjects[] = {"other.>"};
  sc.Subjects = subjects;
  sc.SubjectsLen = 1;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  ASSERT_EQ(js_AddStream(nullptr, client_->js(), &sc, nullptr, &jerr), NATS_OK) << jerr;
  auto add = [&](const char* durable, const char* subject, jsAckPolicy ack) {
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.Durable = durable;
    cc.FilterSubject = subject;
    cc.AckPolicy = ack;
    ASSERT_EQ(js_AddConsumer(nullptr, client_->js(), "OTHER", &cc, nullptr, &jerr), NATS_OK) << jerr;
  };
  add("moved", "other.before", js_AckExplicit);
  auto moved = PullConsumer::Create(*client_, "OTHER", "other.after", "moved", ConsumerOptions{});
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  jsConsumerInfo* ci = nullptr;
  ASSERT_EQ(js_GetConsumerInfo(&ci, client_->js(), "OTHER", "moved", nullptr, &jerr), NATS_OK);
  EXPECT_STREQ(ci->Config->FilterSubject, "other.after");
  jsConsumerInfo_Destroy(ci);

  add("noack", "other.noack", js_AckNone);
  auto refused = PullConsumer::Create(*client_, "OTHER", "other.noack", "noack", ConsumerOptions{});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().reason(), "consumer_mismatch") << refused.status().ToString();
}

// A durable consumer deleted under a worker (an operator's `nats consumer
// rm`, a stream reset) is created again by the next pulls, so the model is
// served again without restarting the worker.
TEST_F(NatsClientTest, ADeletedDurableIsCreatedAgainByThePulls) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  ConsumerOptions co;
  co.existence_check_ms = 200;
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.gone", "shoal_gone", co);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  jsErrCode jerr = static_cast<jsErrCode>(0);
  ASSERT_EQ(js_DeleteConsumer(client_->js(), "SHOAL_WORK", "shoal_gone", nullptr, &jerr), NATS_OK);
  ASSERT_EQ(js_Publish(nullptr, client_->js(), "shoal.work.gone", "x", 1, nullptr, &jerr), NATS_OK);
  std::vector<std::string> got;
  for (int i = 0; i < 20 && got.empty(); ++i) {
    auto f = (*pc)->Fetch(1, 300);
    if (!f.ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    for (Delivery& d : *f) {
      got.emplace_back(d.Data());
      (void)d.Ack();
    }
  }
  EXPECT_EQ(got, std::vector<std::string>{"x"});
}

TEST_F(NatsClientTest, KvPutGetKeysAndTtl) {
  auto kv = KvBucket::Open(*client_, "SHOAL_TEST", 1000);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  EXPECT_TRUE((*kv)->Keys()->empty());
  ASSERT_TRUE((*kv)->Put("w1", "hello").ok());
  EXPECT_EQ(*(*kv)->Get("w1"), "hello");
  EXPECT_EQ((*kv)->Get("nope").status().code(), StatusCode::kNotFound);
  auto keys = (*kv)->Keys();
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(*keys, std::vector<std::string>{"w1"});
}

// A listing of many keys takes one deadline for all of them. nats.c's own
// kvStore_Keys took the time since the listing began off its timeout once
// per key and failed here with a timeout; the fleet view and the workers'
// peer views list buckets like this one.
TEST_F(NatsClientTest, KvListsThousandsOfKeysWithinOneDeadline) {
  auto kv = KvBucket::Open(*client_, "SHOAL_TEST_MANY", 0);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  constexpr int kKeys = 3000;
  std::vector<std::pair<std::string, std::string>> live;
  for (int i = 0; i < kKeys; ++i) {
    char key[16];
    std::snprintf(key, sizeof key, "k%05d", i);
    ASSERT_TRUE((*kv)->Put(key, "v" + std::to_string(i)).ok());
    // Every third key deleted, the last one included: delete markers are
    // not keys, at the end of the listing either.
    if (i % 3 == 2 || i == kKeys - 1) {
      ASSERT_TRUE((*kv)->Delete(key).ok());
    } else {
      live.emplace_back(key, "v" + std::to_string(i));
    }
  }
  auto keys = (*kv)->Keys();
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  ASSERT_EQ(keys->size(), live.size());
  for (size_t i = 0; i < live.size(); ++i) EXPECT_EQ((*keys)[i], live[i].first);
  auto entries = (*kv)->Entries();
  ASSERT_TRUE(entries.ok()) << entries.status().ToString();
  EXPECT_EQ(*entries, live);
}

TEST_F(NatsClientTest, KvCreateOnlyOnceUntilDeletedOrExpired) {
  auto kv = KvBucket::Open(*client_, "SHOAL_TEST_CLAIM", 800);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  auto first = (*kv)->Create("m", "w1");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(*first);
  auto second = (*kv)->Create("m", "w2");
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_FALSE(*second);  // held by w1
  EXPECT_EQ(*(*kv)->Get("m"), "w1");
  ASSERT_TRUE((*kv)->Delete("m").ok());
  EXPECT_TRUE(*(*kv)->Create("m", "w2"));  // free again after a delete
  // ... and after the bucket's TTL.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_TRUE(*(*kv)->Create("m", "w3"));
}

// A delete at a revision removes that revision only: one sent after a peer
// wrote the key (a claim that expired and was taken) leaves the peer's
// value, and the key can be created again after a delete.
TEST_F(NatsClientTest, KvDeleteAtRevisionRemovesOnlyThatRevision) {
  auto kv = KvBucket::Open(*client_, "SHOAL_TEST_DEL_REV", 60000);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  ASSERT_TRUE(*(*kv)->Create("m.0", "w1"));
  auto mine = (*kv)->GetRevision("m.0");
  ASSERT_TRUE(mine.ok());
  ASSERT_TRUE((*kv)->Delete("m.0").ok());
  ASSERT_TRUE(*(*kv)->Create("m.0", "w2"));  // a peer's claim now
  auto late = (*kv)->DeleteAtRevision("m.0", mine->second);
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_FALSE(*late);
  EXPECT_EQ(*(*kv)->Get("m.0"), "w2");
  auto theirs = (*kv)->GetRevision("m.0");
  ASSERT_TRUE(theirs.ok());
  auto deleted = (*kv)->DeleteAtRevision("m.0", theirs->second);
  ASSERT_TRUE(deleted.ok()) << deleted.status().ToString();
  EXPECT_TRUE(*deleted);
  EXPECT_EQ((*kv)->Get("m.0").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(*(*kv)->Create("m.0", "w3"));  // a delete marker leaves the key free
}

// An existing bucket keeps its creator's TTL; one that keeps entries
// forever is refused where entries must expire.
TEST_F(NatsClientTest, KvOpenKeepsTheCreatorsTtlAndRefusesNoneWhereEntriesMustExpire) {
  auto made = KvBucket::Open(*client_, "TTL_A", 5000);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_EQ((*made)->ttl_ms(), 5000);
  auto again = KvBucket::Open(*client_, "TTL_A", 8000);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->ttl_ms(), 5000);
  ASSERT_TRUE(KvBucket::Open(*client_, "TTL_FOREVER", 0).ok());
  auto refused = KvBucket::Open(*client_, "TTL_FOREVER", 5000);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().reason(), "kv_bucket_mismatch") << refused.status().ToString();
  EXPECT_TRUE(KvBucket::Open(*client_, "TTL_FOREVER", 0).ok());
}

TEST_F(NatsClientTest, KvUpdateOnlyOnTheRevisionRead) {
  auto kv = KvBucket::Open(*client_, "SHOAL_TEST_UPDATE", 0);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  ASSERT_TRUE((*kv)->Put("k", "v1").ok());
  auto read = (*kv)->GetRevision("k");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->first, "v1");
  // Two writers that read the same revision: the first wins.
  auto first = (*kv)->Update("k", "a", read->second);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(*first);
  auto second = (*kv)->Update("k", "b", read->second);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_FALSE(*second);
  EXPECT_EQ(*(*kv)->Get("k"), "a");
  EXPECT_EQ((*kv)->GetRevision("absent").status().code(), StatusCode::kNotFound);
}

TEST_F(NatsClientTest, SubjectCountsAndOldestMessage) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  auto none = GetSubjectCounts(*client_, "SHOAL_WORK", "shoal.work.>");
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(OldestMessageUnixMs(*client_, "SHOAL_WORK", "shoal.work.a").status().code(), StatusCode::kNotFound);

  const int64_t before_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  jsErrCode jerr = static_cast<jsErrCode>(0);
  for (const char* subj : {"shoal.work.a", "shoal.work.a", "shoal.work.b"}) {
    ASSERT_EQ(js_Publish(nullptr, client_->js(), subj, "x", 1, nullptr, &jerr), NATS_OK);
  }
  auto counts = GetSubjectCounts(*client_, "SHOAL_WORK", "shoal.work.>");
  ASSERT_TRUE(counts.ok()) << counts.status().ToString();
  EXPECT_EQ(counts->at("shoal.work.a"), 2u);
  EXPECT_EQ(counts->at("shoal.work.b"), 1u);
  EXPECT_EQ(counts->size(), 2u);
  auto oldest = OldestMessageUnixMs(*client_, "SHOAL_WORK", "shoal.work.a");
  ASSERT_TRUE(oldest.ok()) << oldest.status().ToString();
  EXPECT_GE(*oldest, before_ms - 1000);  // the server's clock is this machine's
  EXPECT_LE(*oldest, before_ms + 5000);

  ConsumerOptions co;
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.b", "shoal_b", co);
  ASSERT_TRUE(pc.ok());
  auto got = (*pc)->Fetch(1, 1000);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 1u);
  EXPECT_GE((*got)[0].PublishedUnixMs(), before_ms - 1000);
}

TEST_F(NatsClientTest, InterruptEndsABlockedFetch) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.idle", "shoal_idle", ConsumerOptions{});
  ASSERT_TRUE(pc.ok());
  auto fetch = std::async(std::launch::async, [&] { return (*pc)->Fetch(1, 60000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  (*pc)->Interrupt();
  // Far sooner than the 60 s long poll: the fetcher can be stopped at once.
  ASSERT_EQ(fetch.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  auto r = fetch.get();
  EXPECT_TRUE(!r.ok() || r->empty());
  // The durable consumer outlives the subscription.
  auto again = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.idle", "shoal_idle", ConsumerOptions{});
  EXPECT_TRUE(again.ok());
}

TEST_F(NatsClientTest, InterruptKeepsWhatTheServerAlreadySentForTakeQueued) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  ConsumerOptions co;  // AckWait 30 s: a lost delivery would be back only then
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.late", "shoal_late", co);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  ASSERT_NO_FATAL_FAILURE(DeliverUnfetched(*client_, **pc, "shoal.work.late", "shoal_late"));

  (*pc)->Interrupt();
  std::vector<Delivery> late = (*pc)->TakeQueued(5000);
  ASSERT_EQ(late.size(), 2u);
  EXPECT_EQ(late[0].Data(), "b");
  EXPECT_EQ(late[1].Data(), "c");
  for (Delivery& d : late) ASSERT_TRUE(d.Nak().ok());
  ExpectHandedBack(*client_, "shoal.work.late", "shoal_late", co);
}

// Wake ends a long Fetch at once and keeps the subscription: its pull stays
// listed, and what the server sends to it queues here for the next Fetch.
TEST_F(NatsClientTest, WakeEndsABlockedFetchAndKeepsTheSubscription) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  ConsumerOptions co;
  auto pc = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.wake", "shoal_wake", co);
  ASSERT_TRUE(pc.ok()) << pc.status().ToString();
  auto fetch = std::async(std::launch::async, [&] { return (*pc)->Fetch(4, 60000); });
  // Until the Fetch is waiting, a wake is skipped as a leftover (see Wake):
  // repeat it, as a stopping model does.
  while (fetch.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) ASSERT_TRUE((*pc)->Wake());
  auto got = fetch.get();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(got->empty());

  jsErrCode jerr = static_cast<jsErrCode>(0);
  ASSERT_EQ(js_Publish(nullptr, client_->js(), "shoal.work.wake", "w", 1, nullptr, &jerr), NATS_OK);
  // The subscription is still there: the message comes to it (whether to
  // the woken Fetch's pull, still listed, or to the next one).
  std::vector<Delivery> again;
  for (int i = 0; i < 20 && again.empty(); ++i) {
    auto got2 = (*pc)->Fetch(1, 500);
    ASSERT_TRUE(got2.ok()) << got2.status().ToString();
    again = std::move(*got2);
  }
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].Data(), "w");
  EXPECT_EQ(again[0].NumDelivered(), 1u);
  (void)again[0].Ack();
}

// While other pulls already ask for more than is waiting (here: a pull
// stuck behind MaxAckPending), the server refuses a no_wait pull at once
// ("408 Requests Pending"). Fetch then waits in line with a plain pull
// rather than returning empty at once (its caller would pull again at once:
// a spin), and gets the message when its turn comes.
TEST_F(NatsClientTest, AFetchRefusedAsRequestsPendingWaitsInLine) {
  ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
  ConsumerOptions co;
  co.max_ack_pending = 1;
  auto first = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.line", "shoal_line", co);
  auto second = PullConsumer::Create(*client_, "SHOAL_WORK", "shoal.work.line", "shoal_line", co);
  ASSERT_TRUE(first.ok() && second.ok());
  jsErrCode jerr = static_cast<jsErrCode>(0);
  for (const char* data : {"a", "b"})
    ASSERT_EQ(js_Publish(nullptr, client_->js(), "shoal.work.line", data, 1, nullptr, &jerr), NATS_OK);
  auto a = (*first)->Fetch(1, 5000);
  ASSERT_TRUE(a.ok() && a->size() == 1u);  // "a" unacked: nothing more goes out
  // A pull listed ahead, for more than the one message waiting; it expires
  // after 300 ms.
  const std::string pull = R"({"batch":5,"expires":300000000})";
  ASSERT_EQ(natsConnection_PublishRequest(client_->conn(), "$JS.API.CONSUMER.MSG.NEXT.SHOAL_WORK.shoal_line",
                                          (*first)->Inbox().c_str(), pull.data(), static_cast<int>(pull.size())),
            NATS_OK);
  ASSERT_TRUE(client_->Flush(1000).ok());
  auto b = std::async(std::launch::async, [&] { return (*second)->Fetch(4, 5000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the pull ahead has expired
  ASSERT_TRUE((*a)[0].Ack().ok());  // room for "b"
  auto got = b.get();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].Data(), "b");
  (void)(*got)[0].Ack();
}

void Echo(natsConnection* nc, natsSubscription*, natsMsg* msg, void*) {
  const char* reply = natsMsg_GetReply(msg);
  if (reply != nullptr) {
    std::string out = "echo:" + std::string(natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
    natsConnection_Publish(nc, reply, out.data(), static_cast<int>(out.size()));
  }
  natsMsg_Destroy(msg);
}

TEST_F(NatsClientTest, RequestReply) {
  EXPECT_EQ(client_->Request("ctl.nobody", "x", 500).status().code(), StatusCode::kUnavailable);
  auto sub = client_->Subscribe("ctl.echo", &Echo, nullptr);
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(client_->Flush(1000).ok());
  auto r = client_->Request("ctl.echo", "hi", 2000);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, "echo:hi");
}

// A handler that takes a while, so the test can end its subscription while
// it runs.
struct SlowHandler {
  std::atomic<bool> entered{false};
  std::atomic<bool> finished{false};
};
void Slow(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
  auto* h = static_cast<SlowHandler*>(closure);
  h->entered = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  h->finished = true;
  natsMsg_Destroy(msg);
}

// nats.c can still be running a handler after natsSubscription_Unsubscribe
// returns; destroying the Subscription waits for it, so what the handler's
// closure points to may be freed right after.
TEST_F(NatsClientTest, EndingASubscriptionWaitsForItsRunningHandler) {
  SlowHandler h;
  auto sub = client_->Subscribe("slow.x", &Slow, &h);
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  ASSERT_TRUE(client_->Flush(1000).ok());
  ASSERT_TRUE(client_->Publish("slow.x", "m").ok());
  ASSERT_TRUE(shoal::testing::Eventually([&] { return h.entered.load(); }));
  sub->reset();
  EXPECT_TRUE(h.finished.load()) << "the handler was still running after its subscription ended";
}

// Messages the subscription had received but not yet handed over when it
// ended still reach the handler (a worker's queued pushed work and control
// requests get their answers instead of waiting out their callers).
TEST_F(NatsClientTest, EndingASubscriptionHandsOverWhatItHadReceived) {
  struct Counter {
    std::atomic<int> handled{0};
  } counter;
  const auto count = [](natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ++static_cast<Counter*>(closure)->handled;
    natsMsg_Destroy(msg);
  };
  auto sub = client_->Subscribe("queued.x", count, &counter);
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  ASSERT_TRUE(client_->Flush(1000).ok());
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(client_->Publish("queued.x", "m").ok());
  // A round trip after the publishes: the server has sent all ten here.
  ASSERT_TRUE(client_->Flush(1000).ok());
  ASSERT_TRUE(shoal::testing::Eventually([&] { return counter.handled.load() >= 1; }));
  sub->reset();
  EXPECT_EQ(counter.handled.load(), 10);
}

// A subscription that outlives its connection ends at once (the connection
// closed it) instead of waiting out Subscription::kMaxWaitMs.
TEST_F(NatsClientTest, SubscriptionOutlivingItsConnectionEndsAtOnce) {
  NatsOptions no;
  no.url = server_.url();
  auto other = NatsClient::Connect(no);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto sub = (*other)->Subscribe("gone.x", &Echo, nullptr);
  ASSERT_TRUE(sub.ok());
  other->reset();
  const auto t0 = std::chrono::steady_clock::now();
  sub->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(Subscription::kMaxWaitMs));
}

}  // namespace
}  // namespace shoal
