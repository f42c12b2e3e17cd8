// Integration tests of the score and classify tasks on the pull path: a real
// nats-server -js, the real Worker serving the demo cross-encoder and
// classifier on libtorch, and the gateway's Dispatcher in-process. Expected
// values come from the same tokenizer and model run directly.
#include <algorithm>
#include <cmath>
#include <future>
#include <set>

#include <gtest/gtest.h>

#include "gateway/dispatcher.h"
#include "runtime/runtime.h"
#include "support/test_env.h"
#include "tokenize/wordpiece_tokenizer.h"
#include "worker/worker.h"

namespace shoal {
namespace {

using shoal::testing::ModelsDir;
using shoal::testing::TestNatsServer;

class TaskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NatsOptions no;
    no.url = server_.url();
    auto c = NatsClient::Connect(no);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    WorkerOptions wo;
    wo.model_repository = ModelsDir();
    wo.models = {"tiny-reranker", "tiny-classifier"};
    wo.intra_op_threads = 1;
    auto w = Worker::Create(wo, client_.get(), &metrics_);
    ASSERT_TRUE(w.ok()) << w.status().ToString() << " (run scripts/setup.sh to generate the demo models)";
    worker_ = std::move(w).value();
    DispatcherOptions dopt;
    dopt.chunk_size = 2;  // several queue messages per request
    auto d = Dispatcher::Create(dopt, client_.get(), &metrics_);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dispatcher_ = std::move(d).value();
  }

  Result<EmbedResult> Submit(EmbedJob job) {
    job.deadline_unix_ms = SystemClock::Get()->NowUnixMs() + 20000;
    std::promise<Result<EmbedResult>> p;
    auto f = p.get_future();
    dispatcher_->SubmitEmbed(std::move(job), [&p](Result<EmbedResult> r) { p.set_value(std::move(r)); });
    return f.get();
  }

  // The model's raw output for `encodings`, each run alone (no padding).
  static std::vector<std::vector<float>> Direct(const std::string& name, const std::vector<Encoding>& encodings) {
    auto config = LoadModelConfig(ModelsDir() + "/" + name);
    EXPECT_TRUE(config.ok());
    auto rt = CreateRuntime("torchscript");
    EXPECT_TRUE(rt.ok());
    EXPECT_TRUE((*rt)->Load(*config).ok());
    std::vector<std::vector<float>> out;
    for (const Encoding& e : encodings) {
      TokenBatch b;
      b.rows = 1;
      b.seq_len = static_cast<int>(e.ids.size());
      b.input_ids.assign(e.ids.begin(), e.ids.end());
      b.attention_mask.assign(e.ids.size(), 1);
      b.token_type_ids.assign(e.ids.size(), 0);
      for (size_t t = e.second_start > 0 ? e.second_start : e.ids.size(); t < e.ids.size(); ++t)
        b.token_type_ids[t] = 1;
      auto r = (*rt)->Run(b);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      out.push_back(r.ok() ? r->data : std::vector<float>{});
    }
    return out;
  }

  static std::unique_ptr<WordPieceTokenizer> Tokenizer(const std::string& name) {
    WordPieceOptions o;
    auto t = WordPieceTokenizer::FromFile(ModelsDir() + "/" + name + "/vocab.txt", o);
    EXPECT_TRUE(t.ok());
    return t.ok() ? std::move(t).value() : nullptr;
  }

  TestNatsServer server_;
  MetricsRegistry metrics_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<Dispatcher> dispatcher_;
};

