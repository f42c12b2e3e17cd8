// End to end: separate `shoal gateway` and `shoal worker` processes on a
// test nats-server -js. Covers the failure cases the pull design exists for:
// no worker (504), a full queue (429), a worker killed mid-batch (redelivery,
// nothing lost), a restarted worker draining queued work, several
// gateways sharing one pool of workers, and (push dispatch) a killed
// worker's pushed work failing fast with worker_lost.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "e2e/http_client.h"
#include "e2e/process.h"
#include "e2e/shoal_cluster.h"
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"
#include "support/test_env.h"

namespace shoal::e2e {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kModel = "tiny-bert";
constexpr double kTolerance = 1e-4;

// Worker flags for the crash tests: unacked work comes back after 2 s.
const std::vector<std::string> kCrashWorkerFlags = {"--ack-wait-ms", "2000", "--threads", "1"};

std::vector<std::string> TextPool(int n) {
  std::vector<std::string> texts;
  for (int i = 0; i < n; ++i) {
    std::string t = "pooled sentence " + std::to_string(i);
    for (int k = 0; k < i % 5; ++k) t += " that grows a little longer";
    texts.push_back(t);
  }
  return texts;
}

// Stops a worker the polite way, so that its registry entry goes at once.
void StopGracefully(Shoal& s) {
  s.process->Signal(SIGTERM);
  auto status = s.process->Wait(15s);
  ASSERT_TRUE(status.has_value()) << "worker did not stop on SIGTERM";
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << DescribeWaitStatus(*status);
}

// Polls the work stream's message count on nats-server until it is `want`
// or `timeout` passes; returns the last value. (Not the gateway's /readyz:
// its snapshot is up to a second old, and could say 0 before an ack had
// landed.)
int64_t WaitForQueueDepth(const std::string& nats_url, int64_t want, std::chrono::milliseconds timeout) {
  NatsOptions no;
  no.url = nats_url;
  auto client = NatsClient::Connect(no);
  if (!client.ok()) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int64_t depth = -1;
  for (;;) {
    auto st = GetStreamState(**client, "SHOAL_WORK");
    depth = st.ok() ? static_cast<int64_t>(st->msgs) : -1;
    if (depth == want || std::chrono::steady_clock::now() >= deadline) return depth;
    std::this_thread::sleep_for(100ms);
  }
}

// Sum of every sample of `name` (any labels) in Prometheus text.
double MetricValue(const std::string& text, const std::string& name) {
  double sum = 0;
  size_t pos = 0;
  while ((pos = text.find(name, pos)) != std::string::npos) {
    const bool line_start = pos == 0 || text[pos - 1] == '\n';
    pos += name.size();
    if (!line_start || (text[pos] != '{' && text[pos] != ' ')) continue;
    const size_t eol = text.find('\n', pos);
    const std::string line = text.substr(pos, eol == std::string::npos ? std::string::npos : eol - pos);
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

HttpResult EmbedWithTimeout(int port, const json& input, int64_t timeout_ms) {
  return HttpPostJson(port, "/v1/embeddings", json({{"model", kModel}, {"input", input}}).dump(),
                      {{"Shoal-Timeout-Ms", std::to_string(timeout_ms)}},
                      std::chrono::milliseconds(timeout_ms + 15000));
}

// `requests` embedding requests from `clients` concurrent clients (request r
// sends `input_of(r)`, 60 s deadline); SIGKILLs `victim` once `kill_after`
// have completed. Each result with its time; and how many had completed at
// the kill.
struct KillRun {
  std::vector<HttpResult> results;
  std::vector<double> seconds;
  int completed_at_kill = 0;
};
KillRun RunClientsAndKill(int port, int requests, int clients, int kill_after, const std::function<json(int)>& input_of,
                          ChildProcess& victim) {
  KillRun run;
  run.results.resize(requests);
  run.seconds.resize(requests);
  std::atomic<int> next{0}, completed{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&] {
      for (int r = next++; r < requests; r = next++) {
        const auto t0 = std::chrono::steady_clock::now();
        run.results[r] = EmbedWithTimeout(port, input_of(r), 60000);
        run.seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ++completed;
      }
    });
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (completed < kill_after && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(1ms);
  run.completed_at_kill = completed;
  victim.Kill();
  for (auto& t : threads) t.join();
  return run;
}

// A gateway over a stream and catalog that a worker created and left: it
// runs, NATS and the stream are there, no worker is (readiness 503).
Shoal StartGatewayWithoutWorkers(const std::string& nats_url) {
  {
    Shoal worker = StartWorker(nats_url, {"--threads", "1"});
    StopGracefully(worker);
  }
  Shoal gateway = StartGateway(nats_url);
  EXPECT_EQ(WaitForReadyz(gateway.port, 503, 10s), 503);
  return gateway;
}

// The gateway alone: work waits in the queue until its deadline, then 504;
// readiness says why.
TEST(E2eCluster, NoWorkerMeansDeadlineExceededAndNotReady) {
  shoal::testing::TestNatsServer nats;
  Shoal gateway = StartGatewayWithoutWorkers(nats.url());
  auto ready = HttpGet(gateway.port, "/readyz");
  auto rj = json::parse(ready.body);
  EXPECT_EQ(rj.at("nats"), true);
  EXPECT_EQ(rj.at("stream"), true);
  EXPECT_EQ(rj.at("workers"), 0);
  EXPECT_FALSE(ready.Header("retry-after").empty());

  auto r = EmbedWithTimeout(gateway.port, "nobody is listening", 500);
  ASSERT_EQ(r.status, 504) << r.error << r.body;
  EXPECT_EQ(ErrorCode(r.body), "deadline_exceeded");
  EXPECT_EQ(json::parse(r.body).at("error").at("type"), "timeout_error");
  // /healthz is liveness only.
  EXPECT_EQ(HttpGet(gateway.port, "/healthz").status, 200);
}

// A gateway that stops answers the requests it holds (503 shutting_down)
// instead of closing their connections unanswered; their work stays queued.
TEST(E2eCluster, AStoppingGatewayAnswersTheRequestsItHolds) {
  shoal::testing::TestNatsServer nats;
  Shoal gateway = StartGatewayWithoutWorkers(nats.url());
  auto held = std::async(std::launch::async, [&] { return EmbedWithTimeout(gateway.port, "held at the stop", 60000); });
  ASSERT_EQ(WaitForQueueDepth(nats.url(), 1, 20s), 1);  // published: the gateway holds it
  StopGracefully(gateway);
  const HttpResult r = held.get();
  EXPECT_EQ(r.status, 503) << r.error << r.body;
  EXPECT_EQ(ErrorCode(r.body), "shutting_down") << r.body;
}

// A bounded queue refuses work explicitly instead of growing or dropping.
TEST(E2eCluster, FullQueueGives429WithRetryAfter) {
  shoal::testing::TestNatsServer nats;
  {
    Shoal worker = StartWorker(nats.url(), {"--threads", "1", "--queue-max-msgs", "2"});
    StopGracefully(worker);
  }
  Shoal gateway = StartGateway(nats.url());
  constexpr int kRequests = 6;
  std::vector<std::future<HttpResult>> calls;
  for (int i = 0; i < kRequests; ++i)
    calls.push_back(std::async(std::launch::async, [&, i] {
      return EmbedWithTimeout(gateway.port, "request " + std::to_string(i), 1500);
    }));
  int full = 0, expired = 0;
  for (auto& c : calls) {
    HttpResult r = c.get();
    SCOPED_TRACE(r.body);
    if (r.status == 429) {
      ++full;
      EXPECT_EQ(ErrorCode(r.body), "queue_full");
      EXPECT_EQ(json::parse(r.body).at("error").at("type"), "rate_limit_error");
      EXPECT_FALSE(r.Header("retry-after").empty()) << "429 without Retry-After";
    } else {
      // The two that fit wait for a worker that never comes.
      EXPECT_EQ(r.status, 504) << r.error;
      ++expired;
    }
  }
  EXPECT_GE(full, 1);
  EXPECT_LE(expired, 2);
  // Still full: the expired work stays queued until a worker drops it.
  auto again = EmbedWithTimeout(gateway.port, "one more", 1500);
  EXPECT_EQ(again.status, 429) << again.body;
  auto metrics = HttpGet(gateway.port, "/metrics");
  EXPECT_NE(metrics.body.find("shoal_gateway_queue_full_total"), std::string::npos);
}

// SIGKILL one of two workers while both are busy: its unacked work is
// redelivered to the other one after AckWait, and every request still gets
// exactly one complete, correct answer. Once in a while the kill lands
// between two of the victim's batches, when it holds nothing: then nothing
// is redelivered and the run did not test the point, so it is run again, on
// fresh processes, up to three times. Every run must lose nothing.
void RunWorkerKilledMidBatch(double* redelivered, std::string* what) {
  shoal::testing::TestNatsServer nats;
  Shoal gateway = StartGateway(nats.url());
  Shoal victim = StartWorker(nats.url(), kCrashWorkerFlags);
  auto metrics_port = PickFreePort();
  ASSERT_TRUE(metrics_port.ok());
  auto survivor_flags = kCrashWorkerFlags;
  survivor_flags.insert(survivor_flags.end(), {"--metrics-port", std::to_string(*metrics_port)});
  Shoal survivor = StartWorker(nats.url(), survivor_flags);
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);

  const auto pool = TextPool(40);
  const Vectors reference = EmbedOrThrow(gateway.port, kModel, pool).rows;
  ASSERT_EQ(reference.size(), pool.size());

  constexpr int kRequests = 200, kClients = 16, kInputsPerRequest = 4, kKillAfter = 20;
  auto input_of = [&](int req, int k) { return (req * 7 + k * 13) % static_cast<int>(pool.size()); };
  KillRun run = RunClientsAndKill(gateway.port, kRequests, kClients, kKillAfter, [&](int r) {
    json input = json::array();
    for (int k = 0; k < kInputsPerRequest; ++k) input.push_back(pool[input_of(r, k)]);
    return input;
  }, *victim.process);
  const auto& results = run.results;
  const int completed_at_kill = run.completed_at_kill;

  EXPECT_LT(completed_at_kill, kRequests) << "the kill came after all the work; nothing was tested";
  int ok = 0;
  for (int r = 0; r < kRequests; ++r) {
    SCOPED_TRACE("request " + std::to_string(r));
    const HttpResult& res = results[r];
    ASSERT_EQ(res.status, 200) << res.error << " " << res.body;
    auto e = ParseOpenAiEmbeddings(res.body);
    ASSERT_EQ(e.rows.size(), static_cast<size_t>(kInputsPerRequest));
    for (int k = 0; k < kInputsPerRequest; ++k)
      ASSERT_LT(MaxAbsDiff(e.rows[k], reference[input_of(r, k)]), kTolerance) << "input " << k;
    ++ok;
  }
  EXPECT_EQ(ok, kRequests);
  EXPECT_TRUE(ProcessAlive(survivor.process->pid()));
  // Nothing is left behind: work the victim answered but never acked comes
  // back after AckWait, is answered again (the gateway drops the duplicate)
  // and acked.
  EXPECT_EQ(WaitForQueueDepth(nats.url(), 0, 20s), 0);
  // The survivor really ran work the victim had taken and not acked.
  const std::string survivor_metrics = HttpGet(*metrics_port, "/metrics").body;
  *redelivered = MetricValue(survivor_metrics, "shoal_worker_redelivered_total");
  *what = "killed after " + std::to_string(completed_at_kill) + " requests; nothing was redelivered:\n" +
          survivor_metrics;
}

TEST(E2eCluster, WorkerKilledMidBatchLosesNothing) {
  double redelivered = 0;
  std::string what;
  for (int attempt = 1; attempt <= 3 && redelivered == 0; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt));
    RunWorkerKilledMidBatch(&redelivered, &what);
    if (::testing::Test::HasFailure()) return;  // lost or wrong answers: no retry
  }
  EXPECT_GT(redelivered, 0) << what;
}

