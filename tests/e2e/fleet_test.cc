// End to end, a fleet of models across `shoal worker` processes behind a
// `shoal gateway`, on a test nats-server -js: a killed worker's model is
// picked up on demand by another and no request is lost; the registry
// forgets a dead worker when its heartbeats expire; operators load, pin,
// unpin and unload through HTTP and `shoal models`; a gateway configured
// not to wait answers 503 with Retry-After while the model loads.
#include <signal.h>

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "e2e/http_client.h"
#include "e2e/process.h"
#include "e2e/shoal_cluster.h"
#include "support/test_env.h"

namespace shoal::e2e {
namespace {

using nlohmann::json;
using shoal::testing::Eventually;
using namespace std::chrono_literals;

// Fast registry and redelivery, so failures show within seconds.
// Nothing is loaded at start unless `preload` says so.
std::vector<std::string> FastWorker(const std::string& preload = "none") {
  return {"--threads",        "1",    "--preload",         preload, "--heartbeat-ms",   "300",
          "--heartbeat-ttl-ms", "1500", "--ack-wait-ms",   "2000",  "--demand-poll-ms", "100"};
}

// The gateway's view of one model: worker id -> state; empty while the
// gateway does not know the model (it has not read a catalog with it yet),
// which the callers' own expectations then catch.
std::map<std::string, std::string> WhereIs(int port, const std::string& model) {
  std::map<std::string, std::string> out;
  auto r = HttpGet(port, "/v1/models/" + model);
  if (r.status != 200) return out;
  const json body = json::parse(r.body);
  for (const json& w : body.at("workers")) out[w.at("worker").get<std::string>()] = w.at("state").get<std::string>();
  return out;
}

std::string WorkerId(const Shoal& s) {
  auto m = s.process->WaitForLine(R"(shoal worker (\S+) ready)", 1s);
  return m ? (*m)[1] : "";
}


HttpResult Embed(int port, const std::string& model, const std::string& text, int64_t timeout_ms = 60000) {
  json req = {{"model", model}, {"input", text}};
  return HttpPostJson(port, "/v1/embeddings", req.dump(), {{"Shoal-Timeout-Ms", std::to_string(timeout_ms)}},
                      std::chrono::milliseconds(timeout_ms + 10000));
}

class E2eFleet : public ::testing::Test {
 protected:
  void SetUp() override { shoal::testing::MakeFleetRepository(repo_.path(), {"tiny-a", "tiny-b"}); }
  shoal::testing::TestNatsServer nats_;
  shoal::testing::TempDir repo_;
};

TEST_F(E2eFleet, KilledWorkersModelIsPickedUpOnDemandAndNoRequestIsLost) {
  Shoal gateway = StartGateway(nats_.url());
  Shoal w1 = StartFleetWorker(nats_.url(), repo_.path(), FastWorker());
  Shoal w2 = StartFleetWorker(nats_.url(), repo_.path(), FastWorker());
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  const std::string id1 = WorkerId(w1), id2 = WorkerId(w2);

  // Traffic for tiny-a from 8 clients until the test says stop; one worker
  // loads it.
  constexpr int kClients = 8;
  std::atomic<int> done{0};
  std::atomic<bool> stop{false};
  std::vector<std::future<std::vector<HttpResult>>> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.push_back(std::async(std::launch::async, [&, c] {
      std::vector<HttpResult> results;
      for (int i = 0; !stop; ++i) {
        results.push_back(Embed(gateway.port, "tiny-a", "client " + std::to_string(c) + " request " + std::to_string(i)));
        ++done;
      }
      return results;
    }));
  }
  std::string holder;
  ASSERT_TRUE(Eventually([&] {
    for (const auto& [worker, state] : WhereIs(gateway.port, "tiny-a"))
      if (state == "loaded") holder = worker;
    return !holder.empty();
  })) << "no worker loaded tiny-a";
  Shoal& victim = holder == id1 ? w1 : w2;
  const std::string survivor = holder == id1 ? id2 : id1;
  const int done_at_kill = done.load();
  victim.process->Kill();
  // The survivor takes the model over on demand, and serves some more.
  const bool taken_over = Eventually([&] { return WhereIs(gateway.port, "tiny-a")[survivor] == "loaded"; }, 30s);
  const int done_at_takeover = done.load();
  Eventually([&] { return done.load() >= done_at_takeover + 50; }, 30s);
  stop = true;

