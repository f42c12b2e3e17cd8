// Integration tests of the pull path: a real nats-server -js, the real
// Worker (tiny-bert on libtorch) and the gateway's Dispatcher in-process.
#include "worker/worker.h"

#include <signal.h>
#include <sys/wait.h>

#include <new>
#include <unistd.h>

#include <nats/nats.h>

#include <cmath>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "gateway/dispatcher.h"
#include "runtime/runtime.h"
#include "worker/model_server.h"
#include "support/forwarding_runtime.h"
#include "support/test_env.h"
#include "wire/work_message.h"

namespace shoal {
namespace {

using shoal::testing::ModelsDir;
using shoal::testing::TestNatsServer;

// Wraps the real runtime; fails any batch that contains token id 999, throws
// std::bad_alloc on one that contains 995, refuses one that contains 996 as
// bad input, goes
// away for 300 ms (as a crashed out-of-process runtime does while it
// restarts) on one that contains 997, and takes 3.5 s over one that
// contains 998.
class FailingRuntime : public shoal::testing::ForwardingRuntime {
 public:
  FailingRuntime(std::unique_ptr<Runtime> inner, std::atomic<int>* runs) : ForwardingRuntime(std::move(inner)), runs_(runs) {}
  Result<Embeddings> Run(const TokenBatch& b) override {
    ++*runs_;
    if (!Available()) return Unavailable("restarting");
    for (int64_t id : b.input_ids) {
      if (id == 999) return Internal("injected failure");
      if (id == 995) throw std::bad_alloc();
      if (id == 996) return InvalidArgument("injected refusal of the input", "token_type_out_of_range");
      if (id == 997) {
        down_until_us_ = SystemClock::Get()->NowMonoUs() + 300'000;
        return Unavailable("injected crash");
      }
      if (id == 998) std::this_thread::sleep_for(std::chrono::milliseconds(3500));
    }
    return inner().Run(b);
  }
  bool Available() const override { return SystemClock::Get()->NowMonoUs() >= down_until_us_; }

 private:
  std::atomic<int>* runs_;
  std::atomic<int64_t> down_until_us_{0};
};

class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NatsOptions no;
    no.url = server_.url();
    auto c = NatsClient::Connect(no);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    ASSERT_NO_FATAL_FAILURE(StartWorker());
    DispatcherOptions dopt;
    dopt.chunk_size = 3;
    auto d = Dispatcher::Create(dopt, client_.get(), &metrics_);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dispatcher_ = std::move(d).value();
  }

  void StartWorker() {
    WorkerOptions wo;
    wo.model_repository = ModelsDir();
    wo.models = {"tiny-bert"};
    wo.intra_op_threads = 1;
    wo.consumer.ack_wait_ms = 1000;
    wo.runtime_factory = [this](const ModelConfig& cfg) -> Result<std::unique_ptr<Runtime>> {
      ASSIGN_OR_RETURN(auto inner, CreateRuntime(cfg.runtime));
      return std::unique_ptr<Runtime>(new FailingRuntime(std::move(inner), &runs_));
    };
    auto w = Worker::Create(wo, client_.get(), &metrics_);
    ASSERT_TRUE(w.ok()) << w.status().ToString() << " (run scripts/setup.sh to generate the demo models)";
    worker_ = std::move(w).value();
  }

  Result<EmbedResult> Embed(std::vector<std::string> texts, bool truncate = false, int64_t timeout_ms = 20000) {
    EmbedJob job;
    job.model = "tiny-bert";
    job.texts = std::move(texts);
    job.truncate = truncate;
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + timeout_ms;
    return Submit(std::move(job));
  }

  Result<EmbedResult> Submit(EmbedJob job) {
    std::promise<Result<EmbedResult>> p;
    auto f = p.get_future();
    dispatcher_->SubmitEmbed(std::move(job), [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
    return f.get();
  }

  TestNatsServer server_;
  MetricsRegistry metrics_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::atomic<int> runs_{0};
};

std::vector<float> Row(const EmbedResult& r, int i) {
  return {r.data.begin() + static_cast<size_t>(i) * r.dim, r.data.begin() + static_cast<size_t>(i + 1) * r.dim};
}

TEST_F(WorkerTest, EmbedsAndReassemblesChunksInOrder) {
  std::vector<std::string> texts;
  for (int i = 0; i < 10; ++i) texts.push_back("sentence number " + std::to_string(i) + (i % 2 ? " with more words in it" : ""));
  auto all = Embed(texts);  // chunk size 3: 4 queue messages
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->rows, 10);
  EXPECT_EQ(all->dim, 64);
  for (int i = 0; i < 10; ++i) {
    auto one = Embed({texts[i]});
    ASSERT_TRUE(one.ok());
    auto a = Row(*all, i), b = Row(*one, 0);
    double norm = 0;
    for (int k = 0; k < 64; ++k) {
      EXPECT_NEAR(a[k], b[k], 1e-4) << "row " << i;  // same vector batched or alone
      norm += a[k] * a[k];
    }
    EXPECT_NEAR(norm, 1.0, 1e-4);
  }
}

TEST_F(WorkerTest, CountsRealTokens) {
  auto r = Embed({"hello world", "hello"});
  ASSERT_TRUE(r.ok());
  auto a = Embed({"hello world"});
  auto b = Embed({"hello"});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(r->prompt_tokens, a->prompt_tokens + b->prompt_tokens);
  EXPECT_GE(b->prompt_tokens, 3);  // [CLS] hello [SEP]
}

TEST_F(WorkerTest, TooLongInputIs422UnlessTruncated) {
  std::string long_text;
  for (int i = 0; i < 400; ++i) long_text += "word ";
  auto r = Embed({"short", long_text});
  EXPECT_EQ(r.status().code(), StatusCode::kUnprocessable);
  EXPECT_EQ(r.status().reason(), "input_too_long");
  // Split into chunks of 3, the error still names the input as the client
  // numbered it (the fifth: input 4, the second of its chunk).
  r = Embed({"a", "b", "c", "d", long_text});
  EXPECT_EQ(r.status().reason(), "input_too_long");
  EXPECT_NE(r.status().message().find("input 4 has"), std::string::npos) << r.status().message();
  auto t = Embed({"short", long_text}, /*truncate=*/true);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->truncated_any);
  EXPECT_EQ(t->prompt_tokens - Embed({"short"})->prompt_tokens, 256);
}

