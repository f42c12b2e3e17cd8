// Which workers an operator action goes to (FleetControl::Plan), from a
// registry snapshot; a stopping FleetControl answering the actions under
// way; and the gateway's registry view (FleetView) keeping its catalog
// while NATS is unreachable (real nats-server).
#include "gateway/fleet_control.h"

#include <nats/nats.h>
#include <signal.h>

#include <chrono>
#include <future>
#include <mutex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "support/test_env.h"
#include "wire/work_message.h"

namespace shoal {
namespace {

FleetSnapshot Fleet(const std::vector<std::string>& heartbeats) {
  FleetSnapshot s;
  s.nats_connected = true;
  s.models["m"] = CatalogModel{"m", "embed", 4, 16, true, "{}", {}};
  s.models["other"] = CatalogModel{"other", "embed", 4, 16, true, "{}", {}};
  for (const auto& hb : heartbeats) {
    WorkerInfo w;
    EXPECT_TRUE(ParseWorkerHeartbeat(hb, &w)) << hb;
    s.workers.push_back(w);
  }
  return s;
}

std::vector<std::string> Workers(const Result<std::vector<FleetControl::Target>>& plan) {
  std::vector<std::string> out;
  if (!plan.ok()) return {"error: " + std::string(plan.status().reason())};
  for (const auto& t : *plan) out.push_back(t.worker + ":" + t.action);
  return out;
}

TEST(FleetControlPlan, LoadGoesWhereItIsResidentElseToTheWorkerWithMostRoom) {
  auto snap = Fleet({
      R"({"id":"full","memory_used_bytes":900,"memory_budget_bytes":1000,"models":[{"name":"m","state":"not_loaded"}]})",
      R"({"id":"roomy","memory_used_bytes":100,"memory_budget_bytes":1000,"models":[{"name":"m","state":"not_loaded"}]})",
      R"({"id":"elsewhere","models":[{"name":"other","state":"loaded"}]})",
  });
  // Nowhere resident: every worker that serves it, most room first, as
  // alternatives (the next is asked only if one has no room after all).
  auto plan = FleetControl::Plan(snap, "load", "m", "");
  EXPECT_EQ(Workers(plan), (std::vector<std::string>{"roomy:load", "full:load"}));
  for (const auto& t : *plan) EXPECT_TRUE(t.alternative);
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "pin", "m", "")), (std::vector<std::string>{"roomy:pin", "full:pin"}));
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "m", "full")), std::vector<std::string>{"full:load"});
  // A worker this gateway has an action under way on goes after one it has
  // none on (a worker runs one at a time): loads asked for together spread.
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "m", "", {{"roomy", 1}})),
            (std::vector<std::string>{"full:load", "roomy:load"}));
  // "elsewhere" does not serve m.
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "m", "elsewhere")),
            std::vector<std::string>{"error: worker_not_found"});

  snap = Fleet({
      R"({"id":"a","models":[{"name":"m","state":"loaded","pinned":true}]})",
      R"({"id":"b","models":[{"name":"m","state":"failed"}]})",
      R"({"id":"c","models":[{"name":"m","state":"not_loaded"}]})",
  });
  plan = FleetControl::Plan(snap, "load", "m", "");
  EXPECT_EQ(Workers(plan), std::vector<std::string>{"a:load"});
  EXPECT_FALSE(plan->front().alternative);
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "unload", "m", "")), (std::vector<std::string>{"a:unload", "b:unload"}));
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "unpin", "m", "")), std::vector<std::string>{"a:unpin"});
  // Where it is pinned, whatever its state.
  snap = Fleet({
      R"({"id":"a","models":[{"name":"m","state":"loading","pinned":false}]})",
      R"({"id":"b","models":[{"name":"m","state":"failed","pinned":true}]})",
  });
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "unpin", "m", "")), std::vector<std::string>{"b:unpin"});
}

