// A fleet on real workers: a real nats-server -js, real Worker instances
// running tiny-bert copies on libtorch, and the gateway's Dispatcher. Covers
// lazy loading through the queue, LRU eviction around pinned models, one
// load for many cold requests across two workers, a load failure answered
// to every waiting caller once (and a failure of one worker's own served by
// another), and operator control.
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gateway/dispatcher.h"
#include "runtime/runtime.h"
#include "support/forwarding_runtime.h"
#include "support/test_env.h"
#include "wire/work_message.h"
#include "worker/model_manager.h"
#include "worker/worker.h"
#include "worker/worker_member_for_tests.h"

namespace shoal {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using shoal::testing::MakeFleetRepository;
using shoal::testing::Eventually;
using shoal::testing::TempDir;
using shoal::testing::TestNatsServer;
using namespace std::chrono_literals;


class FleetTest : public ::testing::Test {
 public:  // shared helpers below the fixture use it too
  void SetUp() override {
    NatsOptions no;
    no.url = server_.url();
    auto c = NatsClient::Connect(no);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    DispatcherOptions dopt;
    auto d = Dispatcher::Create(dopt, client_.get(), &gateway_metrics_);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dispatcher_ = std::move(d).value();
  }

  WorkerOptions Options() const {
    WorkerOptions wo;
    wo.model_repository = repo_.path();
    wo.intra_op_threads = 1;
    wo.preload = {};
    wo.demand_poll_ms = 50;
    wo.heartbeat_interval_ms = 300;
    wo.heartbeat_ttl_ms = 1500;
    wo.fetch_poll_ms = 200;
    return wo;
  }

  // A worker with its own connection and metrics, as another process would have.
  using Member = shoal::testing::WorkerMember;
  Member Start(const WorkerOptions& wo) { return shoal::testing::StartWorkerMember(server_.url(), wo); }

  std::future<Result<EmbedResult>> EmbedAsync(const std::string& model, const std::string& text,
                                              int64_t timeout_ms = 30000) {
    auto p = std::make_shared<std::promise<Result<EmbedResult>>>();
    auto f = p->get_future();
    EmbedJob job;
    job.model = model;
    job.texts = {text};
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + timeout_ms;
    dispatcher_->SubmitEmbed(std::move(job), [p](Result<EmbedResult> r) { p->set_value(std::move(r)); });
    return f;
  }
  Result<EmbedResult> Embed(const std::string& model, const std::string& text) {
    return EmbedAsync(model, text).get();
  }

  // Sends `n` requests for `model` at once; each must get the terminal
  // model_load_failed, well before its deadline.
  void ExpectEveryCallerGetsTheLoadError(const std::string& model, int n) {
    std::vector<std::future<Result<EmbedResult>>> calls;
    for (int i = 0; i < n; ++i) calls.push_back(EmbedAsync(model, "doomed " + std::to_string(i)));
    for (auto& f : calls) {
      ASSERT_EQ(f.wait_for(25s), std::future_status::ready) << "a caller waited for its deadline instead";
      auto r = f.get();
      EXPECT_EQ(r.status().code(), StatusCode::kBadGateway) << r.status().ToString();
      EXPECT_EQ(r.status().reason(), "model_load_failed");
    }
  }

  // Two workers with --scale-out-backlog 20 and batches of at most
  // `max_batch_size`: the first, on runtimes wrapped in `Slow`, has loaded
  // tiny-a (one request served); the second has nothing loaded.
  template <typename Slow>
  std::pair<Member, Member> StartReplicaPair(int max_batch_size) {
    MakeFleetRepository(repo_.path(), {"tiny-a"});
    WorkerOptions wo = Options();
    wo.scale_out_backlog = 20;
    wo.max_batch_size = max_batch_size;
    WorkerOptions slow = wo;
    slow.runtime_factory = [](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
      ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
      return std::unique_ptr<Runtime>(new Slow(std::move(inner)));
    };
    Member first = Start(slow);
    if (first.worker != nullptr) {
      EXPECT_TRUE(Embed("tiny-a", "first").ok());  // it loads it
    }
    Member second = Start(wo);
    return {std::move(first), std::move(second)};
  }

  static ModelState StateOf(Worker& w, const std::string& model) {
    for (const ModelStatus& s : w.manager().Statuses())
      if (s.name == model) return s.state;
    return ModelState::kNotLoaded;
  }

  TestNatsServer server_;
  TempDir repo_;
  MetricsRegistry gateway_metrics_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Dispatcher> dispatcher_;
};

TEST_F(FleetTest, ColdModelIsLoadedOnDemandAndServed) {
  MakeFleetRepository(repo_.path(), {"tiny-a", "tiny-b"});
  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  EXPECT_TRUE(m.worker->LoadedModels().empty());  // preload none
  auto r = Embed("tiny-b", "wake up");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dim, 64);
  EXPECT_EQ(m.worker->LoadedModels(), std::vector<std::string>{"tiny-b"});
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "tiny-b"}, {"result", "ok"}}), 1);
  EXPECT_EQ(m.Counter("shoal_worker_load_waits_total", {{"model", "tiny-b"}}), 1);
  // The request that waited for the load counts as a load wait, not as
  // time in the queue; the next one finds the model resident.
  const Labels b = {{"model", "tiny-b"}};
  EXPECT_EQ(m.Observed("shoal_worker_load_wait_seconds", b), 1);
  EXPECT_EQ(m.Observed("shoal_worker_queue_wait_seconds", b), 0);
  ASSERT_TRUE(Embed("tiny-b", "again").ok());
  EXPECT_EQ(m.Observed("shoal_worker_load_wait_seconds", b), 1);
  EXPECT_EQ(m.Observed("shoal_worker_queue_wait_seconds", b), 1);
  EXPECT_EQ(m.Counter("shoal_worker_load_waits_total", b), 1);
}

TEST_F(FleetTest, BudgetForTwoEvictsLeastRecentlyUsedAndNeverThePinnedModel) {
  MakeFleetRepository(repo_.path(), {"pinned", "tiny-a", "tiny-b", "tiny-c"});
  WorkerOptions wo = Options();
  wo.pinned = {"pinned"};
  wo.max_models = 3;  // the pinned model plus room for two more
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  Worker& w = *m.worker;
  EXPECT_EQ(StateOf(w, "pinned"), ModelState::kLoaded);

  ASSERT_TRUE(Embed("tiny-a", "one").ok());
  ASSERT_TRUE(Embed("tiny-b", "two").ok());
  // Work still in the stream counts as use (demand touches its model), and
  // b's message leaves the stream only when its ack lands, after its reply:
  // let it go and a demand poll pass before a's use, which must be the later.
  ASSERT_TRUE(Eventually([&] { return GetStreamState(*client_, "SHOAL_WORK")->msgs == 0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * wo.demand_poll_ms));
  ASSERT_TRUE(Embed("tiny-a", "a again: now b is the least recently used").ok());
  ASSERT_TRUE(Embed("tiny-c", "three").ok());
  EXPECT_EQ(StateOf(w, "tiny-b"), ModelState::kNotLoaded);
  EXPECT_EQ(StateOf(w, "tiny-a"), ModelState::kLoaded);
  EXPECT_EQ(StateOf(w, "tiny-c"), ModelState::kLoaded);
  EXPECT_EQ(m.Counter("shoal_worker_model_evictions_total", {{"model", "tiny-b"}}), 1);

  // The pinned model, used least recently of all, is never the victim.
  ASSERT_TRUE(Embed("tiny-b", "b is back").ok());
  EXPECT_EQ(StateOf(w, "pinned"), ModelState::kLoaded);
  EXPECT_EQ(StateOf(w, "tiny-a"), ModelState::kNotLoaded);
  EXPECT_EQ(m.Counter("shoal_worker_model_evictions_total", {{"model", "pinned"}}), 0);
  ASSERT_TRUE(Embed("pinned", "still here").ok());
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "pinned"}, {"result", "ok"}}), 1);
}