TEST_F(TaskTest, ScoresPairsAsTheCrossEncoderWithSigmoid) {
  const std::string query = "how do workers pull work from the queue";
  const std::vector<std::string> docs = {"workers pull batches from a shared queue",
                                         "the gateway parses requests",
                                         "a completely unrelated sentence about gardens and weather",
                                         "queue"};
  EmbedJob job;
  job.task = "score";
  job.model = "tiny-reranker";
  job.texts.assign(docs.size(), query);
  job.texts_pair = docs;
  auto r = Submit(job);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->rows, 4);
  ASSERT_EQ(r->dim, 1);

  auto tok = Tokenizer("tiny-reranker");
  ASSERT_NE(tok, nullptr);
  std::vector<Encoding> enc;
  int64_t tokens = 0;
  for (const auto& d : docs) {
    enc.push_back(tok->EncodePair(query, d, 256));
    tokens += static_cast<int64_t>(enc.back().ids.size());
  }
  auto logits = Direct("tiny-reranker", enc);
  ASSERT_EQ(logits.size(), docs.size());
  std::set<float> distinct;
  for (size_t i = 0; i < docs.size(); ++i) {
    const float want = 1.0f / (1.0f + std::exp(-logits[i][0]));
    EXPECT_NEAR(r->data[i], want, 1e-4) << "pair " << i;  // batched and padded vs alone
    EXPECT_GT(r->data[i], 0.0f);
    EXPECT_LT(r->data[i], 1.0f);
    distinct.insert(r->data[i]);
  }
  EXPECT_EQ(distinct.size(), docs.size()) << "every pair scored on its own";
  EXPECT_EQ(r->prompt_tokens, tokens);
}

TEST_F(TaskTest, LongPairsAreCutOrRejected) {
  std::string long_doc;
  for (int i = 0; i < 400; ++i) long_doc += "word ";
  EmbedJob job;
  job.task = "score";
  job.model = "tiny-reranker";
  job.texts = {"short query"};
  job.texts_pair = {long_doc};
  job.truncate = false;
  auto refused = Submit(job);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().reason(), "input_too_long");
  job.truncate = true;
  auto cut = Submit(job);
  ASSERT_TRUE(cut.ok()) << cut.status().ToString();
  EXPECT_EQ(cut->prompt_tokens, 256);
  EXPECT_TRUE(cut->truncated_any);
}

TEST_F(TaskTest, ClassifiesWithSoftmaxOverLabels) {
  const std::vector<std::string> texts = {"great product, works well", "terrible", "it is a thing"};
  EmbedJob job;
  job.task = "classify";
  job.model = "tiny-classifier";
  job.texts = texts;
  auto r = Submit(job);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->rows, 3);
  ASSERT_EQ(r->dim, 3);
  auto tok = Tokenizer("tiny-classifier");
  ASSERT_NE(tok, nullptr);
  std::vector<Encoding> enc;
  for (const auto& t : texts) enc.push_back(tok->Encode(t, 256));
  auto logits = Direct("tiny-classifier", enc);
  for (int i = 0; i < 3; ++i) {
    float sum = 0, max = *std::max_element(logits[i].begin(), logits[i].end()), z = 0;
    for (float l : logits[i]) z += std::exp(l - max);
    for (int k = 0; k < 3; ++k) {
      EXPECT_NEAR(r->data[i * 3 + k], std::exp(logits[i][k] - max) / z, 1e-4);
      sum += r->data[i * 3 + k];
    }
    EXPECT_NEAR(sum, 1.0f, 1e-5);
  }
}

TEST_F(TaskTest, WrongShapedWorkGetsAClearError) {
  // Single texts for the pair model, pairs for the classifier, and a task
  // the model does not do: each caller gets an error, nothing hangs.
  EmbedJob single;
  single.task = "score";
  single.model = "tiny-reranker";
  single.texts = {"no pair"};
  auto a = Submit(single);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EmbedJob pairs;
  pairs.task = "classify";
  pairs.model = "tiny-classifier";
  pairs.texts = {"a"};
  pairs.texts_pair = {"b"};
  auto b = Submit(pairs);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EmbedJob embed;
  embed.model = "tiny-classifier";  // task "embed"
  embed.texts = {"a"};
  auto c = Submit(embed);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shoal