// On GPU workers a model whose runtime computes on the host goes where the
// host memory budget has room; a TorchScript model where the GPU's has.
TEST(FleetControlPlan, OnGpuWorkersAHostModelGoesWhereTheHostBudgetHasRoom) {
  auto snap = Fleet({
      R"({"id":"gpu-full","device":"cuda:0","memory_used_bytes":900,"memory_budget_bytes":1000,
          "host_memory_used_bytes":0,"host_memory_budget_bytes":4000,"models":[{"name":"m","state":"not_loaded"}]})",
      R"({"id":"host-full","device":"cuda:0","memory_used_bytes":0,"memory_budget_bytes":1000,
          "host_memory_used_bytes":3900,"host_memory_budget_bytes":4000,"models":[{"name":"m","state":"not_loaded"}]})",
  });
  snap.models["m"].runtime = "torchscript";
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "m", "")),
            (std::vector<std::string>{"host-full:load", "gpu-full:load"}));
  snap.models["m"].runtime = "ocr";
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "m", "")),
            (std::vector<std::string>{"gpu-full:load", "host-full:load"}));
}

TEST(FleetControlPlan, Errors) {
  auto snap = Fleet({R"({"id":"a","models":[{"name":"other","state":"loaded"}]})"});
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "nope", "")), std::vector<std::string>{"error: model_not_found"});
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "load", "m", "")), std::vector<std::string>{"error: no_worker"});
  EXPECT_EQ(Workers(FleetControl::Plan(snap, "explode", "m", "")), std::vector<std::string>{"error: route_not_found"});
  EXPECT_TRUE(FleetControl::Plan(snap, "unload", "m", "")->empty());  // loaded nowhere: nothing to do
}

Result<std::unique_ptr<NatsClient>> Connect(const std::string& url, int64_t js_api_timeout_ms = 5000) {
  NatsOptions no;
  no.url = url;
  no.js_api_timeout_ms = js_api_timeout_ms;
  return NatsClient::Connect(no);
}

// A heartbeat or catalog entry with a null or mistyped field (another
// version of Shoal) is read as far as it can be, not dropped whole.
TEST(FleetViewParsing, NullFieldsTakeTheirDefaults) {
  WorkerInfo w;
  ASSERT_TRUE(ParseWorkerHeartbeat(
      R"({"id":"w1","memory_used_bytes":null,"device":7,"models":[{"name":"m","state":"loaded","memory_bytes":null,"error":null},{"state":"loaded"}]})",
      &w));
  EXPECT_EQ(w.id, "w1");
  EXPECT_EQ(w.memory_used_bytes, 0);
  EXPECT_EQ(w.device, "cpu");
  ASSERT_EQ(w.models.size(), 1u);  // the entry without a name is skipped
  EXPECT_TRUE(w.Has("m", "loaded"));
  EXPECT_EQ(w.models.at("m").memory_bytes, 0);
  EXPECT_FALSE(ParseWorkerHeartbeat(R"({"id":null})", &w));
}

// Any NATS client can write the registry: a model whose state is missing or
// unknown is not taken as loaded, and a number that is negative, a float or
// out of range for its field takes the default instead of wrapping.
TEST(FleetViewParsing, StatesAndNumbersOutsideTheContractTakeTheirDefaults) {
  WorkerInfo w;
  ASSERT_TRUE(ParseWorkerHeartbeat(
      R"({"id":"w1","memory_used_bytes":1e300,"max_models":4294967296,"memory_budget_bytes":12.5,"models":[)"
      R"({"name":"none"},{"name":"odd","state":"warm"},{"name":"num","state":1},)"
      R"({"name":"neg","state":"loaded","backlog":-1},{"name":"ok","state":"loading","backlog":7}]})",
      &w));
  EXPECT_EQ(w.memory_used_bytes, 0);
  EXPECT_EQ(w.max_models, 0);
  EXPECT_EQ(w.memory_budget_bytes, 0);
  EXPECT_EQ(w.models.at("none").state, "not_loaded");
  EXPECT_EQ(w.models.at("odd").state, "not_loaded");
  EXPECT_EQ(w.models.at("num").state, "not_loaded");
  EXPECT_EQ(w.models.at("neg").backlog, 0u);
  EXPECT_EQ(w.models.at("ok").state, "loading");
  EXPECT_EQ(w.models.at("ok").backlog, 7u);
}