TEST_F(WorkerTest, TokenIdsOutsideTheVocabularyAreRejected) {
  EmbedJob job;
  job.model = "tiny-bert";
  job.token_ids = {{7592, 2088}, {40000}};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 10000;
  auto r = Submit(job);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().reason(), "invalid_token_id");
  job.token_ids = {{7592, 2088}};
  EXPECT_TRUE(Submit(job).ok());
}

TEST_F(WorkerTest, RuntimeFailureIsATerminalErrorNotARetryLoop) {
  EmbedJob job;
  job.model = "tiny-bert";
  job.token_ids = {{999}};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 10000;
  const int before = runs_.load();
  auto r = Submit(job);
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_EQ(r.status().reason(), "runtime_error");
  // Well past ack_wait (1 s): a redelivery would have run the model again.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(runs_.load() - before, 1);
  EXPECT_EQ(GetStreamState(*client_, "SHOAL_WORK")->msgs, 0u);
  // The worker still serves.
  EXPECT_TRUE(Embed({"still alive"}).ok());
}

// A runtime that throws (an allocation its input made too large) fails
// that request with runtime_error; the worker lives on and serves.
TEST_F(WorkerTest, ARuntimeThatThrowsFailsTheRequestNotTheWorker) {
  EmbedJob job;
  job.model = "tiny-bert";
  job.token_ids = {{995}};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 10000;
  auto r = Submit(job);
  EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "runtime_error");
  EXPECT_NE(r.status().message().find("bad_alloc"), std::string::npos) << r.status().message();
  EXPECT_TRUE(Embed({"still alive"}).ok());
}

// An input the runtime refuses (a text pair for a model with one segment)
// is the caller's error with the runtime's code, not a 500 runtime_error.
TEST_F(WorkerTest, AnInputTheRuntimeRefusesIsTheCallersError) {
  EmbedJob job;
  job.model = "tiny-bert";
  job.token_ids = {{996}};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 10000;
  auto r = Submit(job);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "token_type_out_of_range");
  EXPECT_NE(r.status().message().find("injected refusal"), std::string::npos) << r.status().message();
  EXPECT_TRUE(Embed({"still alive"}).ok());
}

// A forward pass 3.5 times longer than AckWait (1 s here) is not
// redelivered while it runs: the worker notes progress on its messages.
// Two callers' messages in one batch, one of them with an input the model
// fails on: the batch is rerun message by message, so the other caller
// still gets its answer and only the bad one gets runtime_error. An input
// that takes the runtime down instead (a crash: the batch goes back to the
// queue) runs on its own from its third delivery, so it does not use up
// the other message's deliveries (5) with its own.
TEST_F(WorkerTest, OneCallersBadInputDoesNotFailTheOthersInItsBatch) {
  for (const int32_t bad : {999, 997}) {
    SCOPED_TRACE("token " + std::to_string(bad));
    worker_->Stop();
    worker_.reset();
    runs_ = 0;
    // Both messages wait in the stream, so the new worker pulls them into
    // one batch.
    const auto job = [](std::vector<int32_t> ids) {
      EmbedJob j;
      j.model = "tiny-bert";
      j.token_ids = {std::move(ids)};
      j.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 30000;
      return j;
    };
    // The bad one first in the stream, so it also runs first when each
    // runs alone: the other must then wait for the runtime to come back,
    // not be handed back into its restart.
    auto consumer = PullConsumer::Create(*client_, "SHOAL_WORK", wire::WorkSubject("tiny-bert"),
                                         wire::ConsumerName("tiny-bert"), ConsumerOptions{});
    ASSERT_TRUE(consumer.ok()) << consumer.status().ToString();
    const auto pending = [&](uint64_t want) {
      return shoal::testing::Eventually([&] {
        auto n = (*consumer)->NumPending();
        return n.ok() && *n == want;
      }, std::chrono::seconds(10));
    };
    auto poisoned = std::async(std::launch::async, [&] { return Submit(job({7592, bad})); });
    ASSERT_TRUE(pending(1));
    auto fine = std::async(std::launch::async, [&] { return Submit(job({7592, 2088})); });
    ASSERT_TRUE(pending(2));
    ASSERT_NO_FATAL_FAILURE(StartWorker());
    auto good = fine.get();
    EXPECT_TRUE(good.ok()) << good.status().ToString();
    auto r = poisoned.get();
    if (bad == 999) {
      EXPECT_EQ(r.status().reason(), "runtime_error") << r.status().ToString();
      EXPECT_EQ(runs_.load(), 3) << "the two together, then each alone";
    } else {
      EXPECT_EQ(r.status().reason(), "runtime_unavailable") << r.status().ToString();
      EXPECT_GE(runs_.load(), 3) << "the two together, then each alone";
    }
  }
}

TEST_F(WorkerTest, PassLongerThanAckWaitIsNotRedelivered) {
  EmbedJob job;
  job.model = "tiny-bert";
  job.token_ids = {{998}};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 20000;
  const int before = runs_.load();
  auto r = Submit(job);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rows, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // past AckWait again
  EXPECT_EQ(runs_.load() - before, 1) << "the message was redelivered and run again";
  EXPECT_EQ(metrics_.GetCounter("shoal_worker_redelivered_total", "", {{"model", "tiny-bert"}})->Value(), 0);
  EXPECT_EQ(GetStreamState(*client_, "SHOAL_WORK")->msgs, 0u);
}

// Work pulled while a long pass runs waits in the batcher for that pass:
// it is kept ours too (noted in progress from its pull, not only once its
// own batch runs), so it is not redelivered and run twice.
TEST_F(WorkerTest, WorkWaitingBehindALongPassIsNotRedelivered) {
  auto submit = [&](std::vector<std::vector<int32_t>> ids) {
    auto p = std::make_shared<std::promise<Result<EmbedResult>>>();
    EmbedJob job;
    job.model = "tiny-bert";
    job.token_ids = std::move(ids);
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 20000;
    dispatcher_->SubmitEmbed(std::move(job), [p](Result<EmbedResult> r) { p->set_value(std::move(r)); });
    return p->get_future();
  };
  const int before = runs_.load();
  auto slow = submit({{998}});  // a 3.5 s pass; AckWait is 1 s
  ASSERT_TRUE(shoal::testing::Eventually([&] { return runs_.load() > before; }, std::chrono::seconds(10)));
  auto waiting = submit({{5, 6}});
  auto a = slow.get();
  auto b = waiting.get();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // past AckWait again
  EXPECT_EQ(metrics_.GetCounter("shoal_worker_redelivered_total", "", {{"model", "tiny-bert"}})->Value(), 0);
  EXPECT_EQ(runs_.load() - before, 2) << "a message was redelivered and run again";
  EXPECT_EQ(GetStreamState(*client_, "SHOAL_WORK")->msgs, 0u);
}