// Work sent while no worker runs waits in the queue; a worker started later
// (here: after the only one crashed) drains it.
TEST(E2eCluster, RestartedWorkerPicksUpQueuedWork) {
  shoal::testing::TestNatsServer nats;
  Shoal gateway = StartGateway(nats.url());
  Shoal first = StartWorker(nats.url(), kCrashWorkerFlags);
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  const auto pool = TextPool(8);
  const Vectors reference = EmbedOrThrow(gateway.port, kModel, pool).rows;
  // The worker replies, then acks: let the ack land before the crash, so
  // the queue holds exactly the work sent below.
  ASSERT_EQ(WaitForQueueDepth(nats.url(), 0, 10s), 0);
  first.process->Kill();

  std::vector<std::future<HttpResult>> calls;
  for (const auto& text : pool)
    calls.push_back(std::async(std::launch::async, [&, text] { return EmbedWithTimeout(gateway.port, text, 60000); }));
  // Wait until the work is queued, so the new worker finds it there.
  EXPECT_EQ(WaitForQueueDepth(nats.url(), static_cast<int64_t>(pool.size()), 10s),
            static_cast<int64_t>(pool.size()))
      << "work was not queued while no worker ran";
  for (auto& c : calls) ASSERT_EQ(c.wait_for(0s), std::future_status::timeout) << "answered without a worker";

  Shoal second = StartWorker(nats.url(), kCrashWorkerFlags);
  for (size_t i = 0; i < calls.size(); ++i) {
    HttpResult r = calls[i].get();
    ASSERT_EQ(r.status, 200) << r.error << r.body;
    auto e = ParseOpenAiEmbeddings(r.body);
    ASSERT_EQ(e.rows.size(), 1u);
    EXPECT_LT(MaxAbsDiff(e.rows[0], reference[i]), kTolerance) << "input " << i;
  }
  EXPECT_EQ(EmbedOrThrow(gateway.port, kModel, pool).rows.size(), pool.size());
}