// A cold model that finds no room (every resident model pinned) waits,
// and the worker says why once, not on every demand poll (50 ms here).
TEST_F(FleetTest, AModelWithNoRoomIsLoggedOncePerEpisodeNotOnEveryPoll) {
  MakeFleetRepository(repo_.path(), {"pinned", "tiny-a"});
  WorkerOptions wo = Options();
  wo.pinned = {"pinned"};
  wo.max_models = 1;
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  ::testing::internal::CaptureStderr();
  auto r = EmbedAsync("tiny-a", "no room", 1500).get();  // about 30 polls
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  EXPECT_EQ(StateOf(*m.worker, "tiny-a"), ModelState::kNotLoaded);
  size_t lines = 0;
  for (size_t at = log.find("cannot load tiny-a on demand"); at != std::string::npos;
       at = log.find("cannot load tiny-a on demand", at + 1))
    ++lines;
  EXPECT_EQ(lines, 1u) << log;
}

TEST_F(FleetTest, ManyConcurrentColdRequestsCauseExactlyOneLoadAcrossTwoWorkers) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  Member w1 = Start(Options());
  Member w2 = Start(Options());
  ASSERT_NE(w1.worker, nullptr);
  ASSERT_NE(w2.worker, nullptr);
  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int i = 0; i < 24; ++i) calls.push_back(EmbedAsync("tiny-a", "cold request " + std::to_string(i)));
  for (auto& f : calls) {
    auto r = f.get();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  const Labels ok = {{"model", "tiny-a"}, {"result", "ok"}};
  EXPECT_EQ(w1.Counter("shoal_worker_model_loads_total", ok) + w2.Counter("shoal_worker_model_loads_total", ok), 1);
  EXPECT_EQ(w1.worker->LoadedModels().size() + w2.worker->LoadedModels().size(), 1u);
}

TEST_F(FleetTest, LoadFailureReachesEveryWaitingCallerOnceAsATerminalError) {
  MakeFleetRepository(repo_.path(), {"tiny-a"}, {"broken"});
  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  ExpectEveryCallerGetsTheLoadError("broken", 8);
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "broken"}, {"result", "error"}}), 1);
  EXPECT_EQ(StateOf(*m.worker, "broken"), ModelState::kFailed);
  // Nothing is left to be redelivered, and healthy models still serve.
  EXPECT_TRUE(Eventually([&] { return GetStreamState(*client_, "SHOAL_WORK")->msgs == 0; }));
  EXPECT_TRUE(Embed("tiny-a", "fine").ok());
}

// Work for a model larger than the worker's whole memory budget is answered
// with 429 no_room_for_model once no other worker can take it, not left to
// wait for its deadline (the model never loads, so it never fails either).
TEST_F(FleetTest, WorkForAModelLargerThanTheWholeBudgetIsAnswered) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions wo = Options();
  wo.memory_budget_bytes = 1000;  // tiny-bert's estimate is its file size x 1.3
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = EmbedAsync("tiny-a", "too big", 20000).get();
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "no_room_for_model");
  EXPECT_NE(r.status().message().find("more than the whole memory budget"), std::string::npos)
      << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "the caller waited for its deadline";
  EXPECT_TRUE(Eventually([&] { return GetStreamState(*client_, "SHOAL_WORK")->msgs == 0; }));
}

// On a GPU peer a model of another runtime than TorchScript lives in host
// memory, so the peer's host budget is the one that may hold it. A peer
// whose GPU budget is ample but whose host budget is as small as this
// worker's cannot take the model: the work is answered 429 here, not left
// for its deadline. (The GPU peer is a registry entry written by hand:
// this machine has no GPU; what is tested is this worker's reading of it.)
TEST_F(FleetTest, APeersHostBudgetIsTheOneThatMayHoldAHostModel) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(shoal::testing::ModelsDir()) / "tiny-bert-py";
  const fs::path dir = fs::path(repo_.path()) / "py-a";
  fs::create_directories(dir);
  json config = json::parse(std::ifstream(src / "shoal.json"));
  config["name"] = "py-a";
  std::ofstream(dir / "shoal.json") << config.dump(2);
  for (const char* f : {"model.py", "shoal_runtime.py", "vocab.txt", "weights.pt"}) fs::create_symlink(src / f, dir / f);
  WorkerOptions small = Options();
  small.memory_budget_bytes = 1000;  // the model's estimate is its weights' file size x 1.3
  Member m = Start(small);
  ASSERT_NE(m.worker, nullptr);
  auto kv = KvBucket::Bind(*client_, wire::kWorkersBucket);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  const std::string peer =
      json{{"id", "gpu-peer"}, {"device", "cuda:0"}, {"memory_budget_bytes", int64_t{1} << 40},
           {"memory_used_bytes", 0}, {"host_memory_budget_bytes", 1000}, {"host_memory_used_bytes", 0},
           {"models", json::array({json{{"name", "py-a"}, {"state", "not_loaded"}}})}}
          .dump();
  std::atomic<bool> done{false};
  std::thread heartbeat([&] {  // the entries live 1.5 s
    while (!done) {
      (void)(*kv)->Put("gpu-peer", peer);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  ASSERT_TRUE(shoal::testing::Eventually([&] { return (*kv)->Get("gpu-peer").ok(); }));
  auto r = EmbedAsync("py-a", "too big for both", 8000).get();
  done = true;
  heartbeat.join();
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  EXPECT_EQ(r.status().reason(), "no_room_for_model");
}

// A placement claim this worker already holds (its delete failed earlier)
// is taken as its own and given back once the load settles, not left to
// block peers until its TTL.
TEST_F(FleetTest, AClaimFromAnEarlierRoundIsGivenBackAfterTheLoad) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  auto claims = KvBucket::Bind(*client_, wire::kPlacementBucket);
  ASSERT_TRUE(claims.ok()) << claims.status().ToString();
  const std::string key = wire::ModelKvKey("tiny-a") + ".0";
  ASSERT_TRUE((*claims)->Put(key, m.worker->id()).ok());
  ASSERT_TRUE(Embed("tiny-a", "cold").ok());
  // Well inside the claim's TTL (15 s).
  EXPECT_TRUE(Eventually([&] { return (*claims)->Get(key).status().code() == StatusCode::kNotFound; }, 5s))
      << "the claim was left for its TTL";
}

// A claim taken over by a peer while this worker loaded (as after its own
// expired) is the peer's: giving back this worker's claim leaves it, since
// a claim is deleted only at the revision the worker read as its own.
TEST_F(FleetTest, GivingBackAClaimLeavesOneAPeerTookMeanwhile) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(repo_.path()) / "slow";
  fs::create_directories(dir);
  fs::create_symlink(fs::path(shoal::testing::ModelsDir()) / "tiny-bert" / "vocab.txt", dir / "vocab.txt");
  std::ofstream(dir / "shoal.json")
      << R"({"name":"slow","runtime":"sim","dim":8,"sim":{"load_ms":1500,"fixed_us":100,"per_padded_token_us":0}})";
  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  auto claims = KvBucket::Bind(*client_, wire::kPlacementBucket);
  ASSERT_TRUE(claims.ok()) << claims.status().ToString();
  const std::string key = wire::ModelKvKey("slow") + ".0";
  auto pending = EmbedAsync("slow", "cold");
  ASSERT_TRUE(Eventually([&] {
    auto holder = (*claims)->Get(key);
    return holder.ok() && *holder == m.worker->id();
  }, 5s)) << "the worker did not claim the cold model";
  ASSERT_TRUE((*claims)->Put(key, "peer-x").ok());  // the load takes 1.5 s
  auto r = pending.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::this_thread::sleep_for(500ms);  // demand polls (50 ms) after the load settled
  auto holder = (*claims)->Get(key);
  ASSERT_TRUE(holder.ok()) << "the peer's claim was deleted: " << holder.status().ToString();
  EXPECT_EQ(*holder, "peer-x");
}