TEST_F(WorkerTest, ExpiredWorkIsDroppedAndAcked) {
  // Publish work whose deadline already passed, straight to the queue.
  wire::WorkBody body;
  body.model = "tiny-bert";
  body.texts = {"too late"};
  std::string data = wire::EncodeWorkBody(body);
  std::string inbox = "_TEST.expired";
  std::promise<std::string> got;
  auto sub = client_->Subscribe(inbox, [](natsConnection*, natsSubscription*, natsMsg* m, void* c) {
    static_cast<std::promise<std::string>*>(c)->set_value(std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m)));
    natsMsg_Destroy(m);
  }, &got);
  ASSERT_TRUE(sub.ok());
  natsMsg* msg = nullptr;
  ASSERT_EQ(natsMsg_Create(&msg, wire::WorkSubject("tiny-bert").c_str(), nullptr, data.data(), data.size()), NATS_OK);
  natsMsgHeader_Set(msg, wire::kHdrRequestId, "late-1");
  natsMsgHeader_Set(msg, wire::kHdrReplyTo, inbox.c_str());
  natsMsgHeader_Set(msg, wire::kHdrDeadline, std::to_string(SystemClock::Get()->NowUnixMs() - 1000).c_str());
  const int before = runs_.load();
  ASSERT_TRUE(client_->PublishMsg(msg).ok());
  natsMsg_Destroy(msg);
  auto f = got.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto reply = wire::DecodeWorkReply(f.get());
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(runs_.load(), before) << "expired work must not reach the model";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(GetStreamState(*client_, "SHOAL_WORK")->msgs, 0u);
}

TEST_F(WorkerTest, RegistersHeartbeatAndCatalog) {
  auto workers = KvBucket::Open(*client_, wire::kWorkersBucket, 6000);
  ASSERT_TRUE(workers.ok());
  auto hb = (*workers)->Get(worker_->id());
  ASSERT_TRUE(hb.ok());
  EXPECT_NE(hb->find("\"tiny-bert\""), std::string::npos);
  EXPECT_NE(hb->find("\"device\":\"cpu\""), std::string::npos) << *hb;
  auto models = KvBucket::Open(*client_, wire::kModelsBucket, 0);
  ASSERT_TRUE(models.ok());
  auto entry = (*models)->Get("tiny-bert");
  ASSERT_TRUE(entry.ok());
  EXPECT_NE(entry->find("\"dim\":64"), std::string::npos);
  worker_->Stop();
  EXPECT_EQ((*workers)->Get(worker_->id()).status().code(), StatusCode::kNotFound);
}