// A worker that answers every control request with a fixed reply (none
// when `reply` is empty: a worker busy with a long load), and records the
// requests it got.
struct ScriptedControlWorker {
  std::string reply;
  std::mutex mu;
  std::vector<std::string> requests;
  static void OnMsg(natsConnection* nc, natsSubscription*, natsMsg* msg, void* closure) {
    auto* w = static_cast<ScriptedControlWorker*>(closure);
    std::string reply;
    {
      std::lock_guard<std::mutex> lock(w->mu);
      w->requests.emplace_back(natsMsg_GetData(msg), static_cast<size_t>(natsMsg_GetDataLength(msg)));
      reply = w->reply;
    }
    if (!reply.empty() && natsMsg_GetReply(msg) != nullptr)
      natsConnection_Publish(nc, natsMsg_GetReply(msg), reply.data(), static_cast<int>(reply.size()));
    natsMsg_Destroy(msg);
  }
  size_t asked() {
    std::lock_guard<std::mutex> lock(mu);
    return requests.size();
  }
};

// A stopping gateway answers an action still waiting for a worker (a load
// can take minutes) with 503 shutting_down at once, instead of keeping the
// process, and its port, up until the worker answers or the wait runs out.
TEST(FleetControlStop, AnswersAnActionUnderWayWithShuttingDown) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  ScriptedControlWorker silent;  // takes control requests and never answers them
  auto sub = (*client)->Subscribe(wire::ControlSubject("silent"), &ScriptedControlWorker::OnMsg, &silent);
  ASSERT_TRUE(sub.ok());
  auto snap = std::make_shared<FleetSnapshot>(
      Fleet({R"({"id":"silent","models":[{"name":"m","state":"not_loaded"}]})"}));
  FleetControlOptions o;
  o.threads = 1;
  o.load_timeout_ms = 600000;
  auto control = FleetControl::Create(o, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  std::promise<Result<ControlOutcome>> under_way, queued;
  (*control)->Act("load", "m", "", [&](Result<ControlOutcome> r) { under_way.set_value(std::move(r)); });
  ASSERT_TRUE(shoal::testing::Eventually([&] { return silent.asked() == 1; }));
  (*control)->Act("load", "m", "", [&](Result<ControlOutcome> r) { queued.set_value(std::move(r)); });
  (*control)->Stop();  // returns once the thread has given up (not after 10 minutes)
  for (auto* p : {&under_way, &queued}) {
    auto f = p->get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready);
    const Result<ControlOutcome> r = f.get();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(r.status().reason(), "shutting_down");
  }
  EXPECT_EQ(silent.asked(), 1u);
}

