// HttpLoad against a real HTTP server in the test: what it sends and what
// it counts (per tag, per status), in closed and open loop.
#include "loadgen/http_load.h"

#include <map>
#include <mutex>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/fake_openai_server.h"

namespace shoal::loadgen {
namespace {

using shoal::testing::FakeOpenAiServer;

// Model "ok" gets 200, "busy" gets 429, "broken" gets 500.
FakeOpenAiServer::Reply Answer(const FakeOpenAiServer::Request& r) {
  const std::string model = nlohmann::json::parse(r.body).value("model", "");
  if (model == "busy") return {429, R"({"error":{"message":"queue full"}})"};
  if (model == "broken") return {500, R"({"error":{"message":"boom"}})"};
  return FakeOpenAiServer::Embeddings(r.body);
}

LoadOptions Options(int port) {
  LoadOptions o;
  o.port = port;
  const char* models[] = {"ok", "busy", "ok", "broken"};
  for (int i = 0; i < 4; ++i) {
    o.requests.push_back(JsonPostRequest("127.0.0.1", "/v1/embeddings",
                                         nlohmann::json({{"model", models[i]}, {"input", {"a b c"}}}).dump(),
                                         "Authorization: Bearer t0k\r\n"));
  }
  o.request_tags = {0, 1, 0, 2};
  o.warmup_s = 0.1;
  o.duration_s = 0.4;
  o.fail_when_all_failed = false;
  return o;
}

void ExpectConsistent(const LoadResult& r) {
  ASSERT_EQ(r.per_tag.size(), 3u);
  EXPECT_GT(r.completed, 0);
  EXPECT_EQ(r.per_tag[0].completed, r.completed);
  EXPECT_EQ(r.per_tag[0].errors, 0);
  EXPECT_EQ(r.per_tag[1].completed, 0);
  EXPECT_EQ(r.per_tag[2].completed, 0);
  EXPECT_EQ(r.errors_by_status.count(0), 0u) << r.first_error;
  EXPECT_EQ(r.per_tag[1].errors, r.errors_by_status.at(429));
  EXPECT_EQ(r.per_tag[2].errors, r.errors_by_status.at(500));
  EXPECT_EQ(r.errors, r.errors_by_status.at(429) + r.errors_by_status.at(500));
  EXPECT_EQ(r.prompt_tokens, 3 * r.answered_in_window);
  EXPECT_EQ(static_cast<int64_t>(r.latencies_ms.size()), r.completed);
}

TEST(HttpLoad, ClosedLoopCountsWhatTheServerAnswered) {
  FakeOpenAiServer server(Answer);
  LoadOptions o = Options(server.port());
  o.connections = 2;
  LoadProgress progress;
  o.progress = &progress;
  auto r = RunLoad(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(*r);
  // Every request the server saw was answered and counted by the progress.
  const auto seen = server.requests();
  const auto snap = progress.Take();
  EXPECT_EQ(snap.sent, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(snap.completed + snap.errors, snap.sent);
  EXPECT_GE(snap.completed, r->completed);
  std::map<std::string, int> per_model;
  for (const auto& req : seen) {
    EXPECT_EQ(req.method, "POST");
    EXPECT_EQ(req.target, "/v1/embeddings");
    EXPECT_EQ(req.authorization, "Bearer t0k");
    ++per_model[nlohmann::json::parse(req.body)["model"]];
  }
  // Two connections on one thread go through the list in turn: "ok" is half.
  EXPECT_NEAR(per_model["ok"], static_cast<double>(seen.size()) / 2, 2.0);
  EXPECT_EQ(snap.completed, per_model["ok"]);
}

TEST(HttpLoad, OpenLoopAccountsForEveryArrival) {
  FakeOpenAiServer server(Answer);
  LoadOptions o = Options(server.port());
  o.rate_per_s = 400;
  o.connections = 2;
  auto r = RunLoad(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(*r);
  EXPECT_EQ(r->dropped, 0);
  EXPECT_EQ(r->completed + r->errors, r->due);
}

// Open-loop throughput counts the answers that arrived inside the window,
// whenever due; latencies and `completed` count the requests due in it.
// With every answer 300 ms late, those due in the window's last 300 ms are
// answered after it: counted as completed, not as throughput. (Before,
// throughput was completed / window: the offered rate even when the server
// fell behind.)
TEST(HttpLoad, OpenLoopThroughputCountsAnswersInsideTheWindow) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    FakeOpenAiServer::Reply reply = FakeOpenAiServer::Embeddings(r.body);
    reply.delay_ms = 300;
    return reply;
  });
  LoadOptions o = Options(server.port());
  o.requests.resize(1);
  o.request_tags.clear();
  o.warmup_s = 0;
  o.duration_s = 1;
  o.rate_per_s = 40;
  o.connections = 64;
  auto r = RunLoad(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->completed, r->due);
  EXPECT_GT(r->completed, r->answered_in_window);
  EXPECT_GT(r->answered_in_window, 0);
  EXPECT_DOUBLE_EQ(r->RequestsPerS(), static_cast<double>(r->answered_in_window) / r->window_s);
}

// A host name is resolved to an address that takes connections: the test
// server listens on 127.0.0.1 only, and "localhost" may resolve to ::1
// first.
TEST(HttpLoad, AHostNameReachesAServerOnIpv4Only) {
  FakeOpenAiServer server(Answer);
  LoadOptions o = Options(server.port());
  o.host = "localhost";
  o.connections = 2;
  auto r = RunLoad(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(*r);
}

// Open loop: a kept-alive connection the server closed while it idled in
// the pool (here: every connection, right after its answer) fails its next
// request before any answer byte; the request goes again once on a new
// connection and is answered, not counted as a transport error of the
// server's. (The closed loop sends again at once, with no idle time, and
// does not retry.)
TEST(HttpLoad, ARequestOnAConnectionClosedWhileIdleGoesAgainOnANewOne) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    FakeOpenAiServer::Reply reply = FakeOpenAiServer::Embeddings(r.body);
    reply.hang_up = true;
    return reply;
  });
  LoadOptions o = Options(server.port());
  o.requests.resize(1);
  o.request_tags.clear();
  o.rate_per_s = 40;
  o.connections = 2;
  o.duration_s = 1;
  auto r = RunLoad(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT(r->completed, 5);
  EXPECT_EQ(r->errors, 0) << r->first_error;
  EXPECT_EQ(r->completed, r->due);
}

// The per-request observers see every request once, with the value their
// send returned, its status, and the same window rule as the counts.
TEST(HttpLoad, ObserversSeeEveryRequestWithItsStatus) {
  for (const double rate : {0.0, 400.0}) {
    SCOPED_TRACE(rate);
    FakeOpenAiServer server(Answer);
    LoadOptions o = Options(server.port());
    o.rate_per_s = rate;
    o.connections = 2;
    std::mutex mu;
    uint64_t sent = 0;
    std::map<uint64_t, size_t> open;  // sent value -> request
    int64_t done = 0, ok_in_window = 0, errors_in_window = 0, mismatched = 0;
    std::map<int, int64_t> status_of_tag;  // tag -> last status
    o.on_request_sent = [&](size_t request) {
      std::lock_guard<std::mutex> lock(mu);
      open[++sent] = request;
      return sent;
    };
    o.on_request_done = [&](size_t request, uint64_t value, int status, double latency_ms, bool in_window) {
      std::lock_guard<std::mutex> lock(mu);
      auto it = open.find(value);
      if (it == open.end() || it->second != request || latency_ms < 0) ++mismatched;
      if (it != open.end()) open.erase(it);
      ++done;
      status_of_tag[o.request_tags[request]] = status;
      if (in_window) ++(status == 200 ? ok_in_window : errors_in_window);
    };
    auto r = RunLoad(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(mismatched, 0);
    EXPECT_TRUE(open.empty()) << open.size() << " requests never ended";
    EXPECT_EQ(done, static_cast<int64_t>(sent));
    EXPECT_EQ(static_cast<int64_t>(server.requests().size()), done);
    EXPECT_EQ(ok_in_window, r->completed);
    EXPECT_EQ(errors_in_window, r->errors);
    EXPECT_EQ(status_of_tag[0], 200);
    EXPECT_EQ(status_of_tag[1], 429);
    EXPECT_EQ(status_of_tag[2], 500);
  }
}

// Several gateways of one cluster: connections are opened on each in turn,
// so both servers carry the load and every answer is counted once.
TEST(HttpLoad, ConnectionsSpreadOverEveryTarget) {
  FakeOpenAiServer first(Answer), second(Answer);
  LoadOptions o = Options(first.port());
  o.more_targets = {{"127.0.0.1", second.port()}};
  o.connections = 4;
  LoadProgress progress;
  o.progress = &progress;
  auto r = RunLoad(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(*r);
  const auto a = first.requests().size(), b = second.requests().size();
  EXPECT_GT(a, 0u);
  EXPECT_GT(b, 0u);
  EXPECT_EQ(static_cast<int64_t>(a + b), progress.Take().sent);
}

TEST(HttpLoad, ServersThatCloseEveryConnectionKeepTheirPlaceInThePool) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    FakeOpenAiServer::Reply reply = FakeOpenAiServer::Embeddings(r.body);
    reply.close = true;
    return reply;
  });
  for (double rate : {0.0, 100.0}) {
    LoadOptions o = Options(server.port());
    o.request_tags.clear();
    o.requests = {o.requests[0]};
    o.rate_per_s = rate;
    o.connections = 2;
    o.max_connections = 8;
    o.duration_s = 0.5;
    auto r = RunLoad(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->errors, 0) << r->first_error;
    // Each connection carries one request; more answers than connections
    // means closed ones were replaced.
    EXPECT_GT(r->completed, o.max_connections) << "rate " << rate;
    if (rate > 0) {
      EXPECT_EQ(r->completed + r->dropped, r->due);
    }
  }
}