// A gateway restarted under the same fixed --gateway-id numbers its
// requests anew: its first request must not be taken for the previous
// run's first (JetStream drops a repeated Nats-Msg-Id as a duplicate for 2
// minutes, and the caller would wait for its deadline).
TEST_F(WorkerTest, AGatewayRestartedUnderAFixedIdIsNotDeduplicatedAway) {
  DispatcherOptions dopt;
  dopt.gateway_id = "fixed-gw";
  for (int run = 0; run < 2; ++run) {
    auto d = Dispatcher::Create(dopt, client_.get(), &metrics_);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EmbedJob job;
    job.model = "tiny-bert";
    job.texts = {run == 0 ? "the first run" : "the second run"};
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 5000;
    std::promise<Result<EmbedResult>> p;
    auto f = p.get_future();
    (*d)->SubmitEmbed(job, [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << "run " << run << ": " << r.status().ToString();
    auto alone = Embed(job.texts);  // the fixture's own gateway
    ASSERT_TRUE(alone.ok());
    for (int k = 0; k < 64; ++k) EXPECT_NEAR(Row(*r, 0)[k], Row(*alone, 0)[k], 1e-4) << "run " << run;
  }
}

// Two gateway processes given the same --gateway-id (a rolling restart that
// overlaps) each get their own replies: neither takes the other's for a
// duplicate of a request it does not know.
TEST_F(WorkerTest, TwoGatewaysUnderOneIdTakeOnlyTheirOwnReplies) {
  DispatcherOptions dopt;
  dopt.gateway_id = "twin-gw";
  MetricsRegistry ma, mb;
  auto a = Dispatcher::Create(dopt, client_.get(), &ma);
  auto b = Dispatcher::Create(dopt, client_.get(), &mb);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->reply_subject(), (*b)->reply_subject());
  for (Dispatcher* d : {a->get(), b->get()}) {
    EmbedJob job;
    job.model = "tiny-bert";
    job.texts = {"one of twins"};
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 10000;
    std::promise<Result<EmbedResult>> p;
    d->SubmitEmbed(job, [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
    auto r = p.get_future().get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a stray reply would have come by now
  for (MetricsRegistry* m : {&ma, &mb})
    EXPECT_EQ(m->GetCounter("shoal_gateway_duplicate_replies_total", "")->Value(), 0);
  (*a)->Stop();
  (*b)->Stop();
}

// A request that fails (here: at its deadline, nobody serving) tells the
// workers to drop what is left of its work, as a caller that went away
// does; counted as a deadline, not as a client gone.
TEST_F(WorkerTest, AFailedRequestAnnouncesTheCancelOfItsWork) {
  worker_->Stop();  // no one answers
  struct FirstCancel {
    std::promise<std::string> id;
    std::once_flag once;
  } cancelled;
  auto sub = client_->Subscribe(
      wire::kCancelSubject,
      [](natsConnection*, natsSubscription*, natsMsg* m, void* c) {
        auto* first = static_cast<FirstCancel*>(c);
        std::string id(natsMsg_GetData(m), natsMsg_GetDataLength(m));
        natsMsg_Destroy(m);
        std::call_once(first->once, [&] { first->id.set_value(std::move(id)); });
      },
      &cancelled);
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(client_->Flush(2000).ok());
  MetricsRegistry m;
  auto d = Dispatcher::Create(DispatcherOptions{}, client_.get(), &m);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::promise<Result<EmbedResult>> done;
  EmbedJob job;
  job.model = "tiny-bert";
  job.texts = {"anyone?"};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 300;
  (*d)->SubmitEmbed(std::move(job), [&done](Result<EmbedResult> r) { done.set_value(std::move(r)); });
  EXPECT_EQ(done.get_future().get().status().code(), StatusCode::kDeadlineExceeded);
  auto f = cancelled.id.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(5)), std::future_status::ready) << "no cancel announced";
  EXPECT_FALSE(f.get().empty());
  EXPECT_EQ(m.GetCounter("shoal_gateway_cancels_total", "")->Value(), 0);
  EXPECT_EQ(m.GetCounter("shoal_gateway_deadline_exceeded_total", "")->Value(), 1);
  (*d)->Stop();
}

// A request whose one chunk was answered with an error has no work left:
// no cancel is announced for it (under overload, needless ones would crowd
// real ones out of the workers' memory of cancels).
TEST_F(WorkerTest, ARequestWithNoWorkLeftAnnouncesNoCancel) {
  std::atomic<int> cancels{0};
  auto sub = client_->Subscribe(
      wire::kCancelSubject,
      [](natsConnection*, natsSubscription*, natsMsg* m, void* c) {
        natsMsg_Destroy(m);
        ++*static_cast<std::atomic<int>*>(c);
      },
      &cancels);
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(client_->Flush(2000).ok());
  MetricsRegistry m;
  auto d = Dispatcher::Create(DispatcherOptions{}, client_.get(), &m);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ItemJob job;
  job.task = "ocr";  // tiny-bert embeds text: the worker answers with an error
  job.model = "tiny-bert";
  job.items = {"not an image"};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 10000;
  std::promise<Result<ItemResult>> done;
  (*d)->SubmitItems(std::move(job), [&done](Result<ItemResult> r) { done.set_value(std::move(r)); });
  auto r = done.get_future().get();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  ASSERT_TRUE(client_->Flush(2000).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(cancels.load(), 0);
  (*d)->Stop();
}

// The gateway's deadline timer runs on the steady clock: a request whose
// time is up is answered 504 even when the wall clock has just been set an
// hour back (it used to wait for the wall clock to catch up).
TEST_F(WorkerTest, ADeadlineHoldsWhenTheWallClockStepsBack) {
  worker_->Stop();  // no one answers
  FakeClock clock;
  MetricsRegistry m;
  auto d = Dispatcher::Create(DispatcherOptions{}, client_.get(), &m, &clock);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto done = std::make_shared<std::promise<Result<EmbedResult>>>();
  auto answered = done->get_future();
  EmbedJob job;
  job.model = "tiny-bert";
  job.texts = {"anyone?"};
  job.deadline_unix_ms = clock.NowUnixMs() + 1000;
  (*d)->SubmitEmbed(std::move(job), [done](Result<EmbedResult> r) { done->set_value(std::move(r)); });
  clock.StepWallMs(-3'600'000);
  clock.AdvanceUs(1'100'000);
  ASSERT_EQ(answered.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the request waits for the wall clock, an hour behind";
  EXPECT_EQ(answered.get().status().code(), StatusCode::kDeadlineExceeded);
  (*d)->Stop();
}

// Once stopped, a gateway's dispatcher takes no more replies: its owner
// goes on to free what the reply handlers use (the blob offload a reply by
// reference is fetched through, the router its callbacks write to).
TEST_F(WorkerTest, AStoppedDispatcherTakesNoMoreReplies) {
  DispatcherOptions dopt;
  dopt.gateway_id = "stopping-gw";
  MetricsRegistry m;
  auto d = Dispatcher::Create(dopt, client_.get(), &m);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  Counter* dropped = m.GetCounter("shoal_gateway_duplicate_replies_total", "");
  wire::WorkReply stray;
  stray.request_id = "stopping-gw-nobody-0";
  const std::string subject = (*d)->reply_subject();
  ASSERT_TRUE(client_->Publish(subject, wire::EncodeWorkReply(stray)).ok());
  ASSERT_TRUE(client_->Flush(2000).ok());
  for (int i = 0; i < 200 && dropped->Value() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(dropped->Value(), 1) << "a live dispatcher drops a reply for no request of its own";
  (*d)->Stop();
  ASSERT_TRUE(client_->Publish(subject, wire::EncodeWorkReply(stray)).ok());
  ASSERT_TRUE(client_->Flush(2000).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(dropped->Value(), 1) << "the stopped dispatcher still handled a reply";
}

// A reply the gateway cannot use ends its request at once, not at its
// deadline: rows that are not the chunk's inputs' (a worker of another
// version) get 502 bad_worker_reply, a reply by reference at a gateway
// without a blob store 502 blob_store_missing. Here the test answers the
// work itself.
TEST_F(WorkerTest, RepliesTheGatewayCannotUseEndTheirRequestAtOnce) {
  worker_->Stop();
  auto consumer = PullConsumer::Create(*client_, "SHOAL_WORK", wire::WorkSubject("tiny-bert"),
                                       wire::ConsumerName("tiny-bert"), ConsumerOptions{});
  ASSERT_TRUE(consumer.ok()) << consumer.status().ToString();
  const auto answer = [&](wire::WorkReply reply, const char* ref) {
    auto got = (*consumer)->Fetch(1, 10000);
    ASSERT_TRUE(got.ok() && got->size() == 1u);
    Delivery& work = (*got)[0];
    reply.request_id = std::string(work.Header(wire::kHdrRequestId));
    const std::string data = wire::EncodeWorkReply(reply);
    natsMsg* msg = nullptr;
    ASSERT_EQ(natsMsg_Create(&msg, std::string(work.Header(wire::kHdrReplyTo)).c_str(), nullptr, data.data(),
                             static_cast<int>(data.size())),
              NATS_OK);
    if (ref != nullptr) {
      natsMsgHeader_Set(msg, wire::kHdrPayloadRef, ref);
      natsMsgHeader_Set(msg, wire::kHdrRequestId, reply.request_id.c_str());
    }
    ASSERT_TRUE(client_->PublishMsg(msg).ok());
    natsMsg_Destroy(msg);
    ASSERT_TRUE(work.Ack().ok());
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto two = std::async(std::launch::async, [&] { return Embed({"one", "two"}, false, 20000); });
  wire::WorkReply three;
  three.rows = 3;
  three.dim = 2;
  three.embeddings.assign(6, 0.5f);
  three.token_counts = {3, 3, 3};
  answer(three, nullptr);
  auto r = two.get();
  EXPECT_EQ(r.status().code(), StatusCode::kBadGateway) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "bad_worker_reply");
  EXPECT_NE(r.status().message().find("3 rows of width 2 for a chunk of 2 inputs"), std::string::npos)
      << r.status().message();

  auto by_ref = std::async(std::launch::async, [&] { return Embed({"three"}, false, 20000); });
  answer(wire::WorkReply{}, "file:///nowhere/0123");
  r = by_ref.get();
  EXPECT_EQ(r.status().code(), StatusCode::kBadGateway) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "blob_store_missing");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15)) << "an answer waited for its deadline";
}

// A GPU the build cannot use fails the worker's start with the reason, not
// each model's load later; a malformed device name is refused as such, and
// so is a host memory budget on a CPU worker.
TEST_F(WorkerTest, ADeviceThisBuildCannotUseFailsTheStart) {
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.models = {"tiny-bert"};
  wo.worker_id = "gpu-less";
  wo.device = "cuda:255";  // no libtorch sees 256 GPUs
  auto w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kUnavailable) << w.status().ToString();
  EXPECT_EQ(w.status().reason(), "device_unavailable");
  EXPECT_NE(w.status().message().find("cuda:255"), std::string::npos) << w.status().message();
  wo.device = "gpu";
  w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
  EXPECT_EQ(w.status().reason(), "invalid_device");
  // A host memory budget is a GPU worker's: on the CPU every model shares
  // the one budget, and asking for two is refused rather than ignored.
  wo.device = "cpu";
  wo.host_memory_budget_bytes = 1 << 30;
  w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
  EXPECT_NE(w.status().message().find("host memory budget"), std::string::npos) << w.status().message();
  // None of them registered itself.
  auto workers = KvBucket::Open(*client_, wire::kWorkersBucket, 6000);
  ASSERT_TRUE(workers.ok());
  EXPECT_EQ((*workers)->Get("gpu-less").status().code(), StatusCode::kNotFound);
}

// NATS not answering while a model loads (a restart, a JetStream leader
// election) delays the load rather than failing it: a failed model would
// stay failed for retry_failed_after_ms although nothing is wrong with it.
TEST_F(WorkerTest, ALoadOutlastsNatsNotAnsweringForAWhile) {
  NatsOptions no;
  no.url = server_.url();
  no.js_api_timeout_ms = 500;  // each JetStream call gives up quickly
  auto c = NatsClient::Connect(no);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.models = {"tiny-classifier"};
  wo.worker_id = "patient";
  wo.preload = {};
  MetricsRegistry metrics;
  auto w = Worker::Create(wo, c->get(), &metrics);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const pid_t nats = server_.process().pid();
  ASSERT_EQ(::kill(nats, SIGSTOP), 0);
  struct Resume {
    pid_t pid;
    ~Resume() { ::kill(pid, SIGCONT); }
  } resume{nats};
  auto load = std::async(std::launch::async, [&] { return (*w)->Control("load", "tiny-classifier"); });
  // Long enough for the consumer's creation to time out more than once.
  ASSERT_EQ(load.wait_for(std::chrono::milliseconds(2500)), std::future_status::timeout);
  ASSERT_EQ(::kill(nats, SIGCONT), 0);
  auto r = load.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*w)->LoadedModels(), std::vector<std::string>{"tiny-classifier"});
  (*w)->Stop();
}

