// Integration tests of OCR on the pull path with blob offload: a real
// nats-server -js, the real Worker serving the demo OCR model on Tesseract,
// the gateway's Dispatcher in-process, and a local-directory blob store
// shared by both. Also work messages whose payload reference is missing or
// tampered with, published by hand.
#include <algorithm>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nats/nats.h>

#include "blob/blob_offload.h"
#include "gateway/dispatcher.h"
#include "support/held_offload_thread.h"
#include "support/test_env.h"
#include "wire/work_message.h"
#include "worker/worker.h"

namespace shoal {
namespace {

using shoal::testing::ModelsDir;
using shoal::testing::TestNatsServer;
using namespace std::chrono_literals;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class OcrOffloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NatsOptions no;
    no.url = server_.url();
    auto c = NatsClient::Connect(no);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    store_url_ = "file://" + blobs_.path() + "/blobs";
    WorkerOptions wo;
    wo.model_repository = ModelsDir();
    wo.models = {"ocr-eng"};
    wo.intra_op_threads = 1;
    wo.blob.store_url = store_url_;
    AdjustWorker(wo);
    auto w = Worker::Create(wo, client_.get(), &metrics_);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    worker_ = std::move(w).value();
    BlobOffloadOptions bo;
    bo.store_url = store_url_;
    bo.threshold_bytes = 0;  // every request goes through the store
    auto b = BlobOffload::Create(bo, client_.get(), &metrics_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    offload_ = std::move(b).value();
    auto d = Dispatcher::Create(DispatcherOptions{}, client_.get(), &metrics_);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dispatcher_ = std::move(d).value();
    dispatcher_->SetBlobOffload(offload_.get());
  }
  void TearDown() override {
    if (dispatcher_) dispatcher_->Stop();
    offload_.reset();
  }
  // A test's own worker settings, on top of the fixture's.
  virtual void AdjustWorker(WorkerOptions&) {}

  // Submits one OCR request of the demo image (offloaded: the fixture's
  // threshold is 0).
  std::future<Result<ItemResult>> SubmitImage() {
    ItemJob job;
    job.task = "ocr";
    job.model = "ocr-eng";
    job.items = {Slurp(shoal::testing::SourceDir() + "/testdata/ocr/eng.png")};
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 60000;
    auto p = std::make_shared<std::promise<Result<ItemResult>>>();
    auto f = p->get_future();
    dispatcher_->SubmitItems(std::move(job), [p](Result<ItemResult> r) { p->set_value(std::move(r)); });
    return f;
  }
  double WorkerCounter(const std::string& name) {
    return metrics_.GetCounter(name, "", {{"model", "ocr-eng"}})->Value();
  }

  size_t BlobFiles() const {
    size_t n = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(blobs_.path() + "/blobs", ec)) n += e.is_regular_file();
    return n;
  }

