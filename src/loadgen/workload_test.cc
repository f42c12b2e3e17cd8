#include "loadgen/workload.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace shoal::loadgen {
namespace {

using ::testing::HasSubstr;

TEST(Popularity, ParsesUniformAndZipf) {
  auto u = ParsePopularity("uniform");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->kind, Popularity::Kind::kUniform);
  auto z = ParsePopularity("zipf:1.3");
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->kind, Popularity::Kind::kZipf);
  EXPECT_DOUBLE_EQ(z->s, 1.3);
  auto plain = ParsePopularity("zipf");
  ASSERT_TRUE(plain.ok());
  EXPECT_DOUBLE_EQ(plain->s, 1.1);
  EXPECT_EQ(z->ToString(), "zipf:1.3");
}

TEST(Popularity, RejectsBadSpecsWithAClearMessage) {
  for (const char* bad : {"", "zipf:", "zipf:0", "zipf:-1", "zipf:abc", "zipf:1.1x", "pareto", "uniform:2"}) {
    auto p = ParsePopularity(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(p.status().message(), HasSubstr("zipf:S")) << bad;
  }
}

TEST(ModelSampler, ZipfRankOneShareMatchesTheAnalyticValue) {
  constexpr int kModels = 20;
  constexpr double kS = 1.1;
  auto sampler = ModelSampler::Create(kModels, {Popularity::Kind::kZipf, kS});
  ASSERT_TRUE(sampler.ok());
  double h = 0;
  for (int k = 1; k <= kModels; ++k) h += 1.0 / std::pow(k, kS);
  const double want_first = 1.0 / h;                       // about 0.282
  const double want_tenth = 1.0 / std::pow(10, kS) / h;    // about 0.022
  EXPECT_NEAR(sampler->Probability(0), want_first, 1e-12);

  std::mt19937_64 rng(42);
  constexpr int kDraws = 200000;
  std::vector<int> counts(kModels, 0);
  for (int i = 0; i < kDraws; ++i) ++counts.at(sampler->Sample(rng));
  // Binomial standard deviation at 200k draws is about 0.001 for rank 1.
  EXPECT_NEAR(counts[0] / double(kDraws), want_first, 0.005);
  EXPECT_NEAR(counts[9] / double(kDraws), want_tenth, 0.002);
  for (int k = 1; k < kModels; ++k) EXPECT_LT(counts[k], counts[0]) << "rank " << k + 1;
}

TEST(ModelSampler, UniformIsFlat) {
  auto sampler = ModelSampler::Create(5, Popularity{});
  ASSERT_TRUE(sampler.ok());
  std::mt19937_64 rng(7);
  std::vector<int> counts(5, 0);
  for (int i = 0; i < 100000; ++i) ++counts.at(sampler->Sample(rng));
  for (int k = 0; k < 5; ++k) {
    EXPECT_NEAR(sampler->Probability(k), 0.2, 1e-12);
    EXPECT_NEAR(counts[k] / 100000.0, 0.2, 0.01) << k;
  }
}

TEST(ModelSampler, NeedsAModel) {
  EXPECT_EQ(ModelSampler::Create(0, Popularity{}).status().code(), StatusCode::kInvalidArgument);
}

TEST(LengthDistribution, FixedUniformAndLognormalStayInBoundsWithTheirMeans) {
  std::mt19937_64 rng(3);
  auto fixed = ParseLengthDistribution("fixed:12");
  ASSERT_TRUE(fixed.ok());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(fixed->Sample(rng), 12);

  auto uni = ParseLengthDistribution("uniform:5:9");
  ASSERT_TRUE(uni.ok());
  double sum = 0;
  std::map<int, int> seen;
  for (int i = 0; i < 20000; ++i) {
    const int w = uni->Sample(rng);
    ASSERT_GE(w, 5);
    ASSERT_LE(w, 9);
    ++seen[w];
    sum += w;
  }
  EXPECT_EQ(seen.size(), 5u);
  EXPECT_NEAR(sum / 20000, 7.0, 0.1);

  auto logn = ParseLengthDistribution("lognormal:40:0.5");
  ASSERT_TRUE(logn.ok());
  sum = 0;
  for (int i = 0; i < 50000; ++i) {
    const int w = logn->Sample(rng);
    ASSERT_GE(w, 1);
    ASSERT_LE(w, LengthDistribution::kMaxWords);
    sum += w;
  }
  EXPECT_NEAR(sum / 50000, 40.0, 1.0);
  EXPECT_DOUBLE_EQ(logn->Mean(), 40.0);
}

TEST(LengthDistribution, RejectsBadSpecs) {
  for (const char* bad : {"", "fixed", "fixed:0", "fixed:2.5", "uniform:9:5", "uniform:3", "lognormal:0:1",
                          "lognormal:10", "gamma:1:2", "fixed:100000"}) {
    auto d = ParseLengthDistribution(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_THAT(d.status().message(), HasSubstr("fixed:N")) << bad;
  }
}

TEST(Workload, BuildsOpenAiRequestsDeterministically) {
  WorkloadOptions o;
  o.models = {"a", "b", "c"};
  o.popularity = {Popularity::Kind::kZipf, 1.0};
  o.lengths = *ParseLengthDistribution("uniform:2:6");
  o.inputs_per_request = 3;
  o.host_header = "example:8080";
  o.api_key = "sk-test";
  o.pool_size = 300;
  o.seed = 9;
  auto w = BuildWorkload(o);
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->requests.size(), 300u);
  ASSERT_EQ(w->tags.size(), 300u);
  std::vector<int> per_model(3, 0);
  for (size_t i = 0; i < w->requests.size(); ++i) {
    const std::string& r = w->requests[i];
    ASSERT_EQ(r.rfind("POST /v1/embeddings HTTP/1.1\r\n", 0), 0u);
    EXPECT_THAT(r, HasSubstr("Host: example:8080\r\n"));
    EXPECT_THAT(r, HasSubstr("Authorization: Bearer sk-test\r\n"));
    const size_t split = r.find("\r\n\r\n");
    ASSERT_NE(split, std::string::npos);
    const std::string body = r.substr(split + 4);
    EXPECT_THAT(r, HasSubstr("Content-Length: " + std::to_string(body.size()) + "\r\n"));
    auto j = nlohmann::json::parse(body);
    EXPECT_EQ(j["model"], o.models.at(static_cast<size_t>(w->tags[i])));
    ASSERT_TRUE(j["input"].is_array());
    ASSERT_EQ(j["input"].size(), 3u);
    for (const auto& text : j["input"]) {
      const std::string t = text.get<std::string>();
      const auto words = std::count(t.begin(), t.end(), ' ') + 1;
      EXPECT_GE(words, 2);
      EXPECT_LE(words, 6);
    }
    ++per_model[static_cast<size_t>(w->tags[i])];
  }
  EXPECT_GT(per_model[0], per_model[1]);
  EXPECT_GT(per_model[1], per_model[2]);
  auto again = BuildWorkload(o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->requests, w->requests);
  o.seed = 10;
  auto other = BuildWorkload(o);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->requests, w->requests);
}