// An action for several workers asks them all at once: a load that takes
// minutes on each does not add up worker after worker. Here neither worker
// answers until both have been asked.
TEST(FleetControlRun, AsksEveryWorkerAtOnce) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  struct Asked {
    std::mutex mu;
    std::vector<std::string> reply_to;
  } asked;
  auto note = [](natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* a = static_cast<Asked*>(closure);
    std::lock_guard<std::mutex> lock(a->mu);
    a->reply_to.emplace_back(natsMsg_GetReply(msg));
    natsMsg_Destroy(msg);
  };
  auto sub_a = (*client)->Subscribe(wire::ControlSubject("a"), note, &asked);
  auto sub_b = (*client)->Subscribe(wire::ControlSubject("b"), note, &asked);
  ASSERT_TRUE(sub_a.ok() && sub_b.ok());
  auto snap = std::make_shared<FleetSnapshot>(Fleet({R"({"id":"a","models":[{"name":"m","state":"loaded"}]})",
                                                     R"({"id":"b","models":[{"name":"m","state":"loaded"}]})"}));
  FleetControlOptions o;
  o.load_timeout_ms = 600000;
  auto control = FleetControl::Create(o, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  std::promise<Result<ControlOutcome>> done;
  (*control)->Act("load", "m", "", [&](Result<ControlOutcome> r) { done.set_value(std::move(r)); });
  const bool both = shoal::testing::Eventually([&] {
    std::lock_guard<std::mutex> lock(asked.mu);
    return asked.reply_to.size() == 2;
  }, std::chrono::seconds(10));
  if (!both) (*control)->Stop();  // ends the wait for the first worker's answer
  ASSERT_TRUE(both) << "the second worker was not asked before the first answered";
  for (const std::string& to : asked.reply_to)
    ASSERT_TRUE((*client)->Publish(to, R"({"ok":true,"status":{"state":"loaded"}})").ok());
  auto r = done.get_future().get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->results.size(), 2u);
  EXPECT_EQ(r->results[0].worker, "a");
  EXPECT_EQ(r->results[1].worker, "b");
  for (const auto& res : r->results) EXPECT_TRUE(res.status.ok()) << res.status.ToString();
}

Result<ControlOutcome> ActAndWait(FleetControl& control, const std::string& action) {
  std::promise<Result<ControlOutcome>> done;
  control.Act(action, "m", "", [&](Result<ControlOutcome> r) { done.set_value(std::move(r)); });
  return done.get_future().get();
}

// A load that no worker has yet goes to the worker with most room; when it
// has no room after all (its registry entry was behind, or its residents
// are pinned), the next is asked, and only the worker that did it is
// reported. Every request carries the time its caller stops waiting.
TEST(FleetControlRun, ALoadThatFindsNoRoomGoesToTheNextWorker) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  ScriptedControlWorker full, roomy;
  full.reply = R"({"ok":false,"worker":"a","error":{"kind":"resource_exhausted","message":"no room","code":"no_room_for_model"}})";
  roomy.reply = R"({"ok":true,"worker":"b","status":{"state":"loaded"}})";
  auto sub_a = (*client)->Subscribe(wire::ControlSubject("a"), &ScriptedControlWorker::OnMsg, &full);
  auto sub_b = (*client)->Subscribe(wire::ControlSubject("b"), &ScriptedControlWorker::OnMsg, &roomy);
  ASSERT_TRUE(sub_a.ok() && sub_b.ok());
  auto snap = std::make_shared<FleetSnapshot>(Fleet({
      R"({"id":"a","memory_used_bytes":0,"memory_budget_bytes":1000,"models":[{"name":"m","state":"not_loaded"}]})",
      R"({"id":"b","memory_used_bytes":500,"memory_budget_bytes":1000,"models":[{"name":"m","state":"not_loaded"}]})"}));
  auto control = FleetControl::Create(FleetControlOptions{}, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  auto r = ActAndWait(**control, "load");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->results.size(), 1u);
  EXPECT_EQ(r->results[0].worker, "b");
  EXPECT_TRUE(r->results[0].status.ok()) << r->results[0].status.ToString();
  ASSERT_EQ(full.asked(), 1u);
  EXPECT_EQ(roomy.asked(), 1u);
  const auto req = nlohmann::json::parse(full.requests[0]);
  EXPECT_GT(req.value("deadline_unix_ms", int64_t{0}), SystemClock::Get()->NowUnixMs());
  // No worker has room: the last one's answer is the outcome.
  {
    std::lock_guard<std::mutex> lock(roomy.mu);
    roomy.reply = full.reply;
  }
  r = ActAndWait(**control, "load");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->results.size(), 1u);
  EXPECT_EQ(r->results[0].worker, "b");
  EXPECT_EQ(r->results[0].status.reason(), "no_room_for_model");
  // A worker whose GPU has failed cannot load anything either.
  {
    std::lock_guard<std::mutex> lock(full.mu);
    full.reply = R"({"ok":false,"worker":"a","error":{"kind":"unavailable","message":"GPU failed","code":"device_fault"}})";
  }
  {
    std::lock_guard<std::mutex> lock(roomy.mu);
    roomy.reply = R"({"ok":true,"worker":"b","status":{"state":"loaded"}})";
  }
  r = ActAndWait(**control, "load");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->results.size(), 1u);
  EXPECT_EQ(r->results[0].worker, "b");
  EXPECT_TRUE(r->results[0].status.ok()) << r->results[0].status.ToString();
}