  // Publishes a work message for ocr-eng whose body is only `ref` and
  // returns the worker's reply.
  wire::WorkReply SendRef(const std::string& ref) { return SendWork(ref, ""); }
  // The same for a message carrying reference `ref` (none when empty) and
  // body `body`. The reply must come in the message (not by reference).
  wire::WorkReply SendWork(const std::string& ref, const std::string& body) {
    inboxes_.push_back(std::make_unique<Inbox>());
    Inbox& inbox = *inboxes_.back();
    const std::string subject = client_->NewInbox();
    auto sub = client_->Subscribe(
        subject,
        [](natsConnection*, natsSubscription*, natsMsg* m, void* closure) {
          auto* in = static_cast<Inbox*>(closure);
          std::string data(natsMsg_GetData(m), static_cast<size_t>(natsMsg_GetDataLength(m)));
          natsMsg_Destroy(m);
          std::call_once(in->once, [&] { in->got.set_value(data); });
        },
        &inbox);
    EXPECT_TRUE(sub.ok());
    natsMsg* raw = nullptr;
    EXPECT_EQ(natsMsg_Create(&raw, wire::WorkSubject("ocr-eng").c_str(), nullptr, body.data(),
                             static_cast<int>(body.size())),
              NATS_OK);
    NatsMsgPtr msg(raw);
    const std::string deadline = std::to_string(SystemClock::Get()->NowUnixMs() + 60000);
    natsMsgHeader_Set(raw, wire::kHdrRequestId, "by-hand");
    natsMsgHeader_Set(raw, wire::kHdrChunk, "0/1");
    natsMsgHeader_Set(raw, wire::kHdrDeadline, deadline.c_str());
    natsMsgHeader_Set(raw, wire::kHdrReplyTo, subject.c_str());
    if (!ref.empty()) natsMsgHeader_Set(raw, wire::kHdrPayloadRef, ref.c_str());
    EXPECT_TRUE(client_->PublishMsg(raw).ok());
    auto f = inbox.got.get_future();
    if (f.wait_for(60s) != std::future_status::ready) {
      ADD_FAILURE() << "no reply";
      return {};
    }
    auto reply = wire::DecodeWorkReply(f.get());
    EXPECT_TRUE(reply.ok());
    return reply.ok() ? *reply : wire::WorkReply{};
  }

  static std::string EncodedWork() {
    wire::WorkBody body;
    body.task = "ocr";
    body.model = "ocr-eng";
    body.items = {Slurp(shoal::testing::SourceDir() + "/testdata/ocr/eng.png")};
    return wire::EncodeWorkBody(body);
  }
  std::string StoredWork() {
    auto ref = offload_->Put(EncodedWork(), "request");
    EXPECT_TRUE(ref.ok());
    return ref.ok() ? ref->ToString() : "";
  }

  // One per SendRef, kept until the fixture goes (declared before client_,
  // so destroyed after it): set_value wakes SendRef, which may return while
  // call_once is still finishing on nats.c's thread. With the inbox on
  // SendRef's stack, the next SendRef's inbox took its place and that late
  // write marked the new once_flag done, so the next reply was dropped (a
  // "no reply" failure in about one run in four).
  struct Inbox {
    std::promise<std::string> got;
    std::once_flag once;
  };
  std::deque<std::unique_ptr<Inbox>> inboxes_;
  TestNatsServer server_;
  shoal::testing::TempDir blobs_;
  std::string store_url_;
  MetricsRegistry metrics_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<BlobOffload> offload_;
  std::unique_ptr<Dispatcher> dispatcher_;
};

TEST_F(OcrOffloadTest, OffloadedRequestIsAnsweredAndItsBlobDeleted) {
  auto r = SubmitImage().get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->items.size(), 1u);
  EXPECT_NE(r->items[0].find("quick"), std::string::npos);
  EXPECT_NE(metrics_.Render().find("shoal_blob_offloaded_total{kind=\"request\"} 1"), std::string::npos);
  EXPECT_NE(metrics_.Render().find("shoal_blob_fetched_total 1"), std::string::npos);
  for (int i = 0; i < 200 && BlobFiles() > 0; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(BlobFiles(), 0u);
}

// A worker holds at most --blob-max-fetched of offloaded payloads (here:
// one payload at a time, whatever its size). The messages pulled beside
// the first wait, pulled, for room before their payloads are fetched; their
// progress is noted from the pull, so none is redelivered though they wait
// longer than AckWait (300 ms here), and every request is answered.
class OcrOffloadOnePayloadTest : public OcrOffloadTest {
 protected:
  void AdjustWorker(WorkerOptions& wo) override {
    wo.blob.max_fetched_bytes = 1;
    wo.consumer.ack_wait_ms = 300;
  }
};