TEST(HttpLoad, AllFailedIsAnErrorOnlyWhenAsked) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request&) {
    return FakeOpenAiServer::Reply{503, R"({"error":{"message":"loading"}})"};
  });
  LoadOptions o = Options(server.port());
  o.request_tags.clear();
  o.connections = 1;
  o.duration_s = 0.2;
  auto counted = RunLoad(o);
  ASSERT_TRUE(counted.ok());
  EXPECT_EQ(counted->completed, 0);
  EXPECT_GT(counted->errors_by_status.at(503), 0);
  EXPECT_TRUE(counted->per_tag.empty());
  o.fail_when_all_failed = true;
  EXPECT_EQ(RunLoad(o).status().code(), StatusCode::kUnavailable);
}

TEST(HttpLoad, RejectsMismatchedTagsAndUnknownHosts) {
  LoadOptions o = Options(1);
  o.request_tags.pop_back();
  EXPECT_EQ(RunLoad(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(1);
  o.host = "no-such-host.invalid";
  EXPECT_EQ(RunLoad(o).status().code(), StatusCode::kUnavailable);
}

TEST(HttpLoad, ProgressPercentiles) {
  LoadProgress p;
  for (int i = 1; i <= 100; ++i) {
    p.OnSent();
    p.OnDone(true, i);
  }
  p.OnSent();
  p.OnDone(false, 0);
  const auto s = p.Take();
  EXPECT_EQ(s.sent, 101);
  EXPECT_EQ(s.completed, 100);
  EXPECT_EQ(s.errors, 1);
  // Histogram buckets are 1% wide.
  EXPECT_NEAR(s.p50_ms, 50, 0.5);
  EXPECT_NEAR(s.p99_ms, 99, 1.0);
  EXPECT_EQ(LoadProgress().Take().p99_ms, 0);
}

}  // namespace
}  // namespace shoal::loadgen
