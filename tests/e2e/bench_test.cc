// End to end: the built `shoal bench` against a real `shoal serve` (private
// nats-server -js, worker with libtorch and tiny-bert, gateway), checking
// the results.json it writes.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "e2e/shoal_cluster.h"
#include "support/test_env.h"

namespace shoal::e2e {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

json ReadJson(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return json::parse(s.str());
}

TEST(E2eBench, ClosedAndOpenLoopAgainstShoalServe) {
  shoal::testing::TempDir dir;
  Shoal serve = StartServe(dir.path(), {"--models", "tiny-bert", "--threads", "1"});
  ASSERT_EQ(WaitForReadyz(serve.port, 200, 60s), 200);
  const std::string url = "http://127.0.0.1:" + std::to_string(serve.port);

  // Models from GET /v1/models, closed loop.
  const std::string closed_out = dir.path() + "/closed";
  CliRun closed = RunShoal({"bench", "--url", url, "--closed", "2", "--warmup", "0.3", "--duration", "1",
                            "--input-words", "uniform:4:12", "--batch", "2", "--quiet", "--out", closed_out});
  ASSERT_EQ(closed.exit_code, 0) << closed.out;
  EXPECT_NE(closed.out.find("wrote "), std::string::npos) << closed.out;
  json j = ReadJson(closed_out + "/results.json");
  ASSERT_EQ(j["phases"].size(), 1u);
  const json& c = j["phases"][0];
  EXPECT_EQ(c["clients"], 2);
  EXPECT_GT(c["completed"].get<int64_t>(), 0);
  EXPECT_EQ(c["errors"], 0) << c.dump();
  EXPECT_EQ(c["per_model"]["tiny-bert"]["completed"], c["completed"]);
  // Shoal counts [CLS] and [SEP]: at least 6 tokens per 4-word input.
  EXPECT_GE(c["throughput"]["prompt_tokens_per_s"].get<double>(),
            6 * c["throughput"]["inputs_per_s"].get<double>());
  EXPECT_GT(c["latency_ms"]["p50"].get<double>(), 0);
  EXPECT_TRUE(std::filesystem::exists(closed_out + "/throughput.svg"));

  // An unknown model next to a real one, open loop: Shoal's 404s are
  // counted by status and by model.
  const std::string open_out = dir.path() + "/open";
  CliRun open = RunShoal({"bench", "--url", url, "--rate", "40", "--warmup", "0.2", "--duration", "1", "--models",
                          "tiny-bert,no-such-model", "--quiet", "--out", open_out});
  ASSERT_EQ(open.exit_code, 0) << open.out;
  j = ReadJson(open_out + "/results.json");
  const json& o = j["phases"][0];
  EXPECT_EQ(o["offered_rate"], 40.0);
  EXPECT_GT(o["per_model"]["tiny-bert"]["completed"].get<int64_t>(), 0);
  EXPECT_EQ(o["per_model"]["tiny-bert"]["errors"], 0);
  EXPECT_EQ(o["per_model"]["no-such-model"]["completed"], 0);
  EXPECT_GT(o["per_model"]["no-such-model"]["errors"].get<int64_t>(), 0);
  EXPECT_EQ(o["errors_by_status"]["404"], o["per_model"]["no-such-model"]["errors"]);
  EXPECT_EQ(o["completed"].get<int64_t>() + o["errors"].get<int64_t>() + o["dropped"].get<int64_t>(),
            o["sent"].get<int64_t>());
}

}  // namespace
}  // namespace shoal::e2e
