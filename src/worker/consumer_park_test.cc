// ConsumerPark against a real nats-server -js on a free loopback port.
#include "worker/consumer_park.h"

#include <nats/nats.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/test_env.h"
#include "wire/work_message.h"

namespace shoal {
namespace {

constexpr const char* kStream = "SHOAL_WORK";
constexpr const char* kSubject = "shoal.work.parked";
constexpr const char* kDurable = "shoal_parked";

class ConsumerParkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NatsOptions o;
    o.url = server_.url();
    auto c = NatsClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    ASSERT_TRUE(EnsureWorkStream(*client_, {}).ok());
    options_.ack_wait_ms = 60000;  // a dropped message would be back only after the test
  }
  std::unique_ptr<PullConsumer> Consumer() {
    auto pc = PullConsumer::Create(*client_, kStream, kSubject, kDurable, options_);
    EXPECT_TRUE(pc.ok()) << pc.status().ToString();
    return pc.ok() ? std::move(pc).value() : nullptr;
  }
  // A work message (a park hands back only what has a caller to answer).
  void Publish(const std::string& data, const std::string& reply_to = "reply.none") {
    natsMsg* work = nullptr;
    ASSERT_EQ(natsMsg_Create(&work, kSubject, nullptr, data.data(), static_cast<int>(data.size())), NATS_OK);
    natsMsgHeader_Set(work, wire::kHdrRequestId, ("r-" + data).c_str());
    natsMsgHeader_Set(work, wire::kHdrReplyTo, reply_to.c_str());
    jsErrCode jerr = static_cast<jsErrCode>(0);
    ASSERT_EQ(js_PublishMsg(nullptr, client_->js(), work, nullptr, &jerr), NATS_OK);
    natsMsg_Destroy(work);
  }
  // A model's fetcher stopping as ModelServer::Stop does: a pull of
  // `poll_ms` listed at the server, the Fetch woken, the pull left behind.
  void StopFetching(PullConsumer& c, int64_t poll_ms) {
    auto fetch = std::async(std::launch::async, [&] { return c.Fetch(4, poll_ms); });
    while (fetch.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) ASSERT_TRUE(c.Wake());
    auto got = fetch.get();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_TRUE(got->empty());
  }
  // Up to `n` messages fetched within about `ms`.
  std::vector<Delivery> FetchFor(PullConsumer& c, size_t n, int64_t ms) {
    std::vector<Delivery> out;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (out.size() < n && std::chrono::steady_clock::now() < end) {
      auto got = c.Fetch(static_cast<int>(n - out.size()), 200);
      EXPECT_TRUE(got.ok()) << got.status().ToString();
      if (!got.ok()) break;
      for (Delivery& d : *got) out.push_back(std::move(d));
    }
    return out;
  }
  ConsumerParkOptions ParkOptions() {
    ConsumerParkOptions po;
    po.client = client_.get();
    po.worker_id = "w-park";
    return po;
  }

  shoal::testing::TestNatsServer server_;
  std::unique_ptr<NatsClient> client_;
  ConsumerOptions options_;
};

// The case the park exists for. nats-server 2.9 drops a -NAKed message
// that meets only pulls of closed subscriptions (and sends the next message
// of the stream again instead). With the stopped model's subscription
// parked, its pull is still someone's: the message is handed back through
// it and reaches the next consumer. (With the subscription closed instead,
// the next consumer got "n" a second time and never "m".)
TEST_F(ConsumerParkTest, AHandedBackMessageIsNotDroppedWhileAStoppedModelsPullIsListed) {
  // Every subscription first: with `next` bound after the stop, the drop
  // did not show even with the subscription closed (not investigated).
  auto runner = Consumer();
  auto stopped = Consumer();
  auto next = Consumer();
  ASSERT_TRUE(runner && stopped && next);
  Publish("m");
  auto m = FetchFor(*runner, 1, 5000);
  ASSERT_EQ(m.size(), 1u);
  Publish("n");
  auto n = FetchFor(*runner, 1, 5000);
  ASSERT_EQ(n.size(), 1u);
  ASSERT_TRUE(n[0].Ack().ok());

  ConsumerPark park(ParkOptions());
  StopFetching(*stopped, 1500);
  park.Park("parked", std::move(stopped), 0);  // the consumer knows its pull's 1.5 s
  ASSERT_TRUE(m[0].Nak().ok());  // "m" handed back while the stopped pull is listed
  ASSERT_TRUE(client_->Flush(1000).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the server has acted on it

  auto again = FetchFor(*next, 1, 10000);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].Data(), "m");
  EXPECT_GE(again[0].NumDelivered(), 2u);
  (void)again[0].Ack();
  for (int i = 0; i < 500 && park.size() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(park.size(), 0u);  // closed once its pull expired
}