// A --models name or a text that is not UTF-8 gets U+FFFD in the body
// instead of ending the run in an exception.
TEST(Workload, BodiesOfBytesThatAreNotUtf8AreStillJson) {
  const auto body = nlohmann::json::parse(EmbeddingsBody("m\xff", {"a\xc3"}));
  EXPECT_EQ(body["model"], "m\xef\xbf\xbd");
  EXPECT_EQ(body["input"][0], "a\xef\xbf\xbd");
}

TEST(Workload, NoKeyNoAuthorizationAndBadOptionsFail) {
  WorkloadOptions o;
  o.models = {"m"};
  o.pool_size = 4;
  auto w = BuildWorkload(o);
  ASSERT_TRUE(w.ok());
  EXPECT_THAT(w->requests[0], ::testing::Not(HasSubstr("Authorization")));
  o.models.clear();
  EXPECT_EQ(BuildWorkload(o).status().code(), StatusCode::kInvalidArgument);
  o.models = {"m"};
  o.inputs_per_request = 0;
  EXPECT_EQ(BuildWorkload(o).status().code(), StatusCode::kInvalidArgument);
  o.inputs_per_request = 1;
  o.api_key = "a\r\nInjected: yes";
  EXPECT_EQ(BuildWorkload(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shoal::loadgen