  int ok = 0, total = 0;
  for (auto& f : clients)
    for (const HttpResult& r : f.get()) {
      ++total;
      EXPECT_EQ(r.status, 200) << r.error << r.body;
      ok += r.status == 200 ? 1 : 0;
    }
  EXPECT_TRUE(taken_over) << "the survivor never loaded tiny-a";
  EXPECT_EQ(ok, total) << "killed after " << done_at_kill << " requests";
  EXPECT_GT(total, done_at_takeover) << "no request was served after the takeover";
  EXPECT_TRUE(Eventually([&] { return WhereIs(gateway.port, "tiny-a").count(holder) == 0; }, 15s))
      << "the dead worker is still in the registry";
}

TEST_F(E2eFleet, RegistryForgetsADeadWorkerWhenItsHeartbeatsExpire) {
  Shoal gateway = StartGateway(nats_.url());
  Shoal w1 = StartFleetWorker(nats_.url(), repo_.path(), FastWorker("tiny-a"));
  Shoal w2 = StartFleetWorker(nats_.url(), repo_.path(), FastWorker());
  const std::string id1 = WorkerId(w1);
  ASSERT_TRUE(Eventually([&] { return WhereIs(gateway.port, "tiny-a").size() == 2; }))
      << HttpGet(gateway.port, "/v1/models/tiny-a").body << "\n" << HttpGet(gateway.port, "/readyz").body;
  EXPECT_EQ(WhereIs(gateway.port, "tiny-a")[id1], "loaded");
  w1.process->Kill();  // no goodbye: only the TTL can remove it
  ASSERT_TRUE(Eventually([&] { return WhereIs(gateway.port, "tiny-a").count(id1) == 0; }, 10s))
      << "the registry still lists the dead worker";
  EXPECT_EQ(WhereIs(gateway.port, "tiny-a").size(), 1u);
  auto ready = json::parse(HttpGet(gateway.port, "/readyz").body);
  EXPECT_EQ(ready["workers"], 1);
  auto models = json::parse(HttpGet(gateway.port, "/v1/models/tiny-a").body);
  EXPECT_EQ(models["state"], "not_loaded");  // only the dead worker had it
}

TEST_F(E2eFleet, OperatorsActThroughHttpAndTheCli) {
  Shoal gateway = StartGateway(nats_.url());
  Shoal worker = StartFleetWorker(nats_.url(), repo_.path(), FastWorker());
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  const std::string url = "http://127.0.0.1:" + std::to_string(gateway.port);
  const std::string id = WorkerId(worker);

  CliRun run = RunShoal({"models", "load", "tiny-b", "--gateway", url});
  EXPECT_EQ(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("tiny-b"), std::string::npos) << run.out;
  EXPECT_EQ(WhereIs(gateway.port, "tiny-b")[id], "loaded");

  auto r = HttpPostJson(gateway.port, "/v1/models/tiny-b/pin", "");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["results"][0]["status"]["pinned"], true);
  // A pinned model cannot be unloaded: the error names the reason, and the
  // CLI exits non-zero.
  r = HttpPostJson(gateway.port, "/v1/models/tiny-b/unload", "");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r.body), "model_pinned");
  run = RunShoal({"models", "unload", "tiny-b", "--gateway", url});
  EXPECT_EQ(run.exit_code, 1) << run.out;
  run = RunShoal({"models", "unpin", "tiny-b", "--gateway", url});
  EXPECT_EQ(run.exit_code, 0) << run.out;
  run = RunShoal({"models", "unload", "tiny-b", "--gateway", url});
  EXPECT_EQ(run.exit_code, 0) << run.out;
  EXPECT_EQ(WhereIs(gateway.port, "tiny-b")[id], "not_loaded");

  run = RunShoal({"models", "--gateway", url});
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_NE(run.out.find("tiny-a"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find(id), std::string::npos) << run.out;

  r = HttpPostJson(gateway.port, "/v1/models/nope/load", "");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(ErrorCode(r.body), "model_not_found");
  r = HttpPostJson(gateway.port, "/v1/models/tiny-a/load", R"({"worker":"no-such-worker"})");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(ErrorCode(r.body), "worker_not_found");
  run = RunShoal({"models", "load", "tiny-a", "--gateway", "http://127.0.0.1:1"});
  EXPECT_EQ(run.exit_code, 1);
}

TEST_F(E2eFleet, NoWaitGatewayAnswers503WhileTheModelLoads) {
  Shoal gateway = StartGateway(nats_.url(), {"--wait-for-load", "false"});
  Shoal worker = StartFleetWorker(nats_.url(), repo_.path(), FastWorker());
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  HttpResult r = Embed(gateway.port, "tiny-a", "are you there?");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(ErrorCode(r.body), "model_loading");
  EXPECT_EQ(r.Header("retry-after"), "1");
  // The 503 asked for the load: the model comes up without any work queued.
  ASSERT_TRUE(Eventually([&] { return Embed(gateway.port, "tiny-a", "now?").status == 200; }));
  EXPECT_TRUE(Eventually([&] {
    auto ready = json::parse(HttpGet(gateway.port, "/readyz").body);
    return ready["queue_depth"] == 0;  // the load hint was consumed, not left behind
  }));
}

}  // namespace
}  // namespace shoal::e2e
