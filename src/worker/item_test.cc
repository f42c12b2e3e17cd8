// Integration tests of the worker's item path (runtimes that take whole
// inputs: OCR images, requests for a remote backend): a real nats-server
// -js, the real Worker and the gateway's Dispatcher, over a scripted item
// runtime so that every path (results, float rows, streamed partials, one
// caller's bad input, a failed runtime) can be driven.
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <msgpack.hpp>

#include "gateway/dispatcher.h"
#include "runtime/runtime.h"
#include "support/test_env.h"
#include "worker/worker.h"

namespace shoal {
namespace {

using shoal::testing::TempDir;
using shoal::testing::TestNatsServer;

// How many "busy" inputs the runtime has been given, and the most in one
// call (whether the worker batched them).
std::atomic<int> busy_inputs{0};
std::atomic<int> most_busy_in_one_call{0};

// How often each input was given to the runtime, and the most inputs in
// one call (whether the worker batched them).
std::mutex runs_mu;
std::map<std::string, int> runs;  // guarded by runs_mu
std::atomic<int> most_in_one_call{0};

void NoteMost(std::atomic<int>& most, int n) {
  int seen = most.load();
  while (n > seen && !most.compare_exchange_weak(seen, n)) {
  }
}

std::string PackStr(std::string_view s) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, std::string(s));
  return std::string(buf.data(), buf.size());
}

std::string Unpacked(std::string_view doc) {
  auto h = msgpack::unpack(doc.data(), doc.size());
  return h.get().as<std::string>();
}

// Each input is text: "bad..." fails the batch with a client error,
// "busy" fails it as an overloaded backend does (429), "late-bad" fails it
// (400) after the others were handed over (RunItemsAsReady),
// "stream:N" emits N partials first, "slow:N" takes N ms, "alone:..."
// fails on its own, "row:a,b" (token task) returns floats, anything else
// comes back upper-cased.
class ScriptedItemRuntime final : public Runtime {
 public:
  Status Load(const ModelConfig& config) override {
    config_ = config;
    return Status::Ok();
  }
  bool TakesItems() const override { return true; }
  Result<std::vector<std::string>> RunItems(const std::vector<std::string>& items,
                                            const PartialSink& partial) override {
    NoteMost(most_in_one_call, static_cast<int>(items.size()));
    const int busy = static_cast<int>(std::count(items.begin(), items.end(), "busy"));
    if (busy > 0) {
      busy_inputs += busy;
      NoteMost(most_busy_in_one_call, busy);
      return ResourceExhausted("the backend is overloaded", "upstream_busy");
    }
    {
      std::lock_guard<std::mutex> lock(runs_mu);
      for (const auto& in : items) ++runs[in];
    }
    if (std::count(items.begin(), items.end(), "late-bad") > 0)
      return InvalidArgument("this batch failed after its other inputs were done", "late_failure");
    std::vector<std::string> out;
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string& in = items[i];
      if (in.rfind("bad", 0) == 0) return InvalidArgument("input '" + in + "' is not an image", "invalid_image");
      if (in.rfind("stream:", 0) == 0) {
        const int n = std::stoi(in.substr(7));
        for (int k = 0; k < n; ++k) partial(i, PackStr("part" + std::to_string(k)));
        out.push_back(PackStr("done"));
      } else if (in.rfind("slow:", 0) == 0) {  // takes N ms
        std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(in.substr(5))));
        out.push_back(PackStr("slow"));
      } else if (in.rfind("alone:", 0) == 0) {
        out.push_back(ItemError(InvalidArgument("input '" + in + "' is too long", "context_length_exceeded")));
      } else if (in.rfind("row:", 0) == 0) {
        msgpack::sbuffer buf;
        msgpack::pack(buf, std::vector<double>{std::stod(in.substr(4)), 2.0});
        out.emplace_back(buf.data(), buf.size());
      } else {
        std::string up = in;
        for (char& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        out.push_back(PackStr(up));
      }
    }
    return out;
  }
  // "deadline" comes back as the deadline the runtime was given for it.
  Result<std::vector<std::string>> RunItemsBefore(const std::vector<std::string>& items,
                                                  const std::vector<int64_t>& deadlines_unix_ms,
                                                  const PartialSink& partial) override {
    auto out = RunItems(items, partial);
    if (!out.ok()) return out;
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i] == "deadline")
        (*out)[i] = PackStr(i < deadlines_unix_ms.size() ? std::to_string(deadlines_unix_ms[i]) : "none");
    return out;
  }
  // Hands over each input's result at once, except "slow:N" ones (after
  // their sleep) and "late-bad", which fails the whole call after the
  // others were handed over.
  Result<std::vector<std::string>> RunItemsAsReady(const std::vector<std::string>& items,
                                                   const std::vector<int64_t>& deadlines_unix_ms,
                                                   const ItemCalls& calls) override {
    const PartialSink& partial = calls.partial;
    const ResultSink& done = calls.done;
    NoteMost(most_in_one_call, static_cast<int>(items.size()));
    if (std::count(items.begin(), items.end(), "busy") > 0) return RunItemsBefore(items, deadlines_unix_ms, partial);
    const auto alone = [&](size_t i) {
      return RunItemsBefore({items[i]}, {i < deadlines_unix_ms.size() ? deadlines_unix_ms[i] : 0},
                            [&](size_t, std::string_view c) { partial(i, c); });
    };
    std::vector<std::string> out(items.size());
    std::vector<size_t> later;
    bool fail_late = false;
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].rfind("slow:", 0) == 0) {
        later.push_back(i);
        continue;
      }
      if (items[i] == "late-bad") {
        fail_late = true;
        continue;
      }
      auto one = alone(i);
      if (!one.ok()) return one.status();
      out[i] = std::move((*one)[0]);
      done(i, out[i]);
    }
    if (fail_late) return RunItems({"late-bad"}, {}).status();
    for (size_t i : later) {
      auto one = alone(i);
      if (!one.ok()) return one.status();
      out[i] = std::move((*one)[0]);
      done(i, out[i]);
    }
    return out;
  }
  Result<Embeddings> Run(const TokenBatch&) override { return Internal("token batches are not expected"); }
  void Unload() override {}
  int64_t MemoryBytes() const override { return 1 << 20; }
  int Dim() const override { return config_.dim; }

 private:
  ModelConfig config_;
};

class ItemPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Item models need no artifacts and no vocab.
    WriteModel("scripted-ocr", R"({"name":"scripted-ocr","task":"ocr","runtime":"null"})");
    WriteModel("remote-embed", R"({"name":"remote-embed","task":"embed","runtime":"null","dim":2})");
    NatsOptions no;
    no.url = server_.url();
    auto c = NatsClient::Connect(no);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    WorkerOptions wo;
    wo.model_repository = repo_.path();
    wo.models = {"scripted-ocr", "remote-embed"};
    wo.device_slots = 1;  // a pass's time counts once in the measured cost
    wo.runtime_factory = [](const ModelConfig&) -> Result<std::unique_ptr<Runtime>> {
      return std::unique_ptr<Runtime>(std::make_unique<ScriptedItemRuntime>());
    };
    auto w = Worker::Create(wo, client_.get(), &metrics_);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    worker_ = std::move(w).value();
    auto d = Dispatcher::Create(DispatcherOptions{}, client_.get(), &metrics_);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dispatcher_ = std::move(d).value();
  }

  void WriteModel(const std::string& name, const std::string& json) {
    std::filesystem::create_directories(repo_.path() + "/" + name);
    std::ofstream(repo_.path() + "/" + name + "/shoal.json") << json;
  }

  Result<ItemResult> Submit(std::vector<std::string> items, PartialCallback partial = {},
                            int64_t deadline_unix_ms = 0) {
    ItemJob job;
    job.task = "ocr";
    job.model = "scripted-ocr";
    job.items = std::move(items);
    job.deadline_unix_ms = deadline_unix_ms > 0 ? deadline_unix_ms : SystemClock::Get()->NowUnixMs() + 20000;
    std::promise<Result<ItemResult>> p;
    auto f = p.get_future();
    dispatcher_->SubmitItems(std::move(job), [&p](Result<ItemResult> r) { p.set_value(std::move(r)); },
                             std::move(partial));
    return f.get();
  }

  TestNatsServer server_;
  TempDir repo_;
  MetricsRegistry metrics_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<Dispatcher> dispatcher_;
};

TEST_F(ItemPathTest, ResultsComeBackInInputOrder) {
  auto r = Submit({"first", std::string("bin\0ary", 7), "third"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->items.size(), 3u);
  EXPECT_EQ(Unpacked(r->items[0]), "FIRST");
  EXPECT_EQ(Unpacked(r->items[1]), std::string("BIN\0ARY", 7));
  EXPECT_EQ(Unpacked(r->items[2]), "THIRD");
}

// The runtime learns each input's deadline, so one that can stop part-way
// (OCR) does not finish work nobody waits for.
TEST_F(ItemPathTest, TheRuntimeIsGivenEachInputsDeadline) {
  const int64_t deadline = SystemClock::Get()->NowUnixMs() + 25000;
  auto r = Submit({"first", "deadline"}, {}, deadline);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->items.size(), 2u);
  EXPECT_EQ(Unpacked(r->items[0]), "FIRST");
  EXPECT_EQ(Unpacked(r->items[1]), std::to_string(deadline));
}