// A worker that says it failed is never reported as done, whatever its
// error's kind says (here "ok", or none at all).
TEST(FleetControlRun, AFailureReplyIsAFailureWhateverItsKind) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok());
  ScriptedControlWorker odd;
  auto sub = (*client)->Subscribe(wire::ControlSubject("a"), &ScriptedControlWorker::OnMsg, &odd);
  ASSERT_TRUE(sub.ok());
  auto snap = std::make_shared<FleetSnapshot>(Fleet({R"({"id":"a","models":[{"name":"m","state":"loaded"}]})"}));
  auto control = FleetControl::Create(FleetControlOptions{}, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  for (const char* reply : {R"({"ok":false,"worker":"a","error":{"kind":"ok","message":"it broke"}})",
                            R"({"ok":false,"worker":"a"})"}) {
    {
      std::lock_guard<std::mutex> lock(odd.mu);
      odd.reply = reply;
    }
    auto r = ActAndWait(**control, "unload");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->results.size(), 1u);
    EXPECT_EQ(r->results[0].status.code(), StatusCode::kInternal) << reply;
  }
}

// Two loads asked for together go to two workers: the one with most room
// is still busy with the first (a worker runs one action at a time).
TEST(FleetControlRun, LoadsAskedForTogetherSpreadOverTheWorkers) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok());
  ScriptedControlWorker slow, other;  // slow: still loading, never answers here
  other.reply = R"({"ok":true,"worker":"b","status":{"state":"loaded"}})";
  auto sub_a = (*client)->Subscribe(wire::ControlSubject("a"), &ScriptedControlWorker::OnMsg, &slow);
  auto sub_b = (*client)->Subscribe(wire::ControlSubject("b"), &ScriptedControlWorker::OnMsg, &other);
  ASSERT_TRUE(sub_a.ok() && sub_b.ok());
  auto snap = std::make_shared<FleetSnapshot>(Fleet({
      R"({"id":"a","memory_used_bytes":0,"memory_budget_bytes":1000,
          "models":[{"name":"m","state":"not_loaded"},{"name":"other","state":"not_loaded"}]})",
      R"({"id":"b","memory_used_bytes":500,"memory_budget_bytes":1000,
          "models":[{"name":"m","state":"not_loaded"},{"name":"other","state":"not_loaded"}]})"}));
  FleetControlOptions o;
  o.load_timeout_ms = 600000;
  auto control = FleetControl::Create(o, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  std::promise<Result<ControlOutcome>> first, second;
  (*control)->Act("load", "m", "", [&](Result<ControlOutcome> r) { first.set_value(std::move(r)); });
  ASSERT_TRUE(shoal::testing::Eventually([&] { return slow.asked() == 1; }));
  (*control)->Act("load", "other", "", [&](Result<ControlOutcome> r) { second.set_value(std::move(r)); });
  auto r = second.get_future().get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->results.size(), 1u);
  EXPECT_EQ(r->results[0].worker, "b");
  EXPECT_EQ(slow.asked(), 1u);
  (*control)->Stop();  // ends the first load's wait
  EXPECT_EQ(first.get_future().get().status().reason(), "shutting_down");
}