// Gateways are stateless: two of them feed the same worker, concurrently,
// and each gets its own replies.
TEST(E2eCluster, TwoGatewaysShareTheWorkers) {
  shoal::testing::TestNatsServer nats;
  Shoal worker = StartWorker(nats.url(), {"--threads", "1"});
  Shoal g1 = StartGateway(nats.url(), {"--chunk-size", "2"});
  Shoal g2 = StartGateway(nats.url(), {"--chunk-size", "3"});
  ASSERT_EQ(WaitForReadyz(g1.port, 200, 30s), 200);
  ASSERT_EQ(WaitForReadyz(g2.port, 200, 30s), 200);

  const auto pool = TextPool(12);
  const Vectors reference = EmbedOrThrow(g1.port, kModel, pool).rows;
  constexpr int kPerGateway = 30;
  std::vector<std::future<HttpResult>> calls;
  for (int i = 0; i < 2 * kPerGateway; ++i) {
    const int port = i % 2 ? g2.port : g1.port;
    calls.push_back(std::async(std::launch::async, [&, port, i] {
      json input = json::array();
      for (int k = 0; k < 5; ++k) input.push_back(pool[(i + k) % pool.size()]);
      return EmbedWithTimeout(port, input, 30000);
    }));
  }
  for (int i = 0; i < static_cast<int>(calls.size()); ++i) {
    HttpResult r = calls[i].get();
    SCOPED_TRACE("request " + std::to_string(i));
    ASSERT_EQ(r.status, 200) << r.error << r.body;
    auto e = ParseOpenAiEmbeddings(r.body);
    ASSERT_EQ(e.rows.size(), 5u);
    for (int k = 0; k < 5; ++k)
      EXPECT_LT(MaxAbsDiff(e.rows[k], reference[(i + k) % pool.size()]), kTolerance) << "input " << k;
  }
  // Both see the same worker in the catalog.
  auto workers_of = [](int port) {
    std::vector<std::string> ids;
    const json models = json::parse(HttpGet(port, "/v1/models").body);
    for (const auto& m : models.at("data"))
      for (const auto& w : m.at("workers")) ids.push_back(w.at("worker"));
    return ids;
  };
  EXPECT_EQ(workers_of(g1.port), workers_of(g2.port));
  EXPECT_EQ(workers_of(g1.port).size(), 1u) << HttpGet(g1.port, "/v1/models").body;
}