TEST_F(OcrOffloadOnePayloadTest, PulledWorkWaitsForRoomBeforeItsPayloadIsFetched) {
  std::vector<std::future<Result<ItemResult>>> answers;
  for (int i = 0; i < 8; ++i) answers.push_back(SubmitImage());
  for (auto& f : answers) {
    ASSERT_EQ(f.wait_for(60s), std::future_status::ready);
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->items.size(), 1u);
    EXPECT_NE(r->items[0].find("quick"), std::string::npos) << r->items[0];
  }
  EXPECT_GT(WorkerCounter("shoal_worker_blob_payload_waits_total"), 0);
  EXPECT_EQ(WorkerCounter("shoal_worker_redelivered_total"), 0);
  // Every payload's share given back once its work was answered.
  EXPECT_TRUE(shoal::testing::Eventually([&] {
    return metrics_.GetGauge("shoal_worker_blob_fetched_bytes", "")->Value() == 0;
  }));
}

// A result the store cannot take for now (here: the store's directory is a
// file) is not an error at once: the work is handed back and runs again on
// a later delivery; on its last one the caller gets 503
// blob_store_unavailable (the store may take it later), not a final 502.
class OcrOffloadEveryReplyByRefTest : public OcrOffloadTest {
 protected:
  void AdjustWorker(WorkerOptions& wo) override {
    wo.blob.threshold_bytes = 0;  // every reply goes through the store
    wo.consumer.max_deliver = 2;
  }
};

TEST_F(OcrOffloadEveryReplyByRefTest, AResultTheStoreCannotTakeRunsAgainThen503) {
  const std::string dir = blobs_.path() + "/blobs";
  std::filesystem::remove_all(dir);
  std::ofstream(dir) << "not a directory";
  const double handed_back = WorkerCounter("shoal_worker_handed_back_total");
  auto reply = SendWork("", EncodedWork());
  EXPECT_EQ(reply.status.code(), StatusCode::kUnavailable) << reply.status.ToString();
  EXPECT_EQ(reply.status.reason(), "blob_store_unavailable");
  EXPECT_NE(reply.status.message().find("cannot store the result"), std::string::npos) << reply.status.message();
  EXPECT_EQ(WorkerCounter("shoal_worker_handed_back_total"), handed_back + 1);  // ran on both deliveries
  // The store back: results go by reference again.
  std::filesystem::remove(dir);
  std::filesystem::create_directories(dir);
  auto r = SubmitImage().get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NE(r->items[0].find("quick"), std::string::npos);
}

TEST_F(OcrOffloadTest, TamperedPayloadIsBlobCorrupt) {
  const std::string ref = StoredWork();
  auto parsed = ParseBlobRef(ref);
  ASSERT_TRUE(parsed.ok());
  const std::string path = blobs_.path() + "/blobs/" + parsed->name;
  std::string bytes = Slurp(path);
  ASSERT_FALSE(bytes.empty());
  bytes[bytes.size() / 2] ^= 0x5a;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto reply = SendRef(ref);
  EXPECT_EQ(reply.request_id, "by-hand");
  EXPECT_EQ(reply.status.code(), StatusCode::kBadGateway);
  EXPECT_EQ(reply.status.reason(), kBlobCorrupt);
}

// Two bad references in a row to the same worker: each gets its own error.
TEST_F(OcrOffloadTest, MissingPayloadIsBlobNotFoundMalformedReferenceIsBlobRefInvalid) {
  const std::string ref = StoredWork();
  ASSERT_TRUE(offload_->Delete(ref).ok());
  auto reply = SendRef(ref);
  EXPECT_EQ(reply.status.code(), StatusCode::kBadGateway);
  EXPECT_EQ(reply.status.reason(), kBlobNotFound);
  auto bad = SendRef("file://local/..?size=1&sha256=zz");
  EXPECT_EQ(bad.status.code(), StatusCode::kBadGateway);
  EXPECT_EQ(bad.status.reason(), kBlobRefInvalid);
}