// Without NATS the registry view is empty: an action is refused (503)
// rather than found to have nothing to do.
TEST(FleetControlRun, WithoutNatsAnActionIsRefused) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok());
  auto snap = std::make_shared<FleetSnapshot>(Fleet({}));
  snap->nats_connected = false;
  auto control = FleetControl::Create(FleetControlOptions{}, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  auto r = ActAndWait(**control, "unload");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(r.status().reason(), "queue_unavailable");
  // A model the catalog does not have is still 404.
  std::promise<Result<ControlOutcome>> done;
  (*control)->Act("unload", "nope", "", [&](Result<ControlOutcome> o) { done.set_value(std::move(o)); });
  EXPECT_EQ(done.get_future().get().status().reason(), "model_not_found");
}

// An action's timeout runs from when it was asked for: one that waited it
// out queued behind another is answered without reaching a worker (which
// would do it after its caller had been told it timed out).
TEST(FleetControlRun, AnActionThatTimedOutInTheQueueIsNotSent) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok());
  ScriptedControlWorker silent;  // takes control requests and never answers them
  auto sub = (*client)->Subscribe(wire::ControlSubject("silent"), &ScriptedControlWorker::OnMsg, &silent);
  ASSERT_TRUE(sub.ok());
  auto snap = std::make_shared<FleetSnapshot>(
      Fleet({R"({"id":"silent","models":[{"name":"m","state":"loaded"}]})"}));
  FleetControlOptions o;
  o.threads = 1;
  o.load_timeout_ms = 4000;
  o.timeout_ms = 500;  // the unload's time is up while the load still holds the thread
  auto control = FleetControl::Create(o, client->get(), [snap] { return snap; });
  ASSERT_TRUE(control.ok());
  std::promise<Result<ControlOutcome>> first, second;
  auto first_done = first.get_future();
  (*control)->Act("load", "m", "", [&](Result<ControlOutcome> r) { first.set_value(std::move(r)); });
  (*control)->Act("unload", "m", "", [&](Result<ControlOutcome> r) { second.set_value(std::move(r)); });
  // Answered when its time is up, not when the thread is free again.
  auto b = second.get_future().get();
  EXPECT_EQ(first_done.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the queued unload was answered only after the load it waited behind";
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kDeadlineExceeded);
  auto a = first_done.get();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->results[0].status.code(), StatusCode::kDeadlineExceeded) << a->results[0].status.ToString();
  EXPECT_EQ(silent.asked(), 1u) << "the unload went to the worker after its caller's time was up";
}

// While NATS cannot be reached the gateway keeps the catalog it last read:
// a request then fails as the queue's unavailability (503), never as a
// model that does not exist (404).
TEST(FleetViewCatalog, OutlivesALostConnectionToNats) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto kv = KvBucket::Open(**client, wire::kModelsBucket, 0);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  ASSERT_TRUE((*kv)->Put(wire::ModelKvKey("org/m"), R"({"name":"org/m","task":"embed","dim":4})").ok());
  ASSERT_TRUE(EnsureWorkStream(**client, {}).ok());
  const std::string subject = wire::WorkSubject("org/m");
  for (int i = 0; i < 2; ++i)
    ASSERT_EQ(js_Publish(nullptr, (*client)->js(), subject.c_str(), "x", 1, nullptr, nullptr), NATS_OK);
  MetricsRegistry metrics;
  auto view = FleetView::Create(FleetViewOptions{}, client->get(), &metrics);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  (*view)->Refresh();
  ASSERT_EQ((*view)->Snapshot()->models.count("org/m"), 1u);
  EXPECT_TRUE((*view)->Snapshot()->nats_connected);
  EXPECT_EQ((*view)->Snapshot()->queue_depth, 2u);
  nats.process().Stop();
  ASSERT_TRUE(shoal::testing::Eventually([&] { return !(*client)->IsConnected(); }));
  (*view)->Refresh();
  const auto snap = (*view)->Snapshot();
  EXPECT_FALSE(snap->nats_connected);
  ASSERT_EQ(snap->models.count("org/m"), 1u);
  EXPECT_EQ(snap->models.at("org/m").dim, 4);
  // The queue is not known to have drained: its depth stays the last read.
  EXPECT_EQ(snap->queue_depth, 2u);
}