// Push dispatch has no queue to fall back on: SIGKILL one of two workers
// while both hold pushed work, and each request still gets one prompt
// answer, either the right vectors or 503 worker_lost with Retry-After
// (well before its 60 s deadline), and the survivor keeps serving.
TEST(E2eCluster, PushedWorkOnAKilledWorkerFailsFastWithWorkerLost) {
  shoal::testing::TestNatsServer nats;
  Shoal gateway = StartGateway(nats.url(), {"--dispatch", "push", "--push-worker-timeout-ms", "1000"});
  Shoal victim = StartWorker(nats.url(), kCrashWorkerFlags);
  Shoal survivor = StartWorker(nats.url(), kCrashWorkerFlags);
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  const auto pool = TextPool(20);
  const Vectors reference = EmbedOrThrow(gateway.port, kModel, pool).rows;

  constexpr int kRequests = 200, kClients = 16, kKillAfter = 20;
  KillRun run = RunClientsAndKill(gateway.port, kRequests, kClients, kKillAfter, [&](int r) {
    return json::array({pool[r % pool.size()], pool[(r + 3) % pool.size()]});
  }, *victim.process);
  const auto& results = run.results;
  const auto& seconds = run.seconds;
  const int completed_at_kill = run.completed_at_kill;

  EXPECT_LT(completed_at_kill, kRequests) << "the kill came after all the work; nothing was tested";
  int ok = 0, lost = 0;
  for (int r = 0; r < kRequests; ++r) {
    SCOPED_TRACE("request " + std::to_string(r));
    const HttpResult& res = results[r];
    EXPECT_LT(seconds[r], 30.0) << "waited towards its deadline instead of failing fast";
    if (res.status == 200) {
      auto e = ParseOpenAiEmbeddings(res.body);
      ASSERT_EQ(e.rows.size(), 2u);
      EXPECT_LT(MaxAbsDiff(e.rows[0], reference[r % pool.size()]), kTolerance);
      EXPECT_LT(MaxAbsDiff(e.rows[1], reference[(r + 3) % pool.size()]), kTolerance);
      ++ok;
    } else {
      ASSERT_EQ(res.status, 503) << res.error << " " << res.body;
      EXPECT_EQ(ErrorCode(res.body), "worker_lost");
      EXPECT_FALSE(res.Header("retry-after").empty());
      ++lost;
    }
  }
  EXPECT_EQ(ok + lost, kRequests);
  EXPECT_GT(ok, kKillAfter);  // the survivor went on serving
  // Both workers had work (least-loaded spreads it), so the victim held some.
  EXPECT_GT(lost, 0) << "killed after " << completed_at_kill << " requests with nothing pushed to it";
  EXPECT_GT(MetricValue(HttpGet(gateway.port, "/metrics").body, "shoal_gateway_push_worker_lost_total"), 0);
  EXPECT_TRUE(ProcessAlive(survivor.process->pid()));
  // New work goes only to the survivor now.
  EXPECT_EQ(EmbedOrThrow(gateway.port, kModel, pool).rows.size(), pool.size());
}

}  // namespace
}  // namespace shoal::e2e