// --runtime replaces the runtime of text models only: the demo repository,
// OCR models included, runs under --runtime sim (which needs a dim that OCR
// models do not have), and the OCR models keep Tesseract.
TEST(WorkerSelectModels, FlagsApplyToTextModelsAndAreNamedWhenTheyBreakOne) {
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.runtime_override = "sim";
  auto models = Worker::SelectModels(wo);
  ASSERT_TRUE(models.ok()) << models.status().ToString();
  bool saw_ocr = false;
  for (const ModelConfig& c : *models) {
    SCOPED_TRACE(c.name);
    if (c.ItemTask()) {
      EXPECT_NE(c.runtime, "sim");
      saw_ocr |= c.task == "ocr";
    } else {
      EXPECT_EQ(c.runtime, "sim");
    }
  }
  EXPECT_TRUE(saw_ocr) << "the demo repository has OCR models";
  // A flag that makes a model's config invalid says it was the flag.
  wo.runtime_override.clear();
  wo.models = {"tiny-bert"};
  wo.max_batch_tokens = 100;
  auto bad = Worker::SelectModels(wo);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("with this worker's flags: --max-batch-tokens 100"), std::string::npos)
      << bad.status().message();
}

// The registry bucket keeps the TTL of the worker that made it (6 s here):
// a worker that heartbeats less often would vanish between heartbeats, so
// it does not start.
TEST_F(WorkerTest, AHeartbeatSlowerThanTheRegistryTtlFailsTheStart) {
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.models = {"tiny-bert"};
  wo.worker_id = "slow-heart";
  wo.heartbeat_interval_ms = 7000;
  wo.heartbeat_ttl_ms = 20000;
  auto w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().reason(), "kv_bucket_mismatch") << w.status().ToString();
  EXPECT_NE(w.status().message().find("6000 ms"), std::string::npos) << w.status().message();
}

// A typo in --preload fails the start, as one in --models or --pin does.
TEST_F(WorkerTest, AnUnknownModelToPreloadFailsTheStart) {
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.models = {"tiny-bert"};
  wo.worker_id = "typo";
  wo.preload = {"tiny-bret"};
  auto w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound) << w.status().ToString();
  EXPECT_NE(w.status().message().find("tiny-bret"), std::string::npos) << w.status().message();
}