// A request's replies are handled in the order they came even when one
// comes by reference (fetched from the store on another thread): a streamed
// event over the threshold is neither overtaken by the events after it nor
// dropped behind the final reply. And a redelivered copy of a chunk already
// answered whose payload is lost does not fail the request. Here the test
// is the worker: it answers the work by hand.
TEST_F(OcrOffloadTest, RepliesByReferenceStayInOrderAndALostCopyIsIgnored) {
  auto consumer = PullConsumer::Create(*client_, "SHOAL_WORK", wire::WorkSubject("by-hand"),
                                       wire::ConsumerName("by-hand"), ConsumerOptions{});
  ASSERT_TRUE(consumer.ok()) << consumer.status().ToString();
  std::mutex mu;
  std::vector<std::pair<size_t, std::string>> events;  // guarded by mu
  std::promise<Result<ItemResult>> done;
  ItemJob job;
  job.task = "generate";
  job.model = "by-hand";
  job.items = {"first", "second"};  // two chunks
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 30000;
  dispatcher_->SubmitItems(
      std::move(job), [&](Result<ItemResult> r) { done.set_value(std::move(r)); },
      [&](size_t item, std::string_view chunk) {
        std::lock_guard<std::mutex> lock(mu);
        events.emplace_back(item, std::string(chunk));
        return true;
      });
  auto got = (*consumer)->Fetch(2, 10000);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  for (int i = 0; i < 20 && got->size() < 2; ++i) {
    auto more = (*consumer)->Fetch(2 - static_cast<int>(got->size()), 1000);
    if (more.ok())
      for (auto& d : *more) got->push_back(std::move(d));
  }
  ASSERT_EQ(got->size(), 2u);
  std::sort(got->begin(), got->end(),
            [](const Delivery& a, const Delivery& b) { return a.Header(wire::kHdrChunk) < b.Header(wire::kHdrChunk); });
  const std::string id(got->at(0).Header(wire::kHdrRequestId));
  const std::string reply_to(got->at(0).Header(wire::kHdrReplyTo));
  const auto publish = [&](const std::string& data, const std::string& ref, int chunk) {
    natsMsg* raw = nullptr;
    ASSERT_EQ(natsMsg_Create(&raw, reply_to.c_str(), nullptr, data.data(), static_cast<int>(data.size())), NATS_OK);
    NatsMsgPtr msg(raw);
    if (!ref.empty()) {
      natsMsgHeader_Set(raw, wire::kHdrPayloadRef, ref.c_str());
      natsMsgHeader_Set(raw, wire::kHdrRequestId, id.c_str());
      natsMsgHeader_Set(raw, wire::kHdrChunk, std::to_string(chunk).c_str());
    }
    ASSERT_TRUE(client_->PublishMsg(raw).ok());
  };
  const auto reply = [&](int chunk, bool partial, int seq, std::string item) {
    wire::WorkReply r;
    r.request_id = id;
    r.chunk_index = chunk;
    r.partial = partial;
    r.seq = seq;
    r.rows = partial ? 0 : 1;
    r.items = {std::move(item)};
    return wire::EncodeWorkReply(r);
  };
  // Chunk 0: a 4 MiB event by reference, two small ones, then its result.
  const std::string big(size_t{4} << 20, 'b');
  auto big_ref = offload_->Put(reply(0, true, 0, big), "reply");
  ASSERT_TRUE(big_ref.ok()) << big_ref.status().ToString();
  publish("", big_ref->ToString(), 0);
  publish(reply(0, true, 1, "e1"), "", 0);
  publish(reply(0, true, 2, "e2"), "", 0);
  publish(reply(0, false, 0, "result0"), "", 0);
  // A redelivered copy of chunk 0 whose payload is gone, while chunk 1 is
  // still outstanding.
  publish("", "file://" + blobs_.path() + "/blobs/0000000000000000000000000000000000000000000000000000000000000000", 0);
  ASSERT_TRUE(client_->Flush(2000).ok());
  std::this_thread::sleep_for(300ms);  // let the copy's fetch fail first
  publish(reply(1, false, 0, "result1"), "", 1);
  auto f = done.get_future();
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  auto r = f.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->items, (std::vector<std::string>{"result0", "result1"}));
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].second.size(), big.size());
  EXPECT_EQ(events[1].second, "e1");
  EXPECT_EQ(events[2].second, "e2");
  for (const auto& e : events) EXPECT_EQ(e.first, 0u);
  for (auto& d : *got) (void)d.Ack();
}