// A cold model that would make one worker evict goes to a peer with room
// for it beside its own models, even one slower to notice the work (it
// reads the backlog every second, the full worker every 50 ms): the full
// worker's resident model stays.
TEST_F(FleetTest, AColdModelGoesToAPeerWithRoomRatherThanEvicting) {
  MakeFleetRepository(repo_.path(), {"tiny-a", "tiny-b"});
  WorkerOptions full = Options();
  full.max_models = 1;
  full.preload = {"tiny-a"};
  full.heartbeat_interval_ms = 3000;  // how long it leaves the model to the peer
  full.heartbeat_ttl_ms = 9000;
  Member stays = Start(full);
  ASSERT_NE(stays.worker, nullptr);
  ASSERT_EQ(StateOf(*stays.worker, "tiny-a"), ModelState::kLoaded);
  WorkerOptions roomy = Options();
  roomy.demand_poll_ms = 1000;
  Member has_room = Start(roomy);
  ASSERT_NE(has_room.worker, nullptr);
  auto r = Embed("tiny-b", "a cold model");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(StateOf(*has_room.worker, "tiny-b"), ModelState::kLoaded);
  EXPECT_EQ(StateOf(*stays.worker, "tiny-a"), ModelState::kLoaded);
  EXPECT_EQ(stays.Counter("shoal_worker_model_evictions_total", {{"model", "tiny-a"}}), 0);
}

// A model larger than one worker's whole budget but not a peer's: that
// worker leaves the work to the peer, even one slow to claim it (its first
// backlog read comes 5 s after its start, long past this worker's grace
// for peers), instead of answering 429.
TEST_F(FleetTest, WorkForAModelTooLargeHereWaitsForAPeerWhoseBudgetHoldsIt) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions small = Options();
  small.memory_budget_bytes = 1000;
  Member too_small = Start(small);
  ASSERT_NE(too_small.worker, nullptr);
  WorkerOptions roomy = Options();
  roomy.demand_poll_ms = 5000;
  Member holds_it = Start(roomy);
  ASSERT_NE(holds_it.worker, nullptr);
  auto r = EmbedAsync("tiny-a", "fits there", 30000).get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(holds_it.Counter("shoal_worker_model_loads_total", {{"model", "tiny-a"}, {"result", "ok"}}), 1);
  EXPECT_EQ(StateOf(*too_small.worker, "tiny-a"), ModelState::kNotLoaded);
}

// A load can fail for a reason of one worker's own (its memory, its copy of
// the files, a runtime missing on that host). Another worker that has not
// tried the model loads it on demand, and the failed one does not answer
// the work with its error meanwhile.
TEST_F(FleetTest, AModelThatFailedToLoadOnOneWorkerIsLoadedByAnother) {
  TempDir broken_repo;
  MakeFleetRepository(broken_repo.path(), {}, {"flaky"});
  MakeFleetRepository(repo_.path(), {"flaky"});
  WorkerOptions broken_opts = Options();
  broken_opts.model_repository = broken_repo.path();
  broken_opts.heartbeat_interval_ms = 1000;  // a grace of 1.1 s before it answers with its error
  broken_opts.heartbeat_ttl_ms = 4000;
  broken_opts.retry_failed_after_ms = 600000;  // no retry here during the test
  Member broken = Start(broken_opts);
  ASSERT_NE(broken.worker, nullptr);
  // Alone, the worker with the broken copy answers at once with its error.
  auto r = Embed("flaky", "first");
  EXPECT_EQ(r.status().reason(), "model_load_failed") << r.status().ToString();

  WorkerOptions good_opts = Options();
  good_opts.heartbeat_interval_ms = 1000;
  good_opts.heartbeat_ttl_ms = 4000;
  Member good = Start(good_opts);
  ASSERT_NE(good.worker, nullptr);
  // Once the failed worker sees its new peer, the next request is served.
  bool served = false;
  for (int i = 0; i < 20 && !served; ++i) {
    served = Embed("flaky", "try " + std::to_string(i)).ok();
    if (!served) std::this_thread::sleep_for(250ms);
  }
  ASSERT_TRUE(served) << "the model failed on one worker was never loaded by the other";
  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int i = 0; i < 6; ++i) calls.push_back(EmbedAsync("flaky", "served " + std::to_string(i)));
  for (auto& f : calls) {
    auto s = f.get();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
  }
  EXPECT_EQ(good.Counter("shoal_worker_model_loads_total", {{"model", "flaky"}, {"result", "ok"}}), 1);
  // The failed worker did not try again.
  EXPECT_EQ(broken.Counter("shoal_worker_model_loads_total", {{"model", "flaky"}, {"result", "error"}}), 1);
  EXPECT_EQ(StateOf(*broken.worker, "flaky"), ModelState::kFailed);
}

// A peer that has not tried the model but has no room for it (every resident
// model pinned) never claims it: the failed worker answers the waiting work
// with its error after the grace, not at the callers' deadlines.
TEST_F(FleetTest, AFailedModelThatNoPeerHasRoomForStillAnswersItsCallers) {
  TempDir broken_repo;
  MakeFleetRepository(broken_repo.path(), {"pinned"}, {"flaky"});
  MakeFleetRepository(repo_.path(), {"pinned", "flaky"});
  Member broken = Start([&] {
    WorkerOptions wo = Options();
    wo.model_repository = broken_repo.path();
    return wo;
  }());
  WorkerOptions full = Options();
  full.pinned = {"pinned"};
  full.max_models = 1;
  Member good = Start(full);
  ASSERT_NE(broken.worker, nullptr);
  ASSERT_NE(good.worker, nullptr);
  std::this_thread::sleep_for(400ms);  // each has read the other's heartbeat
  ExpectEveryCallerGetsTheLoadError("flaky", 4);
  EXPECT_EQ(broken.Counter("shoal_worker_model_loads_total", {{"model", "flaky"}, {"result", "error"}}), 1);
  EXPECT_EQ(StateOf(*good.worker, "flaky"), ModelState::kNotLoaded);
}

// A model that cannot load anywhere is tried at most once by each worker,
// and its callers get the terminal error, not their deadlines.
TEST_F(FleetTest, AModelBrokenEverywhereGivesItsCallersTheErrorAfterAtMostOneTryPerWorker) {
  MakeFleetRepository(repo_.path(), {}, {"broken"});
  Member w1 = Start(Options());
  Member w2 = Start(Options());
  ASSERT_NE(w1.worker, nullptr);
  ASSERT_NE(w2.worker, nullptr);
  std::this_thread::sleep_for(400ms);  // each has read the other's heartbeat
  ExpectEveryCallerGetsTheLoadError("broken", 8);
  const Labels error = {{"model", "broken"}, {"result", "error"}};
  EXPECT_LE(w1.Counter("shoal_worker_model_loads_total", error), 1);
  EXPECT_LE(w2.Counter("shoal_worker_model_loads_total", error), 1);
  EXPECT_GE(w1.Counter("shoal_worker_model_loads_total", error) + w2.Counter("shoal_worker_model_loads_total", error),
            1);
  EXPECT_TRUE(Eventually([&] { return GetStreamState(*client_, "SHOAL_WORK")->msgs == 0; }));
}