// A worker id held by another live process is refused at start (two
// processes would share one registry entry and one control subject); one
// left by a process of this host that is gone is taken over.
TEST_F(WorkerTest, AWorkerIdInUseElsewhereIsRefused) {
  auto kv = KvBucket::Open(*client_, wire::kWorkersBucket, 6000);
  ASSERT_TRUE(kv.ok());
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.models = {"tiny-bert"};
  wo.preload = {};
  wo.worker_id = "twin";
  const int64_t now = SystemClock::Get()->NowUnixMs();
  ASSERT_TRUE((*kv)->Put("twin", R"({"id":"twin","host":"another-host","pid":4242,"heartbeat_unix_ms":)" +
                                     std::to_string(now) + "}")
                  .ok());
  auto w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().reason(), "worker_id_in_use") << w.status().ToString();
  EXPECT_NE(w.status().message().find("another-host"), std::string::npos) << w.status().message();
  // The refused start leaves the live worker's entry alone.
  auto entry = (*kv)->Get("twin");
  ASSERT_TRUE(entry.ok()) << "the refused start deleted the live worker's entry: " << entry.status().ToString();
  EXPECT_NE(entry->find("another-host"), std::string::npos) << *entry;
  // This host, a process that has exited: free.
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  ASSERT_TRUE((*kv)->Put("twin", R"({"id":"twin","host":")" + std::string(host) + R"(","pid":)" + std::to_string(child) +
                                     R"(,"heartbeat_unix_ms":)" + std::to_string(now) + "}")
                  .ok());
  w = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  (*w)->Stop();
}

// Two workers of one process with one id: the second is refused (the
// entry's pid is this process's, which for another process would mean a
// restarted container whose old worker is gone).
TEST_F(WorkerTest, ASecondWorkerOfThisProcessWithTheSameIdIsRefused) {
  WorkerOptions wo;
  wo.model_repository = ModelsDir();
  wo.models = {"tiny-bert"};
  wo.preload = {};
  wo.worker_id = "same-id";
  auto first = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().reason(), "worker_id_in_use") << second.status().ToString();
  (*first)->Stop();
  first->reset();
  // Free again once the first has stopped.
  auto third = Worker::Create(wo, client_.get(), &metrics_);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  (*third)->Stop();
}

// A worker whose first registry entry expired during a long start (model
// loads), and whose id another process took meanwhile, gives the id up at
// the end of its start instead of overwriting the other's entry.
TEST_F(WorkerTest, AnIdTakenWhileTheWorkerStartedIsGivenUp) {
  shoal::testing::TempDir repo;
  shoal::testing::MakeFleetRepository(repo.path(), {"slow-load"});
  {
    const std::string path = repo.path() + "/slow-load/shoal.json";
    std::ifstream in(path);
    nlohmann::json config = nlohmann::json::parse(in);
    config["sim"] = {{"load_ms", 2000}};
    std::ofstream(path) << config.dump(2);
  }
  WorkerOptions wo;
  wo.model_repository = repo.path();
  wo.models = {"slow-load"};
  wo.runtime_override = "sim";
  wo.pinned = {"slow-load"};  // loaded during the start
  wo.worker_id = "taken-meanwhile";
  auto starting = std::async(std::launch::async, [&] { return Worker::Create(wo, client_.get(), &metrics_); });
  auto kv = KvBucket::Open(*client_, wire::kWorkersBucket, 6000);
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(shoal::testing::Eventually([&] { return (*kv)->Get("taken-meanwhile").ok(); }));
  // Another process's entry, as if the first had expired and it had started.
  const std::string other = R"({"id":"taken-meanwhile","host":"another-host","pid":4242,"heartbeat_unix_ms":)" +
                            std::to_string(SystemClock::Get()->NowUnixMs()) + "}";
  ASSERT_TRUE((*kv)->Put("taken-meanwhile", other).ok());
  auto w = starting.get();
  ASSERT_FALSE(w.ok()) << "the worker started over another process's entry";
  EXPECT_EQ(w.status().reason(), "worker_id_in_use") << w.status().ToString();
  EXPECT_NE(w.status().message().find("while this worker was starting"), std::string::npos) << w.status().message();
  auto entry = (*kv)->Get("taken-meanwhile");
  ASSERT_TRUE(entry.ok()) << "the refused start deleted the other's entry";
  EXPECT_EQ(*entry, other);
}