// A registry entry that is not a heartbeat (not JSON, or no id) is no
// worker: not counted as alive, so /readyz does not answer ready on it.
TEST(FleetViewRegistry, AnUnreadableEntryIsNotALiveWorker) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto workers = KvBucket::Open(**client, wire::kWorkersBucket, 60000);
  ASSERT_TRUE(workers.ok()) << workers.status().ToString();
  ASSERT_TRUE((*workers)->Put("junk", "not json").ok());
  ASSERT_TRUE((*workers)->Put("anon", R"({"models":[]})").ok());
  MetricsRegistry metrics;
  auto view = FleetView::Create(FleetViewOptions{}, client->get(), &metrics);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  (*view)->Refresh();
  EXPECT_TRUE((*view)->Snapshot()->workers.empty());
  EXPECT_TRUE((*view)->Snapshot()->worker_json.empty());
  EXPECT_NE(metrics.Render().find("shoal_workers_alive 0"), std::string::npos) << metrics.Render();
  ASSERT_TRUE((*workers)->Put("w1", R"({"id":"w1","models":[]})").ok());
  (*view)->Refresh();
  EXPECT_EQ((*view)->Snapshot()->worker_json.size(), 1u);
  EXPECT_NE(metrics.Render().find("shoal_workers_alive 1"), std::string::npos) << metrics.Render();
  // The registry outlives the view: rendering after it is gone keeps the
  // last values and reaches nothing freed.
  view->reset();
  EXPECT_NE(metrics.Render().find("shoal_workers_alive 1"), std::string::npos) << metrics.Render();
}

// While connected, a registry read that times out keeps the workers of the
// last good read: a view without them would show their models not loaded
// and plan operator actions on nobody.
TEST(FleetViewRegistry, KeepsTheLastWorkersWhileTheRegistryDoesNotAnswer) {
  shoal::testing::TestNatsServer nats;
  auto client = Connect(nats.url(), /*js_api_timeout_ms=*/300);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto workers = KvBucket::Open(**client, wire::kWorkersBucket, 60000);
  ASSERT_TRUE(workers.ok()) << workers.status().ToString();
  ASSERT_TRUE((*workers)->Put("w1", R"({"id":"w1","models":[{"name":"m","state":"loaded"}]})").ok());
  auto models = KvBucket::Open(**client, wire::kModelsBucket, 0);
  ASSERT_TRUE(models.ok());
  ASSERT_TRUE((*models)->Put(wire::ModelKvKey("m"), R"({"name":"m","task":"embed","dim":null,"labels":null})").ok());
  MetricsRegistry metrics;
  auto view = FleetView::Create(FleetViewOptions{}, client->get(), &metrics);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  (*view)->Refresh();
  ASSERT_EQ((*view)->Snapshot()->workers.size(), 1u);
  ASSERT_EQ((*view)->Snapshot()->models.count("m"), 1u) << "a catalog entry with null fields was dropped";
  const pid_t pid = nats.process().pid();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  (*view)->Refresh();  // its reads time out; the connection still stands
  ::kill(pid, SIGCONT);
  const auto snap = (*view)->Snapshot();
  EXPECT_TRUE(snap->nats_connected);
  ASSERT_EQ(snap->workers.size(), 1u) << "a registry timeout hid a live worker";
  EXPECT_TRUE(snap->workers[0].Has("m", "loaded"));
}

}  // namespace
}  // namespace shoal