// A reply's payload reference may name any blob (anyone who can publish on
// the gateway's reply subject can send one): the gateway deletes only reply
// blobs, never a request's payload a worker still needs.
// Publishes, on the gateway's reply subject, a reply by reference to `ref`
// for chunk 0 of `request_id`, as anyone who may publish there could.
void ForgeReply(NatsClient& client, const Dispatcher& dispatcher, const BlobRef& ref, const std::string& request_id) {
  natsMsg* raw = nullptr;
  ASSERT_EQ(natsMsg_Create(&raw, dispatcher.reply_subject().c_str(), nullptr, nullptr, 0), NATS_OK);
  NatsMsgPtr msg(raw);
  natsMsgHeader_Set(raw, wire::kHdrPayloadRef, ref.ToString().c_str());
  natsMsgHeader_Set(raw, wire::kHdrRequestId, request_id.c_str());
  natsMsgHeader_Set(raw, wire::kHdrChunk, "0");
  ASSERT_TRUE(client.PublishMsg(raw).ok());
  ASSERT_TRUE(client.Flush(2000).ok());
}

TEST_F(OcrOffloadTest, AReplyReferenceDeletesOnlyAReplysBlob) {
  auto request_blob = offload_->Put(std::string(64, 'q'), "request");
  auto reply_blob = offload_->Put(std::string(64, 'r'), "reply");
  ASSERT_TRUE(request_blob.ok() && reply_blob.ok());
  EXPECT_TRUE(BlobOffload::IsKind(reply_blob->ToString(), "reply"));
  EXPECT_FALSE(BlobOffload::IsKind(request_blob->ToString(), "reply"));
  Counter* dropped = metrics_.GetCounter("shoal_gateway_duplicate_replies_total", "");
  const int64_t dropped_before = dropped->Value();
  for (const BlobRef* ref : {&*request_blob, &*reply_blob}) ForgeReply(*client_, *dispatcher_, *ref, "no-such-request");
  ASSERT_TRUE(shoal::testing::Eventually([&] { return dropped->Value() == dropped_before + 2; }));
  EXPECT_TRUE(shoal::testing::Eventually([&] { return !offload_->Fetch(reply_blob->ToString()).ok(); }))
      << "the reply's blob was kept";
  auto kept = offload_->Fetch(request_blob->ToString());
  EXPECT_TRUE(kept.ok()) << "a request's payload was deleted: " << kept.status().ToString();
}

