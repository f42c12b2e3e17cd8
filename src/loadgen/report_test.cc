#include "loadgen/report.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace shoal::loadgen {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

LoadResult Result(int64_t completed, int64_t errors_429, double window_s) {
  LoadResult r;
  r.window_s = window_s;
  r.completed = completed;
  r.answered_in_window = completed;
  r.errors = errors_429 + 1;
  r.errors_by_status = {{429, errors_429}, {0, 1}};
  r.due = completed + r.errors;
  r.prompt_tokens = completed * 10;
  for (int64_t i = 1; i <= completed; ++i) r.latencies_ms.push_back(static_cast<double>(i));
  r.per_tag = {{completed, 0}, {0, errors_429 + 1}};
  return r;
}

BenchReport TwoRates() {
  BenchReport b;
  b.target = "http://127.0.0.1:8080";
  b.path = "/v1/embeddings";
  b.started_utc = "2026-12-01T00:00:00Z";
  b.settings = {{"popularity", "zipf:1.1"}};
  b.phases.push_back(SummarizePhase("open", 100, 0, Result(200, 3, 2), {"a", "b"}, 4));
  b.phases.push_back(SummarizePhase("open", 50, 0, Result(100, 0, 2), {"a", "b"}, 4));
  return b;
}

TEST(Report, SummarizesAPhase) {
  const PhaseReport p = SummarizePhase("open", 100, 0, Result(200, 3, 2), {"a", "b"}, 4);
  EXPECT_DOUBLE_EQ(p.requests_per_s, 100);
  EXPECT_DOUBLE_EQ(p.inputs_per_s, 400);
  EXPECT_DOUBLE_EQ(p.prompt_tokens_per_s, 1000);
  EXPECT_DOUBLE_EQ(p.p50_ms, 100);
  EXPECT_DOUBLE_EQ(p.p99_ms, 198);
  EXPECT_DOUBLE_EQ(p.max_ms, 200);
  EXPECT_DOUBLE_EQ(p.mean_ms, 100.5);
  EXPECT_EQ(p.sent, 204);
  EXPECT_EQ(p.errors_by_status.at("429"), 3);
  EXPECT_EQ(p.errors_by_status.at("transport"), 1);
  ASSERT_EQ(p.per_model.size(), 2u);
  EXPECT_EQ(p.per_model[1].model, "b");
  EXPECT_EQ(p.per_model[1].errors, 4);
}

TEST(Report, JsonHasEveryField) {
  BenchReport b = TwoRates();
  auto j = nlohmann::json::parse(ReportJson(b));
  EXPECT_EQ(j["tool"], "shoal bench");
  EXPECT_EQ(j["target"], "http://127.0.0.1:8080");
  EXPECT_EQ(j["settings"]["popularity"], "zipf:1.1");
  ASSERT_EQ(j["phases"].size(), 2u);
  const auto& p = j["phases"][0];
  EXPECT_EQ(p["mode"], "open");
  EXPECT_EQ(p["offered_rate"], 100.0);
  EXPECT_FALSE(p.contains("clients"));
  EXPECT_EQ(p["completed"], 200);
  EXPECT_EQ(p["errors"], 4);
  EXPECT_EQ(p["errors_by_status"]["429"], 3);
  EXPECT_EQ(p["throughput"]["requests_per_s"], 100.0);
  EXPECT_EQ(p["throughput"]["inputs_per_s"], 400.0);
  for (const char* k : {"p50", "p90", "p99", "max", "mean"}) EXPECT_TRUE(p["latency_ms"].contains(k)) << k;
  EXPECT_EQ(p["per_model"]["a"]["completed"], 200);
  EXPECT_FALSE(j.contains("utilisation"));

  b.utilisation_available = true;
  b.utilisation["w-1"] = {{0.5, 0.25}, {1.5, 0.75}};
  j = nlohmann::json::parse(ReportJson(b));
  ASSERT_TRUE(j.contains("utilisation"));
  EXPECT_EQ(j["utilisation"]["workers"]["w-1"][1]["utilisation"], 0.75);

  // The first error quotes the target's answer, cut at 200 bytes, possibly
  // inside a character: the report is still written, U+FFFD for the byte.
  b.phases[0].first_error = "HTTP 404: The model 'x\xc3";
  j = nlohmann::json::parse(ReportJson(b));
  EXPECT_EQ(j["phases"][0]["first_error"], "HTTP 404: The model 'x\xef\xbf\xbd");
}