// Once --retry-failed-after-ms has passed, demand tries a failed model again
// (under the placement claim, like any on-demand load) and serves it if the
// cause has gone.
TEST_F(FleetTest, AFailedModelIsRetriedOnDemandOnceItsRetryIsDue) {
  MakeFleetRepository(repo_.path(), {}, {"fixed-later"});
  WorkerOptions wo = Options();
  wo.retry_failed_after_ms = 500;
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  EXPECT_EQ(Embed("fixed-later", "broken").status().reason(), "model_load_failed");
  const fs::path model_pt = fs::path(repo_.path()) / "fixed-later" / "model.pt";
  fs::remove(model_pt);
  fs::create_symlink(fs::path(shoal::testing::ModelsDir()) / "tiny-bert" / "model.pt", model_pt);
  std::this_thread::sleep_for(600ms);
  auto r = Embed("fixed-later", "repaired");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "fixed-later"}, {"result", "error"}}), 1);
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "fixed-later"}, {"result", "ok"}}), 1);
}

// A failed model whose retry has fallen due but finds no room (every
// resident model pinned) still gives its callers the load error at once,
// not a wait for their deadline.
TEST_F(FleetTest, AFailedModelWhoseRetryFindsNoRoomStillAnswersItsCallers) {
  MakeFleetRepository(repo_.path(), {"pinned", "tiny-a"}, {"flaky"});
  WorkerOptions wo = Options();
  wo.pinned = {"pinned"};
  wo.max_models = 2;
  wo.retry_failed_after_ms = 300;
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  EXPECT_EQ(Embed("flaky", "broken").status().reason(), "model_load_failed");
  ASSERT_TRUE(m.worker->manager().Pin("tiny-a").ok());  // no room left for a retry
  std::this_thread::sleep_for(400ms);                    // the retry is due
  const auto t0 = std::chrono::steady_clock::now();
  auto r = EmbedAsync("flaky", "still broken", 20000).get();
  EXPECT_EQ(r.status().reason(), "model_load_failed") << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "the caller waited for its deadline";
  EXPECT_EQ(StateOf(*m.worker, "tiny-a"), ModelState::kLoaded);
}

// An unloaded model's last pull may still be open at the server when new
// work for it arrives: that work must not be delivered to the closed
// subscription (and wait for AckWait), but reach the model once it loads
// again.
TEST_F(FleetTest, WorkArrivingAsAModelIsUnloadedIsServedWithoutWaitingForAckWait) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions wo = Options();
  wo.fetch_poll_ms = 5000;  // the last pull stays open this long at the server
  wo.consumer.ack_wait_ms = 30000;
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  ASSERT_TRUE(Embed("tiny-a", "load it").ok());
  for (int i = 0; i < 5; ++i) {
    // The last answer may have come from the instance being unloaded while
    // its message, not yet acked, started another load on demand: unload
    // once that load is done.
    ASSERT_TRUE(Eventually([&] { return m.worker->manager().Unload("tiny-a").ok(); })) << "round " << i;
    auto r = EmbedAsync("tiny-a", "again " + std::to_string(i), 10000).get();
    ASSERT_TRUE(r.ok()) << "round " << i << ": " << r.status().ToString();
  }
  EXPECT_GE(m.Counter("shoal_worker_model_loads_total", {{"model", "tiny-a"}, {"result", "ok"}}), 6);
}

TEST_F(FleetTest, WorkAModelHoldsAsItIsUnloadedIsServedByTheNextLoad) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions wo = Options();
  // What the model holds when it stops, pulled or only sent to its
  // subscription, goes back to the queue. Lost, it would come back only
  // after AckWait, past every deadline here (with the subscription simply
  // closed, 18-108 of these 600 calls were). Hand-backs wait out the
  // longest pull of the closed subscription.
  wo.fetch_poll_ms = 2000;
  wo.consumer.ack_wait_ms = 30000;
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  ASSERT_TRUE(Embed("tiny-a", "load it").ok());
  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 150; ++i)
      calls.push_back(EmbedAsync("tiny-a", "round " + std::to_string(round) + " call " + std::to_string(i), 20000));
    // Unloaded while it pulls and runs them: what it holds goes back.
    for (int i = 0; i < 200 && StateOf(*m.worker, "tiny-a") != ModelState::kLoaded; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(5 * round));
    (void)m.worker->manager().Unload("tiny-a");
  }
  int failed = 0;
  std::string first;
  for (auto& c : calls) {
    auto r = c.get();
    if (!r.ok() && failed++ == 0) first = r.status().ToString();
  }
  EXPECT_EQ(failed, 0) << "first: " << first;  // none lost until AckWait
  // The rounds did hand work back (else this test proves nothing), and it
  // came back.
  EXPECT_GT(m.Counter("shoal_worker_handed_back_total", {{"model", "tiny-a"}}), 0);
  EXPECT_GT(m.Counter("shoal_worker_redelivered_total", {{"model", "tiny-a"}}), 0);
}

TEST_F(FleetTest, ControlLoadsUnloadsPinsAndUnpins) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  auto ask = [&](const std::string& action) -> Result<json> {
    json req = {{"action", action}, {"model", "tiny-a"}};
    ASSIGN_OR_RETURN(std::string reply, client_->Request(wire::ControlSubject(m.worker->id()), req.dump(), 30000));
    return json::parse(reply);
  };
  auto r = ask("load");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE((*r)["ok"].get<bool>());
  EXPECT_EQ((*r)["status"]["state"], "loaded");
  EXPECT_GT((*r)["status"]["memory_bytes"].get<int64_t>(), 0);
  r = ask("pin");
  EXPECT_TRUE((*r)["status"]["pinned"].get<bool>());
  r = ask("unload");
  EXPECT_FALSE((*r)["ok"].get<bool>());
  EXPECT_EQ((*r)["error"]["code"], "model_pinned");
  r = ask("unpin");
  EXPECT_FALSE((*r)["status"]["pinned"].get<bool>());
  r = ask("unload");
  EXPECT_TRUE((*r)["ok"].get<bool>());
  EXPECT_EQ((*r)["status"]["state"], "not_loaded");
  r = ask("explode");
  EXPECT_EQ((*r)["error"]["code"], "invalid_action");
  json bad = json::parse(*client_->Request(wire::ControlSubject(m.worker->id()), "not json", 5000));
  EXPECT_EQ(bad["error"]["code"], "invalid_json");
  // The parser's message quotes the byte that is not UTF-8; the reply still goes out.
  json raw = json::parse(*client_->Request(wire::ControlSubject(m.worker->id()), "\xff", 5000));
  EXPECT_EQ(raw["error"]["code"], "invalid_json");
  EXPECT_EQ((*ask("explode"))["error"]["code"], "invalid_action") << "the worker still answers";
}

TEST_F(FleetTest, HeartbeatReportsEveryCatalogModelWithStateAndMemory) {
  MakeFleetRepository(repo_.path(), {"tiny-a", "tiny-b"});
  WorkerOptions wo = Options();
  wo.preload = {"tiny-a"};
  wo.memory_budget_bytes = int64_t{1} << 34;
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  auto kv = KvBucket::Open(*client_, wire::kWorkersBucket, 1500);
  ASSERT_TRUE(kv.ok());
  json hb = json::parse(*(*kv)->Get(m.worker->id()));
  EXPECT_EQ(hb["memory_budget_bytes"].get<int64_t>(), int64_t{1} << 34);
  EXPECT_GT(hb["memory_used_bytes"].get<int64_t>(), 0);
  std::map<std::string, json> models;
  for (const json& x : hb["models"]) models[x["name"]] = x;
  ASSERT_EQ(models.size(), 2u);
  EXPECT_EQ(models["tiny-a"]["state"], "loaded");
  EXPECT_EQ(models["tiny-a"]["memory_bytes"].get<int64_t>(), hb["memory_used_bytes"].get<int64_t>());
  EXPECT_EQ(models["tiny-b"]["state"], "not_loaded");
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

// Takes `kMs` milliseconds more over each batch.
template <int kMs>
class SlowRunRuntime final : public shoal::testing::ForwardingRuntime {
 public:
  using ForwardingRuntime::ForwardingRuntime;
  Result<Embeddings> Run(const TokenBatch& b) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(kMs));
    return inner().Run(b);
  }
};
using SlowRuntime = SlowRunRuntime<5>;
using SecondPerBatchRuntime = SlowRunRuntime<1000>;