namespace shoal::e2e {
namespace {

std::string ProcessEnv(pid_t pid, const std::string& name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string key = name + "=";
  for (size_t start = 0; start < all.size();) {
    size_t end = all.find('\0', start);
    if (end == std::string::npos) end = all.size();
    if (all.compare(start, key.size(), key) == 0) return all.substr(start + key.size(), end - start - key.size());
    start = end + 1;
  }
  return "<unset>";
}

// Two worker processes started at once with one --worker-id: exactly one
// gets the id (its first registry entry is written only if there is none);
// the other exits with worker_id_in_use instead of sharing the entry and
// the control subject.
TEST(E2eCluster, TwoWorkersStartedAtOnceWithOneIdOneIsRefused) {
  shoal::testing::TestNatsServer nats;
  StartWorker(nats.url(), {"--threads", "1"});  // the stream and buckets exist; it stops again
  shoal::testing::TempDir logs;
  std::unique_ptr<ChildProcess> twins[2];
  for (int i = 0; i < 2; ++i) {
    ChildOptions o;
    o.argv = {shoal::testing::ShoalBinary(), "worker", "--nats-url", nats.url(), "--models-dir",
              shoal::testing::ModelsDir(), "--models", "tiny-bert", "--threads", "1", "--worker-id", "twin"};
    o.stderr_path = logs.path() + "/" + std::to_string(i) + ".log";
    twins[i] = ChildProcess::Spawn(o);
  }
  // The refused one exits before it would be ready.
  int refused_index = -1;
  for (int round = 0; round < 300 && refused_index < 0; ++round)
    for (int i = 0; i < 2 && refused_index < 0; ++i)
      if (twins[i]->Wait(50ms)) refused_index = i;
  ASSERT_GE(refused_index, 0) << "both workers are running with one id";
  const auto status = twins[refused_index]->Wait(0ms);
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << *status;
  std::ifstream in(logs.path() + "/" + std::to_string(refused_index) + ".log");
  const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find("worker_id_in_use"), std::string::npos) << err;
  EXPECT_TRUE(twins[1 - refused_index]->WaitForLine(R"(shoal worker twin ready)", 60s));
}

// A --metrics-port in use fails the worker before it connects to NATS or
// loads a model: no NATS server listens here, so a worker that bound the
// port later would report the connection instead.
TEST(E2eCluster, WorkerWithItsMetricsPortInUseFailsBeforeConnecting) {
  shoal::testing::HeldPort taken;
  ASSERT_GE(taken.port(), 0);
  auto nobody = PickFreePort();
  ASSERT_TRUE(nobody.ok());
  shoal::testing::TempDir logs;
  ChildOptions o;
  o.argv = {shoal::testing::ShoalBinary(), "worker", "--nats-url", "nats://127.0.0.1:" + std::to_string(*nobody),
            "--models-dir", shoal::testing::ModelsDir(), "--models", "tiny-bert", "--threads", "1",
            "--metrics-port", std::to_string(taken.port())};
  o.stderr_path = logs.path() + "/worker.log";
  auto worker = ChildProcess::Spawn(o);
  const auto status = worker->Wait(60s);
  ASSERT_TRUE(status) << "the worker did not exit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << *status;
  std::ifstream in(o.stderr_path);
  const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find(std::to_string(taken.port())), std::string::npos) << err;
  EXPECT_EQ(err.find("nats"), std::string::npos) << err;
}

