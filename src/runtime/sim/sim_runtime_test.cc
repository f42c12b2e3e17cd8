#include "runtime/sim/sim_runtime.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

namespace shoal {
namespace {

ModelConfig SimModel() {
  ModelConfig c;
  c.name = "sim";
  c.runtime = "sim";
  c.dim = 8;
  c.sim.fixed_us = 1000;
  c.sim.per_padded_token_us = 2.5;
  c.sim.max_batch_rows = 4;
  c.sim.memory_bytes = 12345;
  c.sim.load_ms = 7;
  return c;
}

TokenBatch Batch(int rows, int seq_len, int64_t first_id = 100) {
  TokenBatch b;
  b.rows = rows;
  b.seq_len = seq_len;
  for (int i = 0; i < rows * seq_len; ++i) {
    b.input_ids.push_back(first_id + i % seq_len);
    b.attention_mask.push_back(1);
  }
  return b;
}

TEST(SimRuntime, SleepsByTheCostModelAndReportsItsFootprint) {
  std::vector<int64_t> slept;
  SimRuntime rt([&](int64_t us) { slept.push_back(us); });
  ASSERT_TRUE(rt.Load(SimModel()).ok());
  EXPECT_EQ(slept, std::vector<int64_t>{7000});  // load_ms
  EXPECT_EQ(rt.MemoryBytes(), 12345);
  EXPECT_EQ(rt.Dim(), 8);
  ASSERT_TRUE(rt.Run(Batch(3, 10)).ok());
  EXPECT_EQ(slept.back(), 1000 + 75);  // fixed + 2.5 us x 30 padded tokens
  EXPECT_EQ(rt.CostUs(4, 100), 1000 + 1000);
}

TEST(SimRuntime, EmbeddingsAreDeterministicNormalisedAndPerRow) {
  SimRuntime rt([](int64_t) {});
  ASSERT_TRUE(rt.Load(SimModel()).ok());
  auto a = rt.Run(Batch(2, 5));
  auto b = rt.Run(Batch(2, 5));
  auto c = rt.Run(Batch(1, 5, 900));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->data, b->data);  // same tokens, same vectors
  double norm = 0;
  for (int k = 0; k < 8; ++k) norm += a->data[k] * a->data[k];
  EXPECT_NEAR(norm, 1.0, 1e-5);
  EXPECT_NE(std::vector<float>(a->data.begin(), a->data.begin() + 8), c->data);  // other tokens, other vector
  // Padding does not change a row's vector.
  TokenBatch padded = Batch(1, 7);
  padded.input_ids[5] = padded.input_ids[6] = 0;
  padded.attention_mask[5] = padded.attention_mask[6] = 0;
  auto p = rt.Run(padded);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->data, std::vector<float>(a->data.begin(), a->data.begin() + 8));
}

TEST(SimRuntime, RejectsOversizedAndMalformedBatches) {
  SimRuntime rt([](int64_t) {});
  ASSERT_TRUE(rt.Load(SimModel()).ok());
  EXPECT_EQ(rt.Run(Batch(5, 4)).status().code(), StatusCode::kInvalidArgument);  // max_batch_rows 4
  TokenBatch bad = Batch(2, 4);
  bad.input_ids.pop_back();
  EXPECT_EQ(rt.Run(bad).status().code(), StatusCode::kInvalidArgument);
  ModelConfig no_dim = SimModel();
  no_dim.dim = 0;
  SimRuntime other([](int64_t) {});
  EXPECT_EQ(other.Load(no_dim).code(), StatusCode::kInvalidArgument);
}

TEST(SimRuntime, ConfigParsesTheProfile) {
  auto c = ParseModelConfig(R"({"name":"s","runtime":"sim","dim":16,
      "sim":{"fixed_us":50,"per_padded_token_us":0.5,"max_batch_rows":32,"memory_bytes":1000,"load_ms":2}})", "/m");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->sim.fixed_us, 50);
  EXPECT_DOUBLE_EQ(c->sim.per_padded_token_us, 0.5);
  EXPECT_EQ(c->sim.max_batch_rows, 32);
  EXPECT_FALSE(ParseModelConfig(R"({"name":"s","runtime":"sim"})", "/m").ok());  // no dim
  EXPECT_FALSE(ParseModelConfig(R"({"name":"s","runtime":"sim","dim":4,"sim":{"fixed_us":-1}})", "/m").ok());
  auto rt = CreateRuntime("sim");
  EXPECT_TRUE(rt.ok());
}

}  // namespace
}  // namespace shoal