// Records the nice value of the thread that loads it and of the threads
// that run its batches.
class NiceProbeRuntime final : public shoal::testing::ForwardingRuntime {
 public:
  NiceProbeRuntime(std::unique_ptr<Runtime> inner, std::atomic<int>* load_nice, std::atomic<int>* run_nice)
      : ForwardingRuntime(std::move(inner)), load_nice_(load_nice), run_nice_(run_nice) {}
  Status Load(const ModelConfig& c) override {
    *load_nice_ = ThreadNice();
    return inner().Load(c);
  }
  Result<Embeddings> Run(const TokenBatch& b) override {
    *run_nice_ = ThreadNice();
    return inner().Run(b);
  }
  static int ThreadNice() {
    errno = 0;
    return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  }

 private:
  std::atomic<int>* load_nice_;
  std::atomic<int>* run_nice_;
};

// Takes 1.5 s over each load.
class SlowLoadRuntime final : public shoal::testing::ForwardingRuntime {
 public:
  using ForwardingRuntime::ForwardingRuntime;
  Status Load(const ModelConfig& c) override {
    std::this_thread::sleep_for(1500ms);
    return inner().Load(c);
  }
};

// A worker still starting shows the models it preloads as loading, and
// keeps its entry alive through a start longer than the heartbeat TTL
// (1.5 s here; the load takes 3 s): a peer with work for such a model
// leaves it to the starting worker instead of loading it too.
TEST_F(FleetTest, APeerLeavesAModelToAWorkerThatPreloadsItAsItStarts) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  Member peer = Start(Options());
  ASSERT_NE(peer.worker, nullptr);
  WorkerOptions slow = Options();
  slow.preload = {"tiny-a"};
  slow.worker_id = "slow-starter";
  slow.runtime_factory = [](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
    ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
    std::unique_ptr<Runtime> once(new SlowLoadRuntime(std::move(inner)));
    return std::unique_ptr<Runtime>(new SlowLoadRuntime(std::move(once)));
  };
  auto kv = KvBucket::Open(*client_, wire::kWorkersBucket, 30000);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();  // before the thread: an ASSERT must not leave it running
  const auto state = [&]() -> std::string {
    auto hb = (*kv)->Get("slow-starter");
    if (!hb.ok()) return "";  // none, or expired
    const json doc = json::parse(*hb);
    for (const json& x : doc["models"])
      if (x["name"] == "tiny-a") return x["state"].get<std::string>();
    return "no tiny-a";
  };
  Member starting;
  std::thread starter([&] { starting = Start(slow); });
  const bool shown = Eventually([&] { return state() == "loading"; }, 2500ms);
  auto r = EmbedAsync("tiny-a", "for the starting worker", 30000);
  // Past the TTL since the first entry: still there (loading, or loaded if
  // the start has ended).
  std::this_thread::sleep_for(2s);
  const std::string later = state();
  starter.join();
  ASSERT_NE(starting.worker, nullptr);
  EXPECT_TRUE(shown) << "the starting worker's entry never showed its preload";
  EXPECT_TRUE(later == "loading" || later == "loaded") << "the starting entry expired during the start: " << later;
  auto got = r.get();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(peer.Counter("shoal_worker_model_loads_total", {{"model", "tiny-a"}, {"result", "ok"}}), 0);
  EXPECT_EQ(StateOf(*starting.worker, "tiny-a"), ModelState::kLoaded);
}

// An operator's load shows as "loading" in the registry while it runs,
// not one heartbeat after it ends (heartbeats are 10 s apart here): other
// workers' demand loops read the registry to leave a model being loaded
// to the worker loading it.
TEST_F(FleetTest, AnOperatorLoadShowsAsLoadingWhileItRuns) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions wo = Options();
  wo.heartbeat_interval_ms = 10000;
  wo.heartbeat_ttl_ms = 30000;
  wo.runtime_factory = [](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
    ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
    return std::unique_ptr<Runtime>(new SlowLoadRuntime(std::move(inner)));
  };
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  auto kv = KvBucket::Open(*client_, wire::kWorkersBucket, 30000);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  auto state = [&]() -> std::string {
    auto hb = (*kv)->Get(m.worker->id());
    if (!hb.ok()) return "";
    const json doc = json::parse(*hb);
    for (const json& x : doc["models"])
      if (x["name"] == "tiny-a") return x["state"].get<std::string>();
    return "";
  };
  ASSERT_EQ(state(), "not_loaded");
  auto load = std::async(std::launch::async, [&] { return m.worker->Control("load", "tiny-a"); });
  EXPECT_TRUE(Eventually([&] { return state() == "loading"; }, 1200ms)) << state();
  auto r = load.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(state(), "loaded");
}

// An operator's load of a model whose load fails is tried once: the load
// it starts is the one it waits for, even when that fails before the wait
// begins (a missing file fails at once).
TEST_F(FleetTest, AnOperatorLoadThatFailsIsTriedOnce) {
  MakeFleetRepository(repo_.path(), {}, {"broken"});
  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  auto r = m.worker->Control("load", "broken");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().reason(), "model_load_failed") << r.status().ToString();
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "broken"}, {"result", "error"}}), 1);
  // Asked again, it is tried again at once.
  r = m.worker->Control("load", "broken");
  EXPECT_EQ(r.status().reason(), "model_load_failed");
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "broken"}, {"result", "error"}}), 2);
}

// An action whose caller stopped waiting before the worker got to it (it
// queued behind another) is not done; one whose load outlasts its deadline
// answers then, and the load goes on.
TEST_F(FleetTest, AnOperatorActionPastItsDeadlineIsNotDoneAndALoadIsNotWaitedForPastIt) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions wo = Options();
  wo.runtime_factory = [](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
    ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
    return std::unique_ptr<Runtime>(new SlowLoadRuntime(std::move(inner)));
  };
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  const int64_t now = SystemClock::Get()->NowUnixMs();
  auto r = m.worker->Control("load", "tiny-a", now - 1);
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  EXPECT_EQ(StateOf(*m.worker, "tiny-a"), ModelState::kNotLoaded);
  EXPECT_EQ(m.Counter("shoal_worker_model_loads_total", {{"model", "tiny-a"}, {"result", "ok"}}), 0);
  // The load takes longer than the 100 ms this caller waits.
  r = m.worker->Control("load", "tiny-a", SystemClock::Get()->NowUnixMs() + 100);
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  EXPECT_TRUE(Eventually([&] { return StateOf(*m.worker, "tiny-a") == ModelState::kLoaded; }));
}

TEST_F(FleetTest, LoadsRunAtTheLoadNiceValueServingDoesNot) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  const int base = NiceProbeRuntime::ThreadNice();
  std::atomic<int> load_nice{-100}, run_nice{-100};
  WorkerOptions wo = Options();
  wo.load_nice = 7;
  wo.runtime_factory = [&](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
    ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
    return std::unique_ptr<Runtime>(new NiceProbeRuntime(std::move(inner), &load_nice, &run_nice));
  };
  Member w = Start(wo);
  ASSERT_NE(w.worker, nullptr);
  ASSERT_TRUE(Embed("tiny-a", "lazy load").ok());
  // An unprivileged process can only raise its nice value.
  EXPECT_EQ(load_nice.load(), std::max(base, 7));
  EXPECT_EQ(run_nice.load(), base);
  w.worker.reset();  // stops it; the next worker loads tiny-a on demand

  // Other runtimes load at serving's priority: what their load starts (a
  // runtime process, its supervisor thread) goes on serving.
  load_nice = -100;
  wo.runtime_override = "null";
  Member other = Start(wo);
  ASSERT_NE(other.worker, nullptr);
  ASSERT_TRUE(Embed("tiny-a", "lazy load, null runtime").ok());
  EXPECT_EQ(load_nice.load(), base);

  WorkerOptions bad = Options();
  bad.load_nice = 20;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
  bad.load_nice = 0;
  bad.eviction = "mru";
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
}