// The same for a request still waiting: the forged reply fails it (its
// blob holds no reply), and is deleted only when it is a reply's blob.
TEST_F(OcrOffloadTest, AReplyReferenceForAWaitingRequestDeletesOnlyAReplysBlob) {
  // Requests for a model no worker serves wait; their ids come from their
  // messages.
  struct Ids {
    std::mutex mu;
    std::vector<std::string> ids;
  } seen;
  auto sub = client_->Subscribe(
      wire::WorkSubject("nobody-serves-this"),
      [](natsConnection*, natsSubscription*, natsMsg* m, void* closure) {
        auto* s = static_cast<Ids*>(closure);
        const char* id = nullptr;
        if (natsMsgHeader_Get(m, wire::kHdrRequestId, &id) == NATS_OK) {
          std::lock_guard<std::mutex> lock(s->mu);
          s->ids.emplace_back(id);
        }
        natsMsg_Destroy(m);
      },
      &seen);
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  ASSERT_TRUE(client_->Flush(2000).ok());
  auto request_blob = offload_->Put(std::string(64, 'q'), "request");
  auto reply_blob = offload_->Put(std::string(64, 'r'), "reply");
  ASSERT_TRUE(request_blob.ok() && reply_blob.ok());
  for (const BlobRef* ref : {&*request_blob, &*reply_blob}) {
    ItemJob job;
    job.task = "ocr";
    job.model = "nobody-serves-this";
    job.items = {"an image"};
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 60000;
    auto answer = std::make_shared<std::promise<Result<ItemResult>>>();
    dispatcher_->SubmitItems(std::move(job), [answer](Result<ItemResult> r) { answer->set_value(std::move(r)); });
    std::string id;
    ASSERT_TRUE(shoal::testing::Eventually([&] {
      std::lock_guard<std::mutex> lock(seen.mu);
      if (seen.ids.empty()) return false;
      id = seen.ids.back();
      seen.ids.clear();
      return true;
    }));
    ForgeReply(*client_, *dispatcher_, *ref, id);
    auto f = answer->get_future();
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "the forged reply did not reach the request";
    EXPECT_FALSE(f.get().ok());
  }
  EXPECT_TRUE(shoal::testing::Eventually([&] { return !offload_->Fetch(reply_blob->ToString()).ok(); }))
      << "the reply's blob was kept";
  auto kept = offload_->Fetch(request_blob->ToString());
  EXPECT_TRUE(kept.ok()) << "a request's payload was deleted: " << kept.status().ToString();
}

// A request with a payload the store refuses (too much already waits to be
// stored) is answered 503 blob_store_busy at once, and none of its other
// work is queued after that: a worker would read it for a caller already
// answered. The payload stored before the refusal is deleted.
TEST_F(OcrOffloadTest, ARequestTheStoreRefusesQueuesNoneOfItsOtherWork) {
  // Declared in this order so that, however the test ends, the store is
  // released and the offload drained (its callbacks reach the dispatcher)
  // before the dispatcher goes.
  auto d = Dispatcher::Create(DispatcherOptions{}, client_.get(), &metrics_);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::unique_ptr<Dispatcher> dispatcher = std::move(d).value();
  BlobOffloadOptions bo;
  bo.store_url = store_url_;
  bo.threshold_bytes = 1000;
  bo.threads = 1;
  bo.max_queued_bytes = 1000;
  auto b = BlobOffload::Create(bo, client_.get(), &metrics_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::unique_ptr<BlobOffload> busy = std::move(b).value();
  shoal::testing::HeldOffloadThread held(*busy);  // the store is "slow"
  dispatcher->SetBlobOffload(busy.get());
  Counter* published = metrics_.GetCounter("shoal_gateway_chunks_published_total", "");
  const int64_t published_before = published->Value();

  const std::string image = Slurp(shoal::testing::SourceDir() + "/testdata/ocr/eng.png");
  ASSERT_GT(image.size(), bo.threshold_bytes);
  ItemJob job;
  job.task = "ocr";
  job.model = "ocr-eng";
  // The first waits to be stored, the second is refused, the third would
  // travel in its message (under the threshold).
  job.items = {image, image, "small"};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 60000;
  auto answer = std::make_shared<std::promise<Result<ItemResult>>>();
  dispatcher->SubmitItems(std::move(job), [answer](Result<ItemResult> r) { answer->set_value(std::move(r)); });
  auto f = answer->get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "not answered while the store was busy";
  auto r = f.get();
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "blob_store_busy");
  EXPECT_EQ(published->Value(), published_before) << "work of an answered request was queued";
  held.Open();
  EXPECT_TRUE(shoal::testing::Eventually([&] { return BlobFiles() == 0; }))
      << "the payload stored for the answered request was left";
  EXPECT_EQ(published->Value(), published_before);
  dispatcher->Stop();
}

}  // namespace
}  // namespace shoal
