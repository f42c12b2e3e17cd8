#include "runtime/null/null_runtime.h"

#include <cmath>
#include <map>

#include <gtest/gtest.h>
#include <msgpack.hpp>

namespace shoal {
namespace {

TokenBatch Batch(const std::vector<std::vector<int64_t>>& rows) {
  TokenBatch b;
  b.rows = static_cast<int>(rows.size());
  for (const auto& r : rows) b.seq_len = std::max(b.seq_len, static_cast<int>(r.size()));
  for (const auto& r : rows) {
    for (int t = 0; t < b.seq_len; ++t) {
      const bool real = t < static_cast<int>(r.size());
      b.input_ids.push_back(real ? r[t] : 0);
      b.attention_mask.push_back(real ? 1 : 0);
    }
  }
  return b;
}

std::vector<float> Row(const Embeddings& e, int r) {
  return {e.data.begin() + static_cast<long>(r) * e.dim,
          e.data.begin() + static_cast<long>(r + 1) * e.dim};
}

ModelConfig Config(int dim = 0, bool normalize = true) {
  ModelConfig c;
  c.name = "null-test";
  c.runtime = "null";
  c.dim = dim;
  c.normalize = normalize;
  return c;
}

TEST(NullRuntime, DefaultsTo384Dimensions) {
  NullRuntime rt;
  ASSERT_TRUE(rt.Load(Config()).ok());
  EXPECT_EQ(rt.Dim(), 384);
  auto out = rt.Run(Batch({{101, 7592, 102}, {101, 102}}));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->rows, 2);
  EXPECT_EQ(out->dim, 384);
  EXPECT_EQ(out->data.size(), 2u * 384);
  EXPECT_EQ(rt.MemoryBytes(), 0);
}

TEST(NullRuntime, UsesConfiguredDim) {
  NullRuntime rt;
  ASSERT_TRUE(rt.Load(Config(64)).ok());
  EXPECT_EQ(rt.Dim(), 64);
  auto out = rt.Run(Batch({{1, 2, 3}}));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->dim, 64);
}

TEST(NullRuntime, IsDeterministicAndPaddingInvariant) {
  NullRuntime rt;
  ASSERT_TRUE(rt.Load(Config()).ok());
  auto alone = rt.Run(Batch({{101, 2000, 2001, 102}}));
  auto padded = rt.Run(Batch({{101, 1, 2, 3, 4, 5, 6, 102}, {101, 2000, 2001, 102}}));
  ASSERT_TRUE(alone.ok() && padded.ok());
  EXPECT_EQ(Row(*alone, 0), Row(*padded, 1));
  EXPECT_NE(Row(*padded, 0), Row(*padded, 1));
}

TEST(NullRuntime, NormalisesWhenAsked) {
  for (bool normalize : {true, false}) {
    NullRuntime rt;
    ASSERT_TRUE(rt.Load(Config(128, normalize)).ok());
    auto out = rt.Run(Batch({{101, 42, 102}}));
    ASSERT_TRUE(out.ok());
    double sq = 0;
    for (float v : out->data) sq += double(v) * v;
    if (normalize) {
      EXPECT_NEAR(std::sqrt(sq), 1.0, 1e-5);
    } else {
      EXPECT_GT(std::abs(std::sqrt(sq) - 1.0), 1e-3);
    }
  }
}

TEST(NullRuntime, RejectsInconsistentBatch) {
  NullRuntime rt;
  ASSERT_TRUE(rt.Load(Config()).ok());
  TokenBatch bad{2, 3, {1, 2, 3}, {1, 1, 1}, {}};
  auto out = rt.Run(bad);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  auto empty = rt.Run(TokenBatch{});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
}

TEST(NullRuntime, UnloadIsIdempotent) {
  NullRuntime rt;
  ASSERT_TRUE(rt.Load(Config()).ok());
  rt.Unload();
  rt.Unload();
  auto out = rt.Run(Batch({{1}}));
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kUnavailable);
}

TEST(NullRuntime, ItemTasksAnswerEachInputWithItsSize) {
  NullRuntime rt;
  ModelConfig config;
  config.name = "echo";
  config.task = "ocr";
  ASSERT_TRUE(rt.Load(config).ok());
  EXPECT_TRUE(rt.TakesItems());
  auto out = rt.RunItems({std::string(3, 'x'), std::string(70000, 'y')}, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    auto h = msgpack::unpack((*out)[i].data(), (*out)[i].size());
    auto m = h.get().as<std::map<std::string, uint64_t>>();
    EXPECT_EQ(m["bytes"], i == 0 ? 3u : 70000u);
  }
  NullRuntime embed;
  config.task = "embed";
  ASSERT_TRUE(embed.Load(config).ok());
  EXPECT_FALSE(embed.TakesItems());
}

}  // namespace
}  // namespace shoal