// Records the thread count each pass was given; `hold_ms` (when set) makes
// the next pass wait that long, after saying it runs.
class WidthProbeRuntime final : public shoal::testing::ForwardingRuntime {
 public:
  struct Seen {
    std::atomic<int> batch_threads{-1};  // TokenBatch::threads of the last pass
    std::atomic<bool> running{false};
    std::atomic<int> hold_ms{0};
  };
  WidthProbeRuntime(std::unique_ptr<Runtime> inner, Seen* seen) : ForwardingRuntime(std::move(inner)), seen_(seen) {}
  Result<Embeddings> Run(const TokenBatch& b) override {
    seen_->batch_threads = b.threads;
    seen_->running = true;
    if (const int ms = seen_->hold_ms.exchange(0); ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return inner().Run(b);
  }

 private:
  Seen* seen_;
};

TEST_F(FleetTest, AutoSlotsGiveALoneModelEveryCoreAndCompetingModelsOneEach) {
  MakeFleetRepository(repo_.path(), {"tiny-a", "tiny-b"});
  const int cores = UsableCpus();
  std::map<std::string, WidthProbeRuntime::Seen> seen;
  seen["tiny-a"];
  seen["tiny-b"];
  WorkerOptions wo = Options();
  wo.intra_op_threads = 0;  // the models' own: 0, every core
  wo.preload = {"all"};
  ASSERT_EQ(wo.device_slots, 0);  // the default: auto
  wo.runtime_factory = [&](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
    ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
    return std::unique_ptr<Runtime>(new WidthProbeRuntime(std::move(inner), &seen.at(c.name)));
  };
  Member w = Start(wo);
  ASSERT_NE(w.worker, nullptr);
  ASSERT_TRUE(Eventually([&] { return w.worker->LoadedModels().size() == 2; }));

  // Alone on the device: every core.
  ASSERT_TRUE(Embed("tiny-a", "alone").ok());
  EXPECT_EQ(seen["tiny-a"].batch_threads.load(), cores);

  // tiny-b's work arrives while tiny-a's pass holds the device: it waits,
  // and once it runs, it runs on one core.
  seen["tiny-a"].running = false;
  seen["tiny-a"].hold_ms = 1000;
  auto a = EmbedAsync("tiny-a", "holds the device");
  ASSERT_TRUE(Eventually([&] { return seen["tiny-a"].running.load(); }));
  auto b = EmbedAsync("tiny-b", "arrives while it runs");
  ASSERT_TRUE(a.get().ok());
  ASSERT_TRUE(b.get().ok());
  EXPECT_EQ(seen["tiny-b"].batch_threads.load(), 1);

  // Alone again: every core.
  ASSERT_TRUE(Embed("tiny-b", "alone again").ok());
  EXPECT_EQ(seen["tiny-b"].batch_threads.load(), cores);
  w.worker.reset();

  // An explicit slot count: one slot a pass, on the model's own threads.
  wo.device_slots = 1;
  Member fixed = Start(wo);
  ASSERT_NE(fixed.worker, nullptr);
  ASSERT_TRUE(Embed("tiny-a", "fixed slots").ok());
  EXPECT_EQ(seen["tiny-a"].batch_threads.load(), 0);

  WorkerOptions bad = Options();
  bad.device_slots = -1;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
}

// Logs every pass as "model:rows" in one shared order; the pass after
// `hold` is set waits until it is cleared, after saying it runs, and every
// pass of `slow_model` takes at least `slow_ms`.
class PassLogRuntime final : public shoal::testing::ForwardingRuntime {
 public:
  struct Log {
    std::mutex mu;
    std::vector<std::string> passes;
    std::atomic<bool> hold{false};
    std::atomic<bool> holding{false};
    std::string slow_model;  // set before any pass of it
    int slow_ms = 0;
  };
  PassLogRuntime(std::unique_ptr<Runtime> inner, std::string name, Log* log)
      : ForwardingRuntime(std::move(inner)), name_(std::move(name)), log_(log) {}
  Result<Embeddings> Run(const TokenBatch& b) override {
    {
      std::lock_guard<std::mutex> lock(log_->mu);
      log_->passes.push_back(name_ + ":" + std::to_string(b.rows));
    }
    if (log_->hold.load()) {
      log_->holding = true;
      while (log_->hold.load()) std::this_thread::sleep_for(1ms);
      log_->holding = false;
    }
    if (name_ == log_->slow_model) std::this_thread::sleep_for(std::chrono::milliseconds(log_->slow_ms));
    return inner().Run(b);
  }

 private:
  const std::string name_;
  Log* log_;
};

// While tiny-a's pass holds the only slot, tiny-b, eight requests for
// tiny-a and then tiny-c arrive. tiny-b is oldest and goes next (its pass
// takes 500 ms, so tiny-a's executor is back in the scheduler before it
// ends); tiny-a's work is older than tiny-c's and goes after it. With a
// turn quantum of 1 ms, tiny-a's batch is cut to one message because tiny-c
// waits (tiny-a's measured cost, the held pass included, puts eight far
// over the quantum), so tiny-c runs before the rest of tiny-a's work;
// without one, tiny-a runs all eight first.
TEST_F(FleetTest, TurnQuantumCutsABacklogShortWhileAnotherModelWaits) {
  MakeFleetRepository(repo_.path(), {"tiny-a", "tiny-b", "tiny-c"});
  auto run = [&](int64_t quantum_ms, int64_t* shortened) {
    PassLogRuntime::Log log;
    log.slow_model = "tiny-b";
    log.slow_ms = 500;
    WorkerOptions wo = Options();
    wo.preload = {"all"};
    wo.device_slots = 1;
    wo.turn_quantum_ms = quantum_ms;
    wo.runtime_factory = [&log](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
      ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
      return std::unique_ptr<Runtime>(new PassLogRuntime(std::move(inner), c.name, &log));
    };
    Member w = Start(wo);
    EXPECT_NE(w.worker, nullptr);
    if (w.worker == nullptr) return std::vector<std::string>{};
    EXPECT_TRUE(Eventually([&] { return w.worker->LoadedModels().size() == 3; }));
    EXPECT_TRUE(Embed("tiny-a", "measures the cost of a pass").ok());
    auto pulled = [&](const std::string& m) {
      return w.Observed("shoal_worker_queue_wait_seconds", {{"model", m}});
    };

    log.hold = true;
    auto first = EmbedAsync("tiny-a", "holds the device");
    EXPECT_TRUE(Eventually([&] { return log.holding.load(); }));
    std::vector<std::future<Result<EmbedResult>>> calls;
    calls.push_back(EmbedAsync("tiny-b", "oldest waiting work"));
    EXPECT_TRUE(Eventually([&] { return pulled("tiny-b") == 1; }));
    for (int i = 0; i < 8; ++i) calls.push_back(EmbedAsync("tiny-a", "backlog " + std::to_string(i)));
    EXPECT_TRUE(Eventually([&] { return pulled("tiny-a") == 10; }));
    calls.push_back(EmbedAsync("tiny-c", "arrives last"));
    EXPECT_TRUE(Eventually([&] { return pulled("tiny-c") == 1; }));
    std::this_thread::sleep_for(300ms);  // tiny-b and tiny-c reach the scheduler
    {
      std::lock_guard<std::mutex> lock(log.mu);
      log.passes.clear();
    }
    log.hold = false;
    EXPECT_TRUE(first.get().ok());
    for (auto& f : calls) EXPECT_TRUE(f.get().ok());
    *shortened = w.Counter("shoal_worker_batches_shortened_total", {{"model", "tiny-a"}});
    std::lock_guard<std::mutex> lock(log.mu);
    return log.passes;
  };

  int64_t shortened = 0;
  const std::vector<std::string> with_quantum = run(1, &shortened);
  EXPECT_EQ(with_quantum, (std::vector<std::string>{"tiny-b:1", "tiny-a:1", "tiny-c:1", "tiny-a:7"}));
  EXPECT_EQ(shortened, 1);

  const std::vector<std::string> without = run(0, &shortened);
  EXPECT_EQ(without, (std::vector<std::string>{"tiny-b:1", "tiny-a:8", "tiny-c:1"}));
  EXPECT_EQ(shortened, 0);

  WorkerOptions bad = Options();
  bad.turn_quantum_ms = -1;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
  bad.turn_quantum_ms = 3600001;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
}

TEST_F(FleetTest, ABacklogOverTheThresholdAddsASecondReplica) {
  // The first replica takes at least 5 ms a batch (of 4), so the flood below
  // outlasts several of the second worker's backlog polls on any machine.
  auto [w1, w2] = StartReplicaPair<SlowRuntime>(4);
  ASSERT_NE(w1.worker, nullptr);
  ASSERT_NE(w2.worker, nullptr);
  ASSERT_EQ(w1.worker->LoadedModels().size(), 1u);
  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int i = 0; i < 400; ++i) calls.push_back(EmbedAsync("tiny-a", "flood " + std::to_string(i)));
  for (auto& f : calls) EXPECT_TRUE(f.get().ok());
  EXPECT_EQ(w2.worker->LoadedModels(), std::vector<std::string>{"tiny-a"}) << "no second replica";
  EXPECT_EQ(w2.Counter("shoal_worker_placement_claims_total", {{"result", "won"}}), 1);
}

