// `shoal bench` against a tiny real HTTP server in the test: option errors,
// environment variables, what it sends (models, body shape, Authorization)
// and that its results count what the server answered.
#include "cli/bench_command.h"

#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <limits>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/fake_openai_server.h"

namespace shoal {
namespace {

using nlohmann::json;
using shoal::testing::FakeOpenAiServer;
using ::testing::HasSubstr;

class TempOut {
 public:
  TempOut() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "shoal-bench-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempOut() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

json ReadJson(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return json::parse(s.str());
}

struct BenchRun {
  int code = -1;
  std::string out, err;
};

BenchRun Bench(const BenchCommandFlags& flags) {
  std::ostringstream out, err;
  BenchRun r;
  r.code = RunBenchCommand(flags, out, err, /*err_is_tty=*/false);
  r.out = out.str();
  r.err = err.str();
  return r;
}

TEST(BenchCommand, BadOptionsAreUsageErrors) {
  struct Case {
    void (*set)(BenchCommandFlags&);
    const char* message;
  };
  const Case cases[] = {
      {[](BenchCommandFlags& f) { f.popularity = "zipf:-2"; }, "zipf:S"},
      {[](BenchCommandFlags& f) { f.popularity = "pareto"; }, "--popularity"},
      {[](BenchCommandFlags& f) { f.input_words = "fixed:0"; }, "--input-words"},
      {[](BenchCommandFlags& f) { f.rate = "10", f.closed = "4"; }, "choose one of"},
      {[](BenchCommandFlags& f) { f.sweep = "10:20"; }, "START:STOP:STEPS"},
      {[](BenchCommandFlags& f) { f.rates = "10,x"; }, "'x' is not a rate in (0, 1000000]"},
      // A gap of under a nanosecond: every arrival at once, for ever.
      {[](BenchCommandFlags& f) { f.rate = "1e12"; }, "'1e12' is not a rate in (0, 1000000]"},
      {[](BenchCommandFlags& f) { f.sweep = "10:1e9:3"; }, "rates in (0, 1000000]"},
      {[](BenchCommandFlags& f) { f.closed = "0"; }, "client count"},
      {[](BenchCommandFlags& f) { f.url = "https://api.example.com"; }, "https"},
      {[](BenchCommandFlags& f) { f.duration_s = 0; }, "--duration"},
      // A window that never ends (or overflows its nanoseconds).
      {[](BenchCommandFlags& f) { f.duration_s = std::numeric_limits<double>::infinity(); }, "--duration"},
      {[](BenchCommandFlags& f) { f.warmup_s = 1e12; }, "--warmup"},
      {[](BenchCommandFlags& f) { f.batch = 0; }, "--batch"},
      // Built before the first request: 4096 x 2048 inputs of 512 words.
      {[](BenchCommandFlags& f) { f.batch = 2048, f.input_words = "fixed:512"; }, "lower --pool"},
      {[](BenchCommandFlags& f) { f.threads = 7000; }, "--threads must be in [1, 256]"},
  };
  for (const Case& c : cases) {
    BenchCommandFlags f;
    f.models = "m";
    c.set(f);
    const BenchRun r = Bench(f);
    EXPECT_EQ(r.code, 2) << c.message;
    EXPECT_THAT(r.err, HasSubstr("error: ")) << c.message;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
}

TEST(BenchCommand, OptionsComeFromFlagsAndEnvironment) {
  ::setenv("SHOAL_BENCH_POPULARITY", "zipf:1.3", 1);
  ::setenv("SHOAL_BENCH_BATCH", "4", 1);
  CLI::App app;
  BenchCommandFlags f;
  CLI::App* cmd = AddBenchCommand(&app, &f);
  const char* argv[] = {"shoal", "bench", "--rates", "10,20", "--models", "a,b", "--api-key", "k"};
  app.parse(8, const_cast<char**>(argv));
  ::unsetenv("SHOAL_BENCH_POPULARITY");
  ::unsetenv("SHOAL_BENCH_BATCH");
  EXPECT_TRUE(cmd->parsed());
  EXPECT_EQ(f.rates, "10,20");
  EXPECT_EQ(f.models, "a,b");
  EXPECT_EQ(f.api_key, "k");
  EXPECT_EQ(f.popularity, "zipf:1.3");
  EXPECT_EQ(f.batch, 4);
  EXPECT_THAT(cmd->help(), HasSubstr("plain HTTP only"));
}

// Integers are plain decimal: CLI11 alone reads "010" as 8, "0x10" as 16,
// and "-1" into an unsigned option as its largest value.
TEST(BenchCommand, IntegerOptionsAreDecimal) {
  struct Case {
    std::vector<std::string> args;
    bool ok;
    int batch;
    uint64_t seed;
  };
  const Case cases[] = {
      {{"--batch", "010"}, true, 10, 1},
      {{"--batch", "0"}, true, 0, 1},  // in range for the parser; RunBenchCommand refuses it
      {{"--seed", "00"}, true, 1, 0},
      {{"--batch", "-3"}, true, -3, 1},
      {{"--batch", "0x10"}, false, 0, 0},
      {{"--batch", "1e3"}, false, 0, 0},
      {{"--batch", ""}, false, 0, 0},
      {{"--seed", "-1"}, false, 0, 0},
  };
  for (const Case& c : cases) {
    CLI::App app;
    BenchCommandFlags f;
    AddBenchCommand(&app, &f);
    std::vector<std::string> args = {"shoal", "bench"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    const std::string what = c.args[0] + " '" + c.args[1] + "'";
    if (!c.ok) {
      EXPECT_THROW(app.parse(static_cast<int>(argv.size()), argv.data()), CLI::ValidationError) << what;
      continue;
    }
    ASSERT_NO_THROW(app.parse(static_cast<int>(argv.size()), argv.data())) << what;
    EXPECT_EQ(f.batch, c.batch) << what;
    EXPECT_EQ(f.seed, c.seed) << what;
  }
}

// A Shoal-like target: /v1/models, /v1/embeddings (model "busy" gets 429),
// and, when `workers` is set, /v1/workers with one worker busy half the time.
class Target {
 public:
  explicit Target(bool workers)
      : t0_(std::chrono::steady_clock::now()), server_([this, workers](const FakeOpenAiServer::Request& r) {
          return Answer(r, workers);
        }) {}
  FakeOpenAiServer& server() { return server_; }

 private:
  FakeOpenAiServer::Reply Answer(const FakeOpenAiServer::Request& r, bool workers) {
    if (r.method == "GET" && r.target == "/v1/models") {
      // An empty id and a model for another task are not benchmarked.
      return {200, R"({"object":"list","data":[{"id":"alpha","task":"embed"},{"id":"beta"},{"id":"busy"},)"
                   R"({"id":""},{"id":"ranker","task":"score"}]})"};
    }
    if (r.method == "GET" && r.target == "/v1/workers" && workers) {
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      json body = {{"object", "list"},
                   {"data", {{{"id", "w-1"}, {"busy_seconds", t}, {"device_slots", 2}}}}};
      return {200, body.dump()};
    }
    if (r.method == "POST" && r.target == "/v1/embeddings") {
      if (json::parse(r.body).value("model", "") == "busy") return {429, R"({"error":{"message":"queue full"}})"};
      return FakeOpenAiServer::Embeddings(r.body);
    }
    return {404, R"({"error":{"message":"no route"}})"};
  }

  std::chrono::steady_clock::time_point t0_;
  FakeOpenAiServer server_;
};

TEST(BenchCommand, ClosedLoopAgainstARealServer) {
  Target target(/*workers=*/true);
  TempOut dir;
  BenchCommandFlags f;
  f.url = target.server().url();
  f.closed = "2";
  f.warmup_s = 0.2;
  f.duration_s = 1.0;
  f.models = "alpha,beta,busy";
  f.popularity = "zipf:1.1";
  f.input_words = "uniform:3:5";
  f.batch = 2;
  f.api_key = "sk-bench";
  f.out_dir = dir.path();
  const BenchRun r = Bench(f);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("[2 clients]"));  // live progress lines
  EXPECT_THAT(r.out, HasSubstr("429="));

  // What the server saw.
  std::map<std::string, int> sent, answered_ok;
  int posts = 0;
  for (const auto& req : target.server().requests()) {
    if (req.method != "POST") continue;
    ++posts;
    EXPECT_EQ(req.target, "/v1/embeddings");
    EXPECT_EQ(req.authorization, "Bearer sk-bench");
    const json body = json::parse(req.body);
    ASSERT_TRUE(body["input"].is_array());
    ASSERT_EQ(body["input"].size(), 2u);
    for (const auto& text : body["input"]) {
      const std::string t = text.get<std::string>();
      const auto words = std::count(t.begin(), t.end(), ' ') + 1;
      EXPECT_GE(words, 3);
      EXPECT_LE(words, 5);
    }
    ++sent[body["model"].get<std::string>()];
  }
  ASSERT_GT(posts, 30);
  EXPECT_GT(sent["alpha"], sent["beta"]);
  EXPECT_GT(sent["beta"], sent["busy"]);
  EXPECT_GT(sent["busy"], 0);

  // What the report says: a subset of that (the measured window), with the
  // 429s of "busy" as its only errors.
  const json j = ReadJson(dir.path() + "/results.json");
  ASSERT_EQ(j["phases"].size(), 1u);
  const json& p = j["phases"][0];
  EXPECT_EQ(p["mode"], "closed");
  EXPECT_EQ(p["clients"], 2);
  const int64_t completed = p["completed"];
  const int64_t errors = p["errors"];
  EXPECT_GT(completed, 0);
  EXPECT_LE(completed + errors, posts);
  EXPECT_EQ(p["per_model"]["alpha"]["completed"].get<int64_t>() + p["per_model"]["beta"]["completed"].get<int64_t>(),
            completed);
  EXPECT_EQ(p["per_model"]["busy"]["completed"], 0);
  EXPECT_EQ(p["per_model"]["busy"]["errors"], errors);
  EXPECT_EQ(p["errors_by_status"]["429"], errors);
  EXPECT_EQ(p["errors_by_status"].size(), 1u);
  EXPECT_LE(p["per_model"]["alpha"]["completed"].get<int64_t>(), sent["alpha"]);
  EXPECT_DOUBLE_EQ(p["throughput"]["inputs_per_s"].get<double>(),
                   2 * p["throughput"]["requests_per_s"].get<double>());
  EXPECT_EQ(j["settings"]["authorization"], "bearer (redacted)");
  EXPECT_THAT(j.dump(), ::testing::Not(HasSubstr("sk-bench")));

  // Utilisation: busy_seconds grows at wall-clock speed over 2 slots.
  ASSERT_TRUE(j.contains("utilisation"));
  const json& points = j["utilisation"]["workers"]["w-1"];
  ASSERT_GE(points.size(), 1u);
  for (const auto& pt : points) EXPECT_NEAR(pt["utilisation"].get<double>(), 0.5, 0.1);
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/utilisation.svg"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/throughput.svg"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/latency.svg"));
}

// A progress line sums up the second before it: the line at 1.0 s after a
// 1 s warm-up covers warm-up only (it was labelled "measure", the tick
// landing a moment after the warm-up's end).
TEST(BenchCommand, ProgressLinesNameThePhaseOfTheSecondTheyCover) {
  Target target(/*workers=*/false);
  TempOut dir;
  BenchCommandFlags f;
  f.url = target.server().url();
  f.closed = "1";
  f.warmup_s = 1.0;
  f.duration_s = 1.6;
  f.models = "alpha";
  f.workers_path = "off";
  f.out_dir = dir.path();
  const BenchRun r = Bench(f);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, ::testing::ContainsRegex("\\[1 clients?\\] +1\\.[0-9]s warm-up")) << r.err;
  EXPECT_THAT(r.err, ::testing::ContainsRegex("\\[1 clients?\\] +2\\.[0-9]s measure")) << r.err;
}

TEST(BenchCommand, OpenLoopRatesModelsFromTheTargetAndNoWorkersEndpoint) {
  Target target(/*workers=*/false);
  TempOut dir;
  BenchCommandFlags f;
  f.url = target.server().url();
  f.rates = "40,80";
  f.warmup_s = 0.1;
  f.duration_s = 0.5;
  f.out_dir = dir.path();
  f.quiet = true;
  ::setenv("OPENAI_API_KEY", "from-env", 1);
  const BenchRun r = Bench(f);
  ::unsetenv("OPENAI_API_KEY");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("[rate")));  // --quiet
  std::map<std::string, int> sent;
  for (const auto& req : target.server().requests()) {
    EXPECT_EQ(req.authorization, "Bearer from-env") << req.target;
    if (req.method == "POST") ++sent[json::parse(req.body)["model"].get<std::string>()];
  }
  // Every embedding model GET /v1/models listed got traffic, and only those.
  EXPECT_GT(sent["alpha"], 0);
  EXPECT_GT(sent["beta"], 0);
  EXPECT_GT(sent["busy"], 0);
  EXPECT_EQ(sent.size(), 3u);
  const json j = ReadJson(dir.path() + "/results.json");
  ASSERT_EQ(j["phases"].size(), 2u);
  EXPECT_EQ(j["phases"][0]["offered_rate"], 40.0);
  EXPECT_EQ(j["phases"][1]["offered_rate"], 80.0);
  for (const auto& p : j["phases"]) {
    EXPECT_EQ(p["mode"], "open");
    EXPECT_EQ(p["completed"].get<int64_t>() + p["errors"].get<int64_t>() + p["dropped"].get<int64_t>(),
              p["sent"].get<int64_t>());
    EXPECT_EQ(p["errors"], p["per_model"]["busy"]["errors"]);
  }
  EXPECT_FALSE(j.contains("utilisation"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/utilisation.svg"));
}

TEST(BenchCommand, UnreachableTargetFails) {
  // A port that was free a moment ago: nothing listens there.
  int port = 0;
  {
    FakeOpenAiServer s([](const FakeOpenAiServer::Request&) { return FakeOpenAiServer::Reply{}; });
    port = s.port();
  }
  TempOut dir;
  BenchCommandFlags f;
  f.url = "http://127.0.0.1:" + std::to_string(port);
  f.out_dir = dir.path();
  const BenchRun listing = Bench(f);  // no --models: needs GET /v1/models
  EXPECT_EQ(listing.code, 1);
  EXPECT_THAT(listing.err, HasSubstr("cannot list the models"));
  f.models = "m";
  f.duration_s = 0.2;
  f.warmup_s = 0;
  f.quiet = true;
  const BenchRun run = Bench(f);
  EXPECT_EQ(run.code, 1);
  EXPECT_THAT(run.err, HasSubstr("no request got an HTTP answer"));
}

// A target that answers every request with an error measured nothing:
// the run says so and exits 1 (the report is still written).
TEST(BenchCommand, EveryRequestFailingFails) {
  FakeOpenAiServer s([](const FakeOpenAiServer::Request&) {
    FakeOpenAiServer::Reply r;
    r.status = 404;
    r.body = R"({"error":{"message":"The model 'nope' does not exist","code":"model_not_found"}})";
    return r;
  });
  TempOut dir;
  BenchCommandFlags f;
  f.url = "http://127.0.0.1:" + std::to_string(s.port());
  f.out_dir = dir.path();
  f.models = "nope";
  f.duration_s = 0.3;
  f.warmup_s = 0;
  f.quiet = true;
  const BenchRun run = Bench(f);
  EXPECT_EQ(run.code, 1);
  EXPECT_THAT(run.err, HasSubstr("every request to"));
}

// An --out that cannot be written fails before any load is sent, not
// after the whole run.
TEST(BenchCommand, AnUnwritableOutFailsBeforeTheLoad) {
  Target target(/*workers=*/false);
  TempOut dir;
  const std::string file = dir.path() + "/a-file";
  std::ofstream(file) << "x";
  BenchCommandFlags f;
  f.url = target.server().url();
  f.models = "alpha";
  f.out_dir = file + "/out";  // under a file: cannot be created
  f.duration_s = 5;
  f.quiet = true;
  const BenchRun run = Bench(f);
  EXPECT_EQ(run.code, 1);
  EXPECT_THAT(run.err, HasSubstr("cannot create " + f.out_dir));
  for (const auto& req : target.server().requests()) EXPECT_NE(req.method, "POST");
}

// A target slower than the window answered, just not inside it: the run
// says so, not that the target is not running.
TEST(BenchCommand, AnswersOnlyAfterTheWindowAreNamedAsSuch) {
  FakeOpenAiServer s([](const FakeOpenAiServer::Request& r) {
    FakeOpenAiServer::Reply reply = FakeOpenAiServer::Embeddings(r.body);
    reply.delay_ms = 800;
    return reply;
  });
  TempOut dir;
  BenchCommandFlags f;
  f.url = "http://127.0.0.1:" + std::to_string(s.port());
  f.out_dir = dir.path();
  f.models = "slow";
  f.closed = "2";
  f.duration_s = 0.3;
  f.warmup_s = 0;
  f.quiet = true;
  const BenchRun run = Bench(f);
  EXPECT_EQ(run.code, 1);
  EXPECT_THAT(run.err, HasSubstr("answers came after it (lengthen --duration)"));
  EXPECT_THAT(run.err, ::testing::Not(HasSubstr("is it running")));
}

}  // namespace
}  // namespace shoal