TEST_F(ItemPathTest, PartialOutputStreamsInOrderBeforeTheResult) {
  std::mutex mu;
  std::vector<std::pair<size_t, std::string>> parts;
  auto r = Submit({"plain", "stream:3"}, [&](size_t item, std::string_view chunk) {
    std::lock_guard<std::mutex> lock(mu);
    parts.emplace_back(item, Unpacked(chunk));
    return true;
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->items.size(), 2u);
  EXPECT_EQ(Unpacked(r->items[1]), "done");
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(parts.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(parts[k].first, 1u);  // the second input streamed
    EXPECT_EQ(parts[k].second, "part" + std::to_string(k));
  }
}

// The measured cost per input (what the turn quantum divides by) counts
// only the inputs that ran: ones that failed on their own took next to
// nothing, and counted they would make the model look cheap.
TEST_F(ItemPathTest, InputsThatFailedOnTheirOwnDoNotCountInTheMeasuredCost) {
  auto r = Submit({"slow:200", "alone:1", "alone:2", "alone:3", "alone:4"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().reason(), "context_length_exceeded");
  // Measured once the batch is over, which is just after its answer went out.
  const Gauge* cost = metrics_.GetGauge("shoal_worker_forward_cost_us_per_token", "", {{"model", "scripted-ocr"}});
  ASSERT_TRUE(shoal::testing::Eventually([&] { return cost->Value() > 0; }));
  const double cost_us = cost->Value();
  // One input ran for 200 ms; over all five inputs it would be 40 ms each.
  EXPECT_GE(cost_us, 200e3);
  EXPECT_LT(cost_us, 2e6);
}

TEST_F(ItemPathTest, OneCallersBadInputFailsOnlyThatCaller) {
  // Several requests in flight together so the worker batches them.
  std::vector<std::future<Result<ItemResult>>> futures;
  for (int i = 0; i < 6; ++i)
    futures.push_back(std::async(std::launch::async, [this, i] {
      return Submit({i == 3 ? std::string("bad image") : "ok" + std::to_string(i)});
    }));
  for (int i = 0; i < 6; ++i) {
    auto r = futures[i].get();
    if (i == 3) {
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(r.status().reason(), "invalid_image");
    } else {
      ASSERT_TRUE(r.ok()) << i << ": " << r.status().ToString();
      EXPECT_EQ(Unpacked(r->items[0]), "OK" + std::to_string(i));
    }
  }
}

// A backend that answers 429 is overloaded, whichever input it was given:
// every caller of the batch gets the 429, and the batch is not sent again
// one message at a time (more requests to a backend that asked for fewer).
TEST_F(ItemPathTest, AnOverloadedBackendIsNotAskedAgainMessageByMessage) {
  busy_inputs = 0;
  most_busy_in_one_call = 0;
  // The first keeps the executor busy, so the others wait and batch.
  auto first = std::async(std::launch::async, [this] { return Submit({"slow:400"}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::vector<std::future<Result<ItemResult>>> futures;
  for (int i = 0; i < 6; ++i) futures.push_back(std::async(std::launch::async, [this] { return Submit({"busy"}); }));
  ASSERT_TRUE(first.get().ok());
  for (auto& f : futures) {
    auto r = f.get();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
    EXPECT_EQ(r.status().reason(), "upstream_busy");
  }
  ASSERT_GT(most_busy_in_one_call.load(), 1) << "the worker did not batch them; the test shows nothing";
  EXPECT_EQ(busy_inputs.load(), 6);  // each input once
}

// A message whose inputs are all done is answered then, not when the
// batch's slowest input is (a short generation does not wait for a long
// one batched with it).
TEST_F(ItemPathTest, AMessageIsAnsweredWhenItsOwnInputsAreDone) {
  most_in_one_call = 0;
  // The first keeps the executor busy, so the next two wait and batch.
  auto first = std::async(std::launch::async, [this] { return Submit({"slow:400"}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::mutex mu;
  std::vector<std::string> answered;  // in the order the answers came
  auto submit = [&](std::string in) {
    return std::async(std::launch::async, [&, in] {
      auto r = Submit({in});
      std::lock_guard<std::mutex> lock(mu);
      answered.push_back(in);
      return r;
    });
  };
  auto slow = submit("slow:1200");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto quick = submit("quick");
  ASSERT_TRUE(first.get().ok());
  auto q = quick.get();
  auto sl = slow.get();
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  ASSERT_TRUE(sl.ok()) << sl.status().ToString();
  EXPECT_EQ(Unpacked(q->items[0]), "QUICK");
  EXPECT_EQ(Unpacked(sl->items[0]), "slow");
  ASSERT_GE(most_in_one_call.load(), 2) << "the worker did not batch them; the test shows nothing";
  EXPECT_EQ(answered, (std::vector<std::string>{"quick", "slow:1200"}));
}

// A message answered early is done: when the rest of its batch fails
// after it, the rerun of the others one by one leaves it out.
TEST_F(ItemPathTest, AMessageAnsweredEarlyIsNotRunAgainWhenItsBatchFails) {
  most_in_one_call = 0;
  {
    std::lock_guard<std::mutex> lock(runs_mu);
    runs.clear();
  }
  auto first = std::async(std::launch::async, [this] { return Submit({"slow:400"}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto good = std::async(std::launch::async, [this] { return Submit({"fine once"}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto bad = std::async(std::launch::async, [this] { return Submit({"late-bad"}); });
  ASSERT_TRUE(first.get().ok());
  auto g = good.get();
  auto b = bad.get();
  ASSERT_GE(most_in_one_call.load(), 2) << "the worker did not batch them; the test shows nothing";
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(Unpacked(g->items[0]), "FINE ONCE");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().reason(), "late_failure");
  std::lock_guard<std::mutex> lock(runs_mu);
  EXPECT_EQ(runs["fine once"], 1);
}

TEST_F(ItemPathTest, AnInputThatFailsAloneFailsOnlyItsCaller) {
  // In one request: the error of one input is the request's error.
  auto r = Submit({"fine", "alone:x"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().reason(), "context_length_exceeded");
  // Across requests batched together: only that caller sees it, and the
  // others are not rerun (their streams would repeat).
  std::atomic<int> partials{0};
  std::vector<std::future<Result<ItemResult>>> futures;
  for (int i = 0; i < 6; ++i)
    futures.push_back(std::async(std::launch::async, [this, i, &partials] {
      return Submit({i == 2 ? std::string("alone:y") : "stream:2"},
                    [&partials](size_t, std::string_view) {
                      ++partials;
                      return true;
                    });
    }));
  for (int i = 0; i < 6; ++i) {
    auto got = futures[i].get();
    if (i == 2) {
      ASSERT_FALSE(got.ok());
      EXPECT_EQ(got.status().reason(), "context_length_exceeded");
    } else {
      ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
      EXPECT_EQ(Unpacked(got->items[0]), "done");
    }
  }
  EXPECT_EQ(partials.load(), 5 * 2);  // each stream once
}

TEST_F(ItemPathTest, TokenTaskOnAnItemRuntimeGetsFloatRowsFromTexts) {
  EmbedJob job;
  job.model = "remote-embed";
  job.texts = {"row:0.5", "row:-1"};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 20000;
  std::promise<Result<EmbedResult>> p;
  auto f = p.get_future();
  dispatcher_->SubmitEmbed(job, [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
  auto r = f.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rows, 2);
  EXPECT_EQ(r->dim, 2);
  EXPECT_EQ(r->data, (std::vector<float>{0.5f, 2.0f, -1.0f, 2.0f}));
}

TEST_F(ItemPathTest, WrongInputKindsGetClearErrors) {
  // Token ids for an item runtime serving an embed task.
  EmbedJob job;
  job.model = "remote-embed";
  job.token_ids = {{1, 2, 3}};
  job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 20000;
  std::promise<Result<EmbedResult>> p;
  auto f = p.get_future();
  dispatcher_->SubmitEmbed(job, [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
  auto r = f.get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().reason(), "wrong_input_type");
  // Text for an OCR model (task ocr wants binary items).
  EmbedJob text;
  text.task = "ocr";
  text.model = "scripted-ocr";
  text.texts = {"not an image"};
  text.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 20000;
  std::promise<Result<EmbedResult>> q;
  auto g = q.get_future();
  dispatcher_->SubmitEmbed(text, [&q](Result<EmbedResult> r) { q.set_value(std::move(r)); });
  auto t = g.get();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().reason(), "wrong_input_type");
}

}  // namespace
}  // namespace shoal