// --omp-wait-policy re-executes the worker with OMP_WAIT_POLICY set (libgomp
// reads it only at load time); the worker then serves as usual.
TEST(E2eCluster, OmpWaitPolicyFlagReachesTheWorkerProcess) {
  shoal::testing::TestNatsServer nats;
  Shoal worker = StartWorker(nats.url(), {"--omp-wait-policy", "active", "--threads", "1"});
  EXPECT_EQ(ProcessEnv(worker.process->pid(), "OMP_WAIT_POLICY"), "ACTIVE");
  Shoal gateway = StartGateway(nats.url());
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  EXPECT_EQ(EmbedOrThrow(gateway.port, kModel, {"after re-exec"}).rows.size(), 1u);
}

// `--sim-workers 2`: two workers in one process, one /metrics page; each
// worker's series carry its id, so one's gauges do not overwrite the
// other's.
TEST(E2eCluster, SimulatedWorkersInOneProcessKeepTheirOwnMetrics) {
  shoal::testing::TestNatsServer nats;
  auto metrics_port = PickFreePort();
  ASSERT_TRUE(metrics_port.ok());
  Shoal workers = StartWorker(nats.url(), {"--sim-workers", "2", "--worker-id", "e2esim", "--runtime", "sim",
                                           "--metrics-port", std::to_string(*metrics_port)});
  Shoal gateway = StartGateway(nats.url());
  ASSERT_EQ(WaitForReadyz(gateway.port, 200, 30s), 200);
  EXPECT_EQ(EmbedOrThrow(gateway.port, kModel, {"one", "two"}).rows.size(), 2u);
  const std::string text = HttpGet(*metrics_port, "/metrics").body;
  EXPECT_NE(text.find("shoal_worker_models_loaded{worker=\"e2esim-0\"}"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_worker_models_loaded{worker=\"e2esim-1\"}"), std::string::npos) << text;
  EXPECT_EQ(text.find("\nshoal_worker_models_loaded "), std::string::npos) << "an unlabelled series: " << text;
  EXPECT_GE(MetricValue(text, "shoal_worker_batches_total"), 1) << text;
  EXPECT_EQ(text.find("\nshoal_worker_batches_total{model"), std::string::npos) << "a series without its worker: " << text;
}

}  // namespace
}  // namespace shoal::e2e