// Messages the serving replica already holds (running, or waiting in its
// batcher) are not backlog: with next to nothing left undelivered, another
// worker loads no second replica, however many the stream still counts.
TEST_F(FleetTest, WorkAReplicaAlreadyHoldsAsksForNoOtherReplica) {
  auto [w1, w2] = StartReplicaPair<SecondPerBatchRuntime>(64);
  ASSERT_NE(w1.worker, nullptr);
  ASSERT_NE(w2.worker, nullptr);
  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int i = 0; i < 40; ++i) calls.push_back(EmbedAsync("tiny-a", "held " + std::to_string(i)));
  for (auto& f : calls) EXPECT_TRUE(f.get().ok());
  EXPECT_TRUE(w2.worker->LoadedModels().empty()) << "a second replica for work the first already held";
  EXPECT_EQ(w2.Counter("shoal_worker_placement_claims_total", {{"result", "won"}}), 0);
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

// Writes a copy of the demo socket-runtime model (tiny-bert-py, its files
// linked) named `name` into `repo`, its config changed by `adjust` first.
void WritePythonRuntimeModel(const std::string& repo, const std::string& name,
                             const std::function<void(json&)>& adjust) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(shoal::testing::ModelsDir()) / "tiny-bert-py";
  const fs::path dir = fs::path(repo) / name;
  fs::create_directories(dir);
  for (const char* f : {"weights.pt", "model.py", "vocab.txt", "shoal_runtime.py"})
    if (fs::exists(src / f)) fs::create_symlink(src / f, dir / f);
  std::ifstream in(src / "shoal.json");
  json config = json::parse(in);
  config["name"] = name;
  adjust(config);
  std::ofstream(dir / "shoal.json") << config.dump(2);
}

// The command of a misbehaving runtime (tests/data/runtimes/bad_runtime.py).
json BadRuntimeCommand(const char* mode) {
  return {"/usr/bin/python3", shoal::testing::SourceDir() + "/tests/data/runtimes/bad_runtime.py", "--mode", mode};
}

// An out-of-process runtime that dies in the middle of a batch: the batch
// goes back to the queue, the runtime is restarted, and every caller gets
// exactly one (correct) answer.
TEST_F(FleetTest, ABatchInFlightWhenTheRuntimeDiesIsRedelivered) {
  namespace fs = std::filesystem;
  const std::string marker = repo_.path() + "/crashed";
  WritePythonRuntimeModel(repo_.path(), "crashy", [&](json& config) {
    config["process"]["command"] = BadRuntimeCommand("crash-once");
    config["process"]["env"]["CRASH_MARKER"] = marker;
    config["process"]["health_interval_ms"] = 100;
  });
  MakeFleetRepository(repo_.path(), {"tiny-a"});  // the same weights on TorchScript, for comparison

  WorkerOptions wo = Options();
  wo.preload = {"all"};
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int i = 0; i < 8; ++i) calls.push_back(EmbedAsync("crashy", "sentence " + std::to_string(i)));
  for (int i = 0; i < 8; ++i) {
    auto r = calls[i].get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto same = Embed("tiny-a", "sentence " + std::to_string(i));
    ASSERT_TRUE(same.ok());
    for (int k = 0; k < r->dim; ++k) EXPECT_NEAR(r->data[k], same->data[k], 1e-4);
  }
  EXPECT_TRUE(fs::exists(marker)) << "the runtime never crashed; nothing was tested";
  EXPECT_GE(m.Counter("shoal_worker_runtime_unavailable_total", {{"model", "crashy"}}), 1);
  EXPECT_GE(m.Counter("shoal_worker_handed_back_total", {{"model", "crashy"}}), 1);
  EXPECT_GE(m.Counter("shoal_worker_redelivered_total", {{"model", "crashy"}}), 1);
}