// Crude well-formedness: one root, every opened element closed in order.
void ExpectBalancedSvg(const std::string& svg) {
  ASSERT_THAT(svg, StartsWith("<svg "));
  std::vector<std::string> stack;
  size_t i = 0;
  while ((i = svg.find('<', i)) != std::string::npos) {
    const size_t end = svg.find('>', i);
    ASSERT_NE(end, std::string::npos);
    std::string tag = svg.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty()) FAIL() << "empty tag";
    if (tag.front() == '/') {
      ASSERT_FALSE(stack.empty()) << tag;
      EXPECT_EQ(stack.back(), tag.substr(1));
      stack.pop_back();
    } else if (tag.back() != '/') {
      stack.push_back(tag.substr(0, tag.find(' ')));
    }
  }
  EXPECT_TRUE(stack.empty());
  EXPECT_THAT(svg, Not(HasSubstr("nan")));
  EXPECT_THAT(svg, Not(HasSubstr("inf")));
}

TEST(Report, SvgPlotsAreWellFormedWithTheirSeriesAndAxes) {
  BenchReport b = TwoRates();
  const std::string t = ThroughputSvg(b);
  ExpectBalancedSvg(t);
  EXPECT_THAT(t, HasSubstr("offered load (requests/s)"));
  EXPECT_THAT(t, HasSubstr("completed requests/s"));
  EXPECT_THAT(t, HasSubstr("data-name=\"achieved\""));
  EXPECT_THAT(t, HasSubstr("data-name=\"offered\""));
  const std::string l = LatencySvg(b);
  ExpectBalancedSvg(l);
  EXPECT_THAT(l, HasSubstr("data-name=\"p50\""));
  EXPECT_THAT(l, HasSubstr("data-name=\"p99\""));
  EXPECT_THAT(l, HasSubstr("latency (ms)"));
  EXPECT_EQ(UtilisationSvg(b), "");

  b.utilisation_available = true;
  b.utilisation["w<1>"] = {{0.5, 0.25}, {1.5, 0.75}};
  const std::string u = UtilisationSvg(b);
  ExpectBalancedSvg(u);
  EXPECT_THAT(u, HasSubstr("data-name=\"w&lt;1&gt;\""));
  EXPECT_THAT(u, HasSubstr("time since start (s)"));
  EXPECT_THAT(u, HasSubstr("class=\"phase\""));  // the phases' windows
  EXPECT_THAT(u, HasSubstr(">100/s<"));

  BenchReport closed;
  closed.phases.push_back(SummarizePhase("closed", 0, 4, Result(10, 0, 1), {"a"}, 1));
  const std::string c = ThroughputSvg(closed);
  ExpectBalancedSvg(c);
  EXPECT_THAT(c, HasSubstr("concurrent clients"));
  EXPECT_THAT(c, Not(HasSubstr("data-name=\"offered\"")));
  ExpectBalancedSvg(LatencySvg(BenchReport{}));
}

TEST(Report, WritesTheFiles) {
  const auto dir = std::filesystem::temp_directory_path() / ("shoal-report-test-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::string> written;
  ASSERT_TRUE(WriteReport(TwoRates(), (dir / "sub").string(), &written).ok());
  EXPECT_EQ(written.size(), 3u);
  std::ifstream f(dir / "sub" / "results.json");
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_EQ(nlohmann::json::parse(text.str())["phases"].size(), 2u);
  EXPECT_TRUE(std::filesystem::exists(dir / "sub" / "latency.svg"));
  EXPECT_FALSE(std::filesystem::exists(dir / "sub" / "utilisation.svg"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shoal::loadgen
