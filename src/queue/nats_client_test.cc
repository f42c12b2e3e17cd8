// Integration tests against a real nats-server -js on a free loopback port.
#include "queue/nats_client.h"

#include <nats/nats.h>

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

}  // namespace
}  // namespace shoal