// A model loaded again takes its subscription back, with what the server
// delivered to it in between: first delivery, no hand-back.
TEST_F(ConsumerParkTest, TakeGivesBackTheSubscriptionWithWhatWasDeliveredToIt) {
  ConsumerPark park(ParkOptions());
  auto stopped = Consumer();
  ASSERT_TRUE(stopped);
  PullConsumer* raw = stopped.get();
  StopFetching(*stopped, 30000);
  park.Park("parked", std::move(stopped), 30000);
  Publish("a");
  for (int i = 0; i < 500 && raw->Undelivered() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));

  EXPECT_EQ(park.Take("other"), nullptr);
  auto back = park.Take("parked");
  ASSERT_EQ(back.get(), raw);
  EXPECT_EQ(park.size(), 0u);
  auto got = FetchFor(*back, 1, 5000);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].Data(), "a");
  EXPECT_EQ(got[0].NumDelivered(), 1u);
  (void)got[0].Ack();
}

// Not taken back, the subscription is closed once its pull has expired, and
// what arrived is handed back (redelivered at once, not after AckWait), but
// work on its last allowed delivery is answered instead: worker_stopping.
TEST_F(ConsumerParkTest, ClosingHandsBackWhatArrivedAndAnswersTheLastDelivery) {
  options_.max_deliver = 2;
  natsSubscription* replies = nullptr;
  ASSERT_EQ(natsConnection_SubscribeSync(&replies, client_->conn(), "reply.last"), NATS_OK);
  Publish("last", "reply.last");
  Publish("a");
  auto stopped = Consumer();
  ASSERT_TRUE(stopped);
  auto first = FetchFor(*stopped, 1, 5000);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].Data(), "last");
  ASSERT_TRUE(first[0].Nak().ok());
  // A pull answered after its Fetch gave up: "last" (its second and last
  // delivery) and "a" wait in the subscription, unfetched.
  const std::string pull = R"({"batch":2,"expires":1000000000})";
  ASSERT_EQ(natsConnection_PublishRequest(client_->conn(), "$JS.API.CONSUMER.MSG.NEXT.SHOAL_WORK.shoal_parked",
                                          stopped->Inbox().c_str(), pull.data(), static_cast<int>(pull.size())),
            NATS_OK);
  for (int i = 0; i < 500 && stopped->Undelivered() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(stopped->Undelivered(), 2);

  ConsumerParkOptions po = ParkOptions();
  po.max_deliver = options_.max_deliver;
  ConsumerPark park(po);
  park.Park("parked", std::move(stopped), 1000);
  for (int i = 0; i < 1000 && park.size() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(park.size(), 0u);

  natsMsg* reply = nullptr;
  ASSERT_EQ(natsSubscription_NextMsg(&reply, replies, 5000), NATS_OK);
  auto decoded = wire::DecodeWorkReply(std::string_view(natsMsg_GetData(reply), natsMsg_GetDataLength(reply)));
  natsMsg_Destroy(reply);
  natsSubscription_Destroy(replies);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->request_id, "r-last");
  EXPECT_EQ(decoded->status.reason(), "worker_stopping");

  auto next = Consumer();
  ASSERT_TRUE(next);
  auto again = FetchFor(*next, 2, 3000);
  ASSERT_EQ(again.size(), 1u);  // "last" was terminated, not handed back
  EXPECT_EQ(again[0].Data(), "a");
  EXPECT_EQ(again[0].NumDelivered(), 2u);
  (void)again[0].Ack();
}

}  // namespace
}  // namespace shoal