// The server's max_payload (1 MiB here) counts a message's headers too.
// Without a blob store, a work message whose body would not fit is 413
// message_too_large at once, also one just under 1 MiB that only the
// headers push over (it used to get a retryable 503 every time); a result
// too large to send back is 413 result_too_large, not a bare 500.
TEST_F(WorkerTest, MessagesOverTheServersMaxPayloadAre413) {
  ASSERT_EQ(natsConnection_GetMaxPayload(client_->conn()), int64_t{1} << 20);
  // One input whose encoded message is 100 bytes under 1 MiB.
  wire::WorkBody probe;
  probe.task = "embed";
  probe.model = "tiny-bert";
  probe.texts = {std::string(100000, 'x')};  // a str32, as the real one
  const size_t overhead = wire::EncodeWorkBody(probe).size() - 100000;
  std::string text((size_t{1} << 20) - 100 - overhead, 'x');
  probe.texts = {text};
  ASSERT_EQ(wire::EncodeWorkBody(probe).size(), (size_t{1} << 20) - 100);
  for (auto texts : {std::vector<std::string>{text}, std::vector<std::string>{text, "a", "b"}}) {
    auto r = Embed(texts, false, 20000);
    EXPECT_EQ(r.status().code(), StatusCode::kPayloadTooLarge) << r.status().ToString();
    EXPECT_EQ(r.status().reason(), "message_too_large");
    EXPECT_NE(r.status().message().find("--blob-store"), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(runs_.load(), 0) << "nothing reached the worker";

  // 4096 one-token inputs in one message: 4096 rows of 64 floats is 1 MiB
  // of reply before its other fields.
  DispatcherOptions wide;
  wide.chunk_size = 4096;
  auto d = Dispatcher::Create(wide, client_.get(), &metrics_);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EmbedJob job;
  job.model = "tiny-bert";
  job.texts.assign(4096, "a");
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 60000;
  std::promise<Result<EmbedResult>> p;
  (*d)->SubmitEmbed(std::move(job), [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
  auto r = p.get_future().get();
  EXPECT_EQ(r.status().code(), StatusCode::kPayloadTooLarge) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "result_too_large");
  (*d)->Stop();
  // The worker goes on serving.
  EXPECT_TRUE(Embed({"still here"}).ok());
}

// Publishes a tiny-bert work message by hand, with this Shoal-Chunk header
// and body, and returns the worker's reply.
Result<wire::WorkReply> SendByHand(NatsClient& client, const std::string& chunk, const std::string& body) {
  const std::string inbox = client.NewInbox();
  natsSubscription* sub = nullptr;
  if (natsConnection_SubscribeSync(&sub, client.conn(), inbox.c_str()) != NATS_OK) return Internal("subscribe");
  std::unique_ptr<natsSubscription, void (*)(natsSubscription*)> owned_sub(sub, natsSubscription_Destroy);
  natsMsg* raw = nullptr;
  if (natsMsg_Create(&raw, wire::WorkSubject("tiny-bert").c_str(), nullptr, body.data(),
                     static_cast<int>(body.size())) != NATS_OK)
    return Internal("message");
  NatsMsgPtr msg(raw);
  const std::string deadline = std::to_string(SystemClock::Get()->NowUnixMs() + 30000);
  natsMsgHeader_Set(raw, wire::kHdrRequestId, "by-hand");
  natsMsgHeader_Set(raw, wire::kHdrChunk, chunk.c_str());
  natsMsgHeader_Set(raw, wire::kHdrDeadline, deadline.c_str());
  natsMsgHeader_Set(raw, wire::kHdrReplyTo, inbox.c_str());
  RETURN_IF_ERROR(client.PublishMsg(raw));
  natsMsg* got = nullptr;
  if (natsSubscription_NextMsg(&got, sub, 20000) != NATS_OK) return DeadlineExceeded("no reply");
  NatsMsgPtr reply(got);
  return wire::DecodeWorkReply(std::string_view(natsMsg_GetData(got), static_cast<size_t>(natsMsg_GetDataLength(got))));
}

// A malformed work message that says where to reply is answered with why,
// not dropped for its caller to wait out its deadline: a Shoal-Chunk header
// that is not index/count, and more inputs than a message may carry (put
// straight on the queue, past the gateway's limits).
TEST_F(WorkerTest, MalformedWorkMessagesAreAnsweredNotDropped) {
  wire::WorkBody body;
  body.task = "embed";
  body.model = "tiny-bert";
  body.texts = {"hello"};
  for (const char* chunk : {"2/2", "x", "0/0", "-1/3"}) {
    auto r = SendByHand(*client_, chunk, wire::EncodeWorkBody(body));
    ASSERT_TRUE(r.ok()) << chunk << ": " << r.status().ToString();
    EXPECT_EQ(r->status.code(), StatusCode::kInvalidArgument) << chunk;
    EXPECT_EQ(r->status.reason(), "invalid_work_message") << chunk;
  }
  auto ok = SendByHand(*client_, "0/1", wire::EncodeWorkBody(body));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(ok->status.ok()) << ok->status.ToString();
  EXPECT_EQ(ok->rows, 1);
  body.texts.assign(wire::kMaxInputsPerMessage + 1, "");
  auto many = SendByHand(*client_, "0/1", wire::EncodeWorkBody(body));
  ASSERT_TRUE(many.ok()) << many.status().ToString();
  EXPECT_EQ(many->status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(many->status.reason(), "too_many_inputs");
  EXPECT_EQ(runs_.load(), 1) << "only the good message ran";
}

// A reply subject that nats.c would write into the protocol line as it is
// (blanks, a wildcard, more than the server's 4 KiB control line): the
// message is termed unrun and nothing is published to it. Published, "a b c"
// or 5,000 bytes made nats-server close the connection, and with it every
// reply, ack and pull this worker had in flight; "a b" went to subject "a".
TEST_F(WorkerTest, WorkWithAnUnusableReplySubjectIsTermedWithoutAReply) {
  wire::WorkBody body;
  body.task = "embed";
  body.model = "tiny-bert";
  body.texts = {"hello"};
  const std::string encoded = wire::EncodeWorkBody(body);
  const auto reconnects = [&] {
    natsStatistics* stats = nullptr;
    uint64_t n = 0;
    if (natsStatistics_Create(&stats) != NATS_OK) return ~uint64_t{0};
    if (natsConnection_GetStats(client_->conn(), stats) != NATS_OK ||
        natsStatistics_GetCounts(stats, nullptr, nullptr, nullptr, nullptr, &n) != NATS_OK)
      n = ~uint64_t{0};
    natsStatistics_Destroy(stats);
    return n;
  };
  const uint64_t reconnects_before = reconnects();
  for (const std::string& reply : {std::string("a b c"), std::string("a b"), std::string("inbox.>"),
                                   std::string("inbox..x"), "inbox." + std::string(5000, 'x')}) {
    natsMsg* raw = nullptr;
    ASSERT_EQ(natsMsg_Create(&raw, wire::WorkSubject("tiny-bert").c_str(), nullptr, encoded.data(),
                             static_cast<int>(encoded.size())),
              NATS_OK);
    NatsMsgPtr msg(raw);
    const std::string deadline = std::to_string(SystemClock::Get()->NowUnixMs() + 30000);
    natsMsgHeader_Set(raw, wire::kHdrRequestId, "bad-reply");
    natsMsgHeader_Set(raw, wire::kHdrDeadline, deadline.c_str());
    natsMsgHeader_Set(raw, wire::kHdrReplyTo, reply.c_str());
    ASSERT_TRUE(client_->PublishMsg(raw).ok());
  }
  // Settled at once (AckWait is 1 s, a lost Term would leave them for it).
  EXPECT_TRUE(shoal::testing::Eventually([&] {
    auto st = GetStreamState(*client_, "SHOAL_WORK");
    return st.ok() && st->msgs == 0;
  }));
  auto ok = SendByHand(*client_, "0/1", encoded);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(ok->status.ok()) << ok->status.ToString();
  EXPECT_EQ(runs_.load(), 1) << "only the good message ran";
  EXPECT_EQ(reconnects(), reconnects_before) << "the connection was broken";
}

// Takes the next `n` work messages from `consumer` and answers each with
// the replies `make(chunk)` returns, in order (request id and chunk filled
// in), then acks it: a worker made by hand.
void AnswerByHand(NatsClient& client, PullConsumer& consumer, int n,
                  const std::function<std::vector<wire::WorkReply>(int)>& make) {
  for (int answered = 0; answered < n;) {
    auto got = consumer.Fetch(n - answered, 5000);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_FALSE(got->empty()) << "no work message";
    for (Delivery& d : *got) {
      wire::WorkHeaders h;
      ASSERT_TRUE(ParseWorkHeaders(d, &h).ok());
      for (wire::WorkReply& r : make(h.chunk_index)) {
        r.request_id = h.request_id;
        r.chunk_index = h.chunk_index;
        ASSERT_TRUE(client.Publish(h.reply_to, wire::EncodeWorkReply(r)).ok());
      }
      ASSERT_TRUE(d.Ack().ok());
      ++answered;
    }
  }
}

std::unique_ptr<PullConsumer> ByHandConsumer(NatsClient& client) {
  auto consumer = PullConsumer::Create(client, "SHOAL_WORK", wire::WorkSubject("by-hand"),
                                       wire::ConsumerName("by-hand"), ConsumerOptions{});
  EXPECT_TRUE(consumer.ok()) << consumer.status().ToString();
  return consumer.ok() ? std::move(consumer).value() : nullptr;
}

// Replies the gateway cannot use fail their request at once with 502
// bad_worker_reply, not at its deadline (the worker has settled the work,
// so nothing else will come): embeddings that are not rows x dim, and an
// item job whose first input got two results and its second none (counted
// together they were the two results it needed). The replies are made by
// hand for a model no worker here serves.
TEST_F(WorkerTest, UnusableRepliesFailTheirRequestAtOnce) {
  auto consumer = ByHandConsumer(*client_);
  ASSERT_NE(consumer, nullptr);
  const int64_t deadline = SystemClock::Get()->NowUnixMs() + 60000;
  EmbedJob job;
  job.model = "by-hand";
  job.texts = {"one"};
  job.deadline_unix_ms = deadline;
  std::promise<Result<EmbedResult>> embedded;
  dispatcher_->SubmitEmbed(std::move(job), [&](Result<EmbedResult> r) { embedded.set_value(std::move(r)); });
  AnswerByHand(*client_, *consumer, 1, [](int) {
    wire::WorkReply r;
    r.rows = 1;
    r.dim = 2;
    r.embeddings = {1, 2, 3};
    return std::vector<wire::WorkReply>{r};
  });
  auto e = embedded.get_future();
  ASSERT_EQ(e.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "left for its deadline";
  auto er = e.get();
  EXPECT_EQ(er.status().code(), StatusCode::kBadGateway) << er.status().ToString();
  EXPECT_EQ(er.status().reason(), "bad_worker_reply");

  ItemJob items;
  items.task = "ocr";
  items.model = "by-hand";
  items.items = {"first", "second"};
  items.deadline_unix_ms = deadline;
  std::promise<Result<ItemResult>> itemised;
  dispatcher_->SubmitItems(std::move(items), [&](Result<ItemResult> r) { itemised.set_value(std::move(r)); });
  AnswerByHand(*client_, *consumer, 2, [](int chunk) {
    wire::WorkReply r;
    if (chunk == 0) r.items = {"a", "b"};
    return std::vector<wire::WorkReply>{r};
  });
  auto i = itemised.get_future();
  ASSERT_EQ(i.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto ir = i.get();
  EXPECT_EQ(ir.status().code(), StatusCode::kBadGateway) << (ir.ok() ? "answered" : ir.status().ToString());
  EXPECT_EQ(ir.status().reason(), "bad_worker_reply");

  // A reply whose chunk cannot be read either: {"id": ..., "chunk": "zero"}.
  EmbedJob unplaced;
  unplaced.model = "by-hand";
  unplaced.texts = {"two"};
  unplaced.deadline_unix_ms = deadline;
  std::promise<Result<EmbedResult>> answered;
  dispatcher_->SubmitEmbed(std::move(unplaced), [&](Result<EmbedResult> r) { answered.set_value(std::move(r)); });
  auto got = consumer->Fetch(1, 5000);
  ASSERT_TRUE(got.ok() && got->size() == 1u);
  wire::WorkHeaders h;
  ASSERT_TRUE(ParseWorkHeaders((*got)[0], &h).ok());
  std::string raw = "\x82\xa2id";
  raw += static_cast<char>(0xa0 + h.request_id.size());  // fixstr (ids are short)
  raw += h.request_id;
  raw += "\xa5" "chunk\xa4zero";
  ASSERT_LT(h.request_id.size(), 32u);
  ASSERT_TRUE(client_->Publish(h.reply_to, raw).ok());
  ASSERT_TRUE((*got)[0].Ack().ok());
  auto u = answered.get_future();
  ASSERT_EQ(u.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "left for its deadline";
  EXPECT_EQ(u.get().status().reason(), "bad_worker_reply");
}

// Streamed output whose chunk starts again from its first partial (its
// worker was lost and the work redelivered to another) is not spliced onto
// what the caller has: the request fails 502 stream_interrupted after the
// two events passed on. A partial that skips a number does the same.
TEST_F(WorkerTest, StreamedOutputThatStartsAgainFailsInsteadOfRepeating) {
  auto consumer = ByHandConsumer(*client_);
  ASSERT_NE(consumer, nullptr);
  const auto partial = [](int seq, const std::string& text) {
    wire::WorkReply r;
    r.partial = true;
    r.seq = seq;
    r.items = {text};
    return r;
  };
  for (const std::vector<int>& seqs : {std::vector<int>{0, 1, 0}, std::vector<int>{0, 1, 3}}) {
    ItemJob job;
    job.task = "generate";
    job.model = "by-hand";
    job.items = {"prompt"};
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 60000;
    std::mutex mu;
    std::vector<std::string> passed_on;
    std::promise<Result<ItemResult>> done;
    dispatcher_->SubmitItems(
        std::move(job), [&](Result<ItemResult> r) { done.set_value(std::move(r)); },
        [&](size_t, std::string_view text) {
          std::lock_guard<std::mutex> lock(mu);
          passed_on.emplace_back(text);
          return true;
        });
    AnswerByHand(*client_, *consumer, 1, [&](int) {
      std::vector<wire::WorkReply> replies;
      for (size_t k = 0; k < seqs.size(); ++k) replies.push_back(partial(seqs[k], "event " + std::to_string(k)));
      replies.emplace_back();  // the final reply
      replies.back().items = {"end"};
      return replies;
    });
    auto f = done.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    auto r = f.get();
    EXPECT_EQ(r.status().code(), StatusCode::kBadGateway) << (r.ok() ? "answered" : r.status().ToString());
    EXPECT_EQ(r.status().reason(), "stream_interrupted");
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(passed_on, (std::vector<std::string>{"event 0", "event 1"}));
  }
}

TEST_F(WorkerTest, NoWorkerMeansDeadlineExceeded) {
  worker_->Stop();
  auto r = Embed({"anyone?"}, false, 300);
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace shoal