// A load that fails slowly on one worker (a socket runtime that never
// listens, so its start times out) leaves a peer that has not tried the
// model its grace from the failure, not from the oldest waiting message,
// which the slow load used up: the peer loads the model and the caller is
// served, not answered with the first worker's error.
TEST_F(FleetTest, AModelThatFailedSlowlyOnOneWorkerIsStillLoadedByAnother) {
  TempDir slow_repo;
  WritePythonRuntimeModel(slow_repo.path(), "slowfail", [](json& config) {
    config["process"]["command"] = BadRuntimeCommand("silent");
    config["process"]["start_timeout_ms"] = 2500;
  });
  MakeFleetRepository(repo_.path(), {"slowfail"});  // a good copy (TorchScript) for the other worker

  WorkerOptions slow_opts = Options();
  slow_opts.model_repository = slow_repo.path();
  slow_opts.heartbeat_interval_ms = 2000;  // a grace of 2.1 s for the good worker to claim it
  slow_opts.heartbeat_ttl_ms = 8000;
  slow_opts.retry_failed_after_ms = 600000;
  Member slow = Start(slow_opts);
  ASSERT_NE(slow.worker, nullptr);
  auto pending = EmbedAsync("slowfail", "wait for me", 30000);
  ASSERT_TRUE(Eventually([&] { return StateOf(*slow.worker, "slowfail") == ModelState::kLoading; }));
  WorkerOptions good_opts = Options();
  good_opts.heartbeat_interval_ms = 1000;
  good_opts.heartbeat_ttl_ms = 4000;
  Member good = Start(good_opts);
  ASSERT_NE(good.worker, nullptr);
  auto r = pending.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(slow.Counter("shoal_worker_model_loads_total", {{"model", "slowfail"}, {"result", "error"}}), 1);
  EXPECT_EQ(good.Counter("shoal_worker_model_loads_total", {{"model", "slowfail"}, {"result", "ok"}}), 1);
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

// A socket runtime that started once and then cannot start again is not
// restarted forever while callers wait for their deadline: the runtime
// gives up after process.max_failed_starts, the worker marks the model
// failed, and callers get model_load_failed (502).
TEST_F(FleetTest, ARuntimeThatWillNotRestartFailsTheModelAndItsCallers) {
  namespace fs = std::filesystem;
  const std::string pid_file = repo_.path() + "/runtime.pid", mark = repo_.path() + "/started";
  const std::string script = repo_.path() + "/once.sh";
  // Starts the real runtime the first time only, and records its pid.
  std::ofstream(script) << "#!/bin/sh\nif [ -e \"$SHOAL_TEST_MARK\" ]; then exit 3; fi\n"
                           "touch \"$SHOAL_TEST_MARK\"\necho $$ > \"$SHOAL_TEST_PID\"\nexec \"$@\"\n";
  WritePythonRuntimeModel(repo_.path(), "once", [&](json& config) {
    json command = json::array({"/bin/sh", script});
    for (const auto& part : config["process"]["command"]) command.push_back(part);
    config["process"]["command"] = command;
    config["process"]["env"]["SHOAL_TEST_MARK"] = mark;
    config["process"]["env"]["SHOAL_TEST_PID"] = pid_file;
    config["process"]["health_interval_ms"] = 100;
    config["process"]["max_restart_backoff_ms"] = 200;
    config["process"]["max_failed_starts"] = 2;
  });

  Member m = Start(Options());
  ASSERT_NE(m.worker, nullptr);
  auto first = Embed("once", "served");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  pid_t pid = 0;
  std::ifstream(pid_file) >> pid;
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] { return StateOf(*m.worker, "once") == ModelState::kFailed; }))
      << "the model stayed " << static_cast<int>(StateOf(*m.worker, "once"));
  for (int i = 0; i < 3; ++i) {
    auto r = Embed("once", "after " + std::to_string(i));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kBadGateway) << r.status().ToString();
    EXPECT_EQ(r.status().reason(), "model_load_failed") << r.status().ToString();
  }
  EXPECT_FALSE(m.worker->manager().IsLoaded("once"));
}

// A device that fails, as a CUDA device-side assert leaves a GPU for the
// rest of the process: in the first pass (kInPass), or while the model
// loads (kInLoad); every later pass fails with device_fault too.
class FailingDeviceRuntime final : public shoal::testing::ForwardingRuntime {
 public:
  enum When { kInPass, kInLoad };
  FailingDeviceRuntime(std::unique_ptr<Runtime> inner, When when, std::shared_ptr<std::atomic<bool>> failed)
      : ForwardingRuntime(std::move(inner)), when_(when), failed_(std::move(failed)) {}
  Status Load(const ModelConfig& c) override {
    if (when_ != kInLoad) return ForwardingRuntime::Load(c);
    *failed_ = true;
    return Fault();
  }
  Result<Embeddings> Run(const TokenBatch&) override {
    *failed_ = true;
    return Fault();
  }
  bool Available() const override { return !*failed_; }
  Status DeviceHealth() const override { return *failed_ ? Fault() : Status::Ok(); }

 private:
  static Status Fault() {
    return Unavailable("device cuda:0 failed: CUDA error: device-side assert triggered", "device_fault");
  }
  When when_;
  std::shared_ptr<std::atomic<bool>> failed_;
};

// A worker whose device fails loses no work and gives its callers no error:
// the work goes back to the queue (or stays there), the worker leaves the
// registry at once (not when its heartbeat expires, a minute here) and for
// good, and asks to be restarted once; a healthy worker started afterwards
// takes the model on demand and answers every caller.
void ExpectAFailedDeviceHandsItsWorkOn(FleetTest* test, FailingDeviceRuntime::When when) {
  MakeFleetRepository(test->repo_.path(), {"tiny-a"});
  auto failed = std::make_shared<std::atomic<bool>>(false);
  auto fault = std::make_shared<std::promise<Status>>();
  auto fault_seen = fault->get_future();
  auto fault_calls = std::make_shared<std::atomic<int>>(0);
  WorkerOptions broken = test->Options();
  broken.preload = when == FailingDeviceRuntime::kInPass ? std::vector<std::string>{"all"} : std::vector<std::string>{};
  broken.heartbeat_ttl_ms = 60000;
  broken.runtime_factory = [failed, when](const ModelConfig& c) -> Result<std::unique_ptr<Runtime>> {
    ASSIGN_OR_RETURN(auto inner, CreateRuntime(c.runtime));
    return std::unique_ptr<Runtime>(std::make_unique<FailingDeviceRuntime>(std::move(inner), when, failed));
  };
  broken.on_device_fault = [fault, fault_calls](const Status& s) {
    if (fault_calls->fetch_add(1) == 0) fault->set_value(s);
  };
  FleetTest::Member a = test->Start(broken);
  ASSERT_NE(a.worker, nullptr);

  std::vector<std::future<Result<EmbedResult>>> calls;
  for (int i = 0; i < 6; ++i) calls.push_back(test->EmbedAsync("tiny-a", "sentence " + std::to_string(i)));
  ASSERT_EQ(fault_seen.wait_for(10s), std::future_status::ready) << "the worker never reported its device";
  const Status reported = fault_seen.get();
  EXPECT_EQ(reported.reason(), "device_fault") << reported.ToString();
  auto kv = KvBucket::Bind(*test->client_, wire::kWorkersBucket);
  ASSERT_TRUE(kv.ok());
  EXPECT_FALSE((*kv)->Get(a.worker->id()).ok()) << "the failed worker is still in the registry";
  // The device's failure is not the model's.
  EXPECT_NE(FleetTest::StateOf(*a.worker, "tiny-a"), ModelState::kFailed);

  FleetTest::Member b = test->Start(test->Options());
  ASSERT_NE(b.worker, nullptr);
  for (auto& call : calls) {
    ASSERT_EQ(call.wait_for(25s), std::future_status::ready) << "a caller waited for its deadline";
    auto r = call.get();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_TRUE(b.worker->manager().IsLoaded("tiny-a"));
  EXPECT_FALSE((*kv)->Get(a.worker->id()).ok()) << "the failed worker came back to the registry";
  EXPECT_EQ(a.Counter("shoal_worker_device_faults_total", {}), 1);
  if (when == FailingDeviceRuntime::kInPass) {
    EXPECT_GE(a.Counter("shoal_worker_handed_back_total", {{"model", "tiny-a"}}), 1);
  }
  a.worker->Stop();
  EXPECT_EQ(fault_calls->load(), 1);
}

TEST_F(FleetTest, AWorkerWhoseDeviceFailsInAPassHandsItsWorkOnAndAsksToBeRestarted) {
  ExpectAFailedDeviceHandsItsWorkOn(this, FailingDeviceRuntime::kInPass);
}

// With nothing loaded, the fault shows only in the load's result.
TEST_F(FleetTest, AWorkerWhoseDeviceFailsInALoadLeavesTheWorkToAnother) {
  ExpectAFailedDeviceHandsItsWorkOn(this, FailingDeviceRuntime::kInLoad);
}

// The simulated accelerator behind a real worker: the same queue path, no
// model compute.
TEST_F(FleetTest, SimRuntimeServesThroughTheQueue) {
  MakeFleetRepository(repo_.path(), {"tiny-a"});
  WorkerOptions wo = Options();
  wo.runtime_override = "sim";
  Member m = Start(wo);
  ASSERT_NE(m.worker, nullptr);
  auto a = Embed("tiny-a", "simulated");
  auto b = Embed("tiny-a", "simulated");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->dim, 64);
  EXPECT_EQ(a->data, b->data);
  double norm = 0;
  for (float v : a->data) norm += static_cast<double>(v) * v;
  EXPECT_NEAR(norm, 1.0, 1e-5);
}

}  // namespace
}  // namespace shoal
