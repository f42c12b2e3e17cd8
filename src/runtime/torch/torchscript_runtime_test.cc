// Needs the demo models: /usr/bin/python3 scripts/make_models.py --out models
// (SHOAL_MODELS_DIR overrides where they are looked for). Fails, rather than
// skips, when they are missing.
#include "runtime/torch/torchscript_runtime.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/script.h>
#include <unistd.h>

#include "common/model_config.h"
#include "common/process_memory.h"
#include "runtime/torch/cuda_memory.h"
#include "runtime/torch/huge_pages.h"

namespace shoal {
namespace {

namespace fs = std::filesystem;

std::string ModelsDir() {
  if (const char* d = std::getenv("SHOAL_MODELS_DIR"); d && *d) return d;
  if (const char* s = std::getenv("SHOAL_SOURCE_DIR"); s && *s) return std::string(s) + "/models";
  return SHOAL_DEFAULT_MODELS_DIR;
}

std::string MissingModelHelp(const std::string& dir) {
  return "demo model not generated in " + dir +
         ". Run scripts/setup.sh, or just /usr/bin/python3 scripts/make_models.py --out models "
         "(from the repository root; set SHOAL_MODELS_DIR to use another repository)";
}

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

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

std::vector<int64_t> RandomSentence(std::mt19937& rng, int len) {
  std::uniform_int_distribution<int64_t> id(1000, 30521);
  std::vector<int64_t> s{101};
  for (int i = 0; i < len - 2; ++i) s.push_back(id(rng));
  s.push_back(102);
  return s;
}

// The VmFlags line of /proc/self/smaps for the mapping that starts at `p`,
// or "" when there is none.
std::string VmFlagsOfMappingAt(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in_it = false;
  while (std::getline(smaps, line)) {
    const size_t dash = line.find('-');
    if (dash != std::string::npos && dash > 0 && line.find(' ') > dash && std::isxdigit(line[0])) {
      in_it = std::stoull(line.substr(0, dash), nullptr, 16) == reinterpret_cast<uintptr_t>(p);
    } else if (in_it && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

class TinyBert : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ModelsDir() + "/tiny-bert";
    ASSERT_TRUE(fs::exists(dir_ + "/model.pt") && fs::exists(dir_ + "/reference.json"))
        << MissingModelHelp(dir_);
    auto config = LoadModelConfig(dir_);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    config_ = *config;
  }

  std::unique_ptr<TorchScriptRuntime> Load(const ModelConfig& config) {
    auto rt = std::make_unique<TorchScriptRuntime>();
    const Status st = rt->Load(config);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return st.ok() ? std::move(rt) : nullptr;
  }

  std::string dir_;
  ModelConfig config_;
};

TEST_F(TinyBert, MatchesPythonReference) {
  std::ifstream in(dir_ + "/reference.json");
  const auto ref = nlohmann::json::parse(in);
  ASSERT_EQ(ref["pooling"], config_.pooling);
  ASSERT_EQ(ref["normalize"], config_.normalize);
  auto rt = Load(config_);
  ASSERT_NE(rt, nullptr);
  EXPECT_EQ(rt->Dim(), 64);

  std::vector<std::vector<int64_t>> inputs;
  std::vector<std::vector<float>> expected;
  for (const auto& item : ref["inputs"]) inputs.push_back(item["input_ids"]);
  for (const auto& e : ref["embeddings"]) expected.push_back(e);
  ASSERT_EQ(inputs.size(), 3u);
  ASSERT_EQ(expected.size(), 3u);

  for (size_t i = 0; i < inputs.size(); ++i) {
    auto out = rt->Run(Batch({inputs[i]}));
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_LT(MaxAbsDiff(Row(*out, 0), expected[i]), 1e-4) << "input " << i;
  }
  // All three in one padded batch agree with the reference too.
  auto batched = rt->Run(Batch(inputs));
  ASSERT_TRUE(batched.ok()) << batched.status().ToString();
  for (int i = 0; i < 3; ++i) EXPECT_LT(MaxAbsDiff(Row(*batched, i), expected[i]), 1e-4);
}

// Installs the huge page allocator for the rest of this process, so the
// tests after it load their models with it too. MiniLM-L6: its 47 MB word
// embeddings are over the 32 MiB threshold.
TEST_F(TinyBert, HugePagesKeepOutputsAndReturnLargeTensorsOnFree) {
  const std::string minilm_dir = ModelsDir() + "/minilm-l6";
  ASSERT_TRUE(fs::exists(minilm_dir + "/model.pt")) << MissingModelHelp(minilm_dir);
  auto minilm = LoadModelConfig(minilm_dir);
  ASSERT_TRUE(minilm.ok()) << minilm.status().ToString();
  std::mt19937 rng(7);
  std::vector<std::vector<int64_t>> inputs;
  for (int i = 0; i < 3; ++i) inputs.push_back(RandomSentence(rng, 5 + 9 * i));
  std::vector<float> before;
  {
    auto rt = Load(*minilm);
    ASSERT_NE(rt, nullptr);
    auto out = rt->Run(Batch(inputs));
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    before = out->data;
  }
  if (!UseHugePagesForLargeTensors()) {
    GTEST_SKIP() << "the kernel offers no transparent huge pages (mode '" << TransparentHugePageMode() << "')";
  }
  EXPECT_TRUE(UseHugePagesForLargeTensors()) << "a second call keeps it installed";
  const int64_t huge_before = LargeTensorBytesOnHugePages();
  {
    auto small = Load(config_);  // tiny-bert: every tensor under the threshold
    ASSERT_NE(small, nullptr);
    EXPECT_EQ(LargeTensorBytesOnHugePages(), huge_before);
  }
  auto rt = Load(*minilm);
  ASSERT_NE(rt, nullptr);
  // The load put the word embeddings on huge pages; passes do not.
  const int64_t huge_loaded = LargeTensorBytesOnHugePages();
  EXPECT_GE(huge_loaded - huge_before, 30522 * 384 * 4);
  auto out = rt->Run(Batch(inputs));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_LT(MaxAbsDiff(out->data, before), 1e-6);
  EXPECT_EQ(LargeTensorBytesOnHugePages(), huge_loaded);
  rt->Unload();
  EXPECT_EQ(LargeTensorBytesOnHugePages(), huge_before) << "unload returns the weights";

  constexpr int64_t kLarge = int64_t{40} << 20;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  c10::Allocator* cpu = c10::GetCPUAllocator();
  {
    // Outside a scope (a forward pass's activations): malloc, as before.
    c10::DataPtr plain = cpu->allocate(kLarge);
    ASSERT_NE(plain.get(), nullptr);
    EXPECT_NE(reinterpret_cast<uintptr_t>(plain.get()) % kHugePage, 0u);
  }
  const LargeTensorsOnHugePages scope;
  const int64_t rss_empty = ResidentBytes();
  {
    c10::DataPtr large = cpu->allocate(kLarge);
    ASSERT_NE(large.get(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(large.get()) % kHugePage, 0u);
    // Advised for huge pages ("hg"); whether the kernel finds free huge
    // pages for it is its business.
    EXPECT_NE(VmFlagsOfMappingAt(large.get()).find(" hg"), std::string::npos)
        << VmFlagsOfMappingAt(large.get());
    std::memset(large.get(), 1, kLarge);
    EXPECT_GE(ResidentBytes() - rss_empty, kLarge - int64_t{2 << 20});
  }
  // Freed to the system at once: an evicted model's large tensors leave
  // the process.
  EXPECT_LT(ResidentBytes() - rss_empty, int64_t{4} << 20);

  // Tensors and the raw interface (used inside some kernels) on both sides
  // of the threshold.
  at::Tensor big = torch::ones({9 << 20}, torch::kFloat);  // 36 MiB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data_ptr()) % kHugePage, 0u);
  EXPECT_EQ(big.sum().item<double>(), 9 << 20);
  at::Tensor small = torch::ones({100}, torch::kFloat);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data_ptr()) % 64, 0u);
  for (size_t n : {size_t{100}, size_t{4} << 20, size_t{33} << 20}) {
    void* p = cpu->raw_allocate(n);
    ASSERT_NE(p, nullptr);
    std::memset(p, 0, n);
    cpu->raw_deallocate(p);
  }
}

// Sequence-classification heads (cross-encoder, classifier): three inputs
// (ids, mask, token types), raw logits out.
class HeadModel : public ::testing::TestWithParam<const char*> {};

TEST_P(HeadModel, MatchesPythonReferenceWithTokenTypes) {
  const std::string dir = ModelsDir() + "/" + GetParam();
  ASSERT_TRUE(fs::exists(dir + "/model.pt") && fs::exists(dir + "/reference.json")) << MissingModelHelp(dir);
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(*config).ok());
  std::ifstream in(dir + "/reference.json");
  const auto ref = nlohmann::json::parse(in);
  const int labels = static_cast<int>(ref["logits"][0].size());
  EXPECT_EQ(rt.Dim(), labels);

  std::vector<std::vector<int64_t>> ids, types;
  for (const auto& item : ref["inputs"]) {
    ids.push_back(item["input_ids"]);
    types.push_back(item["token_type_ids"]);
  }
  // All pairs in one padded batch, with their segment ids.
  TokenBatch batch = Batch(ids);
  batch.token_type_ids.assign(batch.input_ids.size(), 0);
  for (size_t r = 0; r < types.size(); ++r)
    std::copy(types[r].begin(), types[r].end(), batch.token_type_ids.begin() + r * batch.seq_len);
  auto out = rt.Run(batch);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->dim, labels);
  for (size_t r = 0; r < ids.size(); ++r)
    EXPECT_LT(MaxAbsDiff(Row(*out, static_cast<int>(r)), ref["logits"][r].get<std::vector<float>>()), 1e-4)
        << "pair " << r;

  // Segment ids reach the model: all-zero types give other logits.
  TokenBatch no_types = Batch(ids);
  auto plain = rt.Run(no_types);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_GT(MaxAbsDiff(Row(*plain, 0), Row(*out, 0)), 1e-5);

  // Token types that do not match the batch shape are rejected.
  batch.token_type_ids.pop_back();
  EXPECT_EQ(rt.Run(batch).status().code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Demo, HeadModel, ::testing::Values("tiny-reranker", "tiny-classifier"));

TEST_F(TinyBert, RunsVariableBatchAndSequenceShapes) {
  auto rt = Load(config_);
  ASSERT_NE(rt, nullptr);
  std::mt19937 rng(1);
  for (auto [rows, len] : {std::pair{1, 1}, {1, 2}, {3, 40}, {16, 7}, {2, 256}, {64, 32}}) {
    std::vector<std::vector<int64_t>> batch;
    for (int r = 0; r < rows; ++r) batch.push_back(RandomSentence(rng, std::max(2, len - r % 3)));
    if (len == 1) batch = {{101}};
    auto out = rt->Run(Batch(batch));
    ASSERT_TRUE(out.ok()) << rows << "x" << len << ": " << out.status().ToString();
    EXPECT_EQ(out->rows, rows);
    EXPECT_EQ(out->dim, 64);
    for (int r = 0; r < rows; ++r) {
      double sq = 0;
      for (float v : Row(*out, r)) sq += double(v) * v;
      EXPECT_NEAR(std::sqrt(sq), 1.0, 1e-4);
    }
  }
}

TEST_F(TinyBert, PaddingDoesNotChangeEmbedding) {
  std::mt19937 rng(2);
  const auto sentence = RandomSentence(rng, 10);
  const auto longer = RandomSentence(rng, 50);
  for (const char* pooling : {"mean", "cls"}) {
    ModelConfig config = config_;
    config.pooling = pooling;
    auto rt = Load(config);
    ASSERT_NE(rt, nullptr);
    auto alone = rt->Run(Batch({sentence}));
    auto padded = rt->Run(Batch({longer, sentence, longer}));
    ASSERT_TRUE(alone.ok() && padded.ok());
    EXPECT_LT(MaxAbsDiff(Row(*alone, 0), Row(*padded, 1)), 1e-5) << pooling;
  }
}

TEST_F(TinyBert, PoolingAndNormalisationFollowConfig) {
  const auto batch = Batch({{101, 2000, 3000, 4000, 102}});
  ModelConfig raw = config_;
  raw.normalize = false;
  ModelConfig cls = config_;
  cls.pooling = "cls";
  auto mean_norm = Load(config_)->Run(batch);
  auto mean_raw = Load(raw)->Run(batch);
  auto cls_norm = Load(cls)->Run(batch);
  ASSERT_TRUE(mean_norm.ok() && mean_raw.ok() && cls_norm.ok());
  double sq = 0;
  for (float v : mean_raw->data) sq += double(v) * v;
  const float norm = static_cast<float>(std::sqrt(sq));
  EXPECT_GT(std::abs(norm - 1.0f), 1e-3);
  std::vector<float> rescaled = mean_raw->data;
  for (float& v : rescaled) v /= norm;
  EXPECT_LT(MaxAbsDiff(rescaled, mean_norm->data), 1e-5);
  EXPECT_GT(MaxAbsDiff(cls_norm->data, mean_norm->data), 1e-3);
}

TEST_F(TinyBert, DimComesFromModelWhenConfigOmitsIt) {
  ModelConfig config = config_;
  config.dim = 0;
  auto rt = Load(config);
  ASSERT_NE(rt, nullptr);
  EXPECT_EQ(rt->Dim(), 64);
}

TEST_F(TinyBert, WrongConfiguredDimIsInvalidArgument) {
  ModelConfig config = config_;
  config.dim = 384;
  TorchScriptRuntime rt;
  const Status st = rt.Load(config);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
}

TEST_F(TinyBert, MemoryCoversParameters) {
  auto rt = Load(config_);
  ASSERT_NE(rt, nullptr);
  // 2.1M float parameters.
  EXPECT_GE(rt->MemoryBytes(), 8'000'000);
  EXPECT_LT(rt->MemoryBytes(), 1'000'000'000);
}

// One past the last GPU libtorch sees: on a CPU-only libtorch (Debian's)
// cuda:0, refused because the build has no CUDA; with CUDA, a device that
// is not there. Either way the load fails with the reason and the same
// runtime still loads on the CPU afterwards.
TEST_F(TinyBert, ADeviceLibtorchCannotUseIsRefusedAtLoad) {
  const int missing = static_cast<int>(torch::cuda::device_count());
  ModelConfig on_gpu = config_;
  on_gpu.device = "cuda:" + std::to_string(missing);
  TorchScriptRuntime rt;
  const Status st = rt.Load(on_gpu);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_EQ(st.reason(), "device_unavailable");
  EXPECT_NE(st.message().find(on_gpu.device), std::string::npos) << st.message();
  if (!BuiltWithCuda()) {
    EXPECT_NE(st.message().find("without CUDA"), std::string::npos) << st.message();
  }
  EXPECT_EQ(CheckTorchDevice(on_gpu.device).reason(), "device_unavailable");
  EXPECT_EQ(CheckTorchDevice("gpu").reason(), "invalid_device");
  EXPECT_TRUE(CheckTorchDevice("cpu").ok());
  ASSERT_TRUE(rt.Load(config_).ok());
  EXPECT_TRUE(rt.TakesThreadCount());
  EXPECT_TRUE(rt.Run(Batch({{101, 102}})).ok());
}

// Runs only where libtorch has CUDA and sees a GPU (skipped on Debian's
// CPU-only libtorch): the model runs on cuda:0, gives the CPU's embeddings,
// is measured by the CUDA allocator and gives its memory back on unload.
TEST_F(TinyBert, OnAGpuMatchesTheCpuAndIsMeasuredByTheCudaAllocator) {
  if (!BuiltWithCuda() || !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA libtorch or no GPU here";
  auto cpu = Load(config_);
  ASSERT_NE(cpu, nullptr);
  ModelConfig on_gpu = config_;
  on_gpu.device = "cuda:0";
  // CUDA, its allocator and this thread's cuBLAS workspaces start here, not in the measured load.
  internal::StartCudaOn(0);
  const int64_t before = CudaAllocatedBytes(0);
  ASSERT_GE(before, 0);
  auto gpu = Load(on_gpu);
  ASSERT_NE(gpu, nullptr);
  EXPECT_FALSE(gpu->TakesThreadCount());  // a pass takes the whole device
  // 2.1M float parameters, on the device.
  EXPECT_GE(gpu->MemoryBytes(), 8'000'000);
  EXPECT_LT(gpu->MemoryBytes(), 1'000'000'000);
  EXPECT_GE(CudaAllocatedBytes(0) - before, 8'000'000);
  RecordProperty("gpu_footprint_bytes", std::to_string(gpu->MemoryBytes()));
  std::mt19937 rng(7);
  std::vector<std::vector<int64_t>> rows;
  for (int len : {5, 17, 64, 3}) rows.push_back(RandomSentence(rng, len));
  auto a = cpu->Run(Batch(rows));
  auto b = gpu->Run(Batch(rows));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << " / " << b.status().ToString();
  ASSERT_EQ(b->rows, 4);
  for (int r = 0; r < 4; ++r) EXPECT_LT(MaxAbsDiff(Row(*a, r), Row(*b, r)), 1e-3) << "row " << r;
  gpu->Unload();
  // Room for a workspace libtorch creates lazily on first use (cuBLASLt's
  // is 1 MiB); the model's 8 MB would not fit.
  EXPECT_LT(CudaAllocatedBytes(0) - before, 4'000'000) << "the model's tensors outlived its unload";
}

TEST_F(TinyBert, BadBatchesAreInvalidArgument) {
  auto rt = Load(config_);
  ASSERT_NE(rt, nullptr);
  auto mismatched = rt->Run(TokenBatch{2, 3, {101, 1, 102}, {1, 1, 1}, {}, 0});
  EXPECT_EQ(mismatched.status().code(), StatusCode::kInvalidArgument);
  auto empty = rt->Run(TokenBatch{});
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);

  std::vector<int64_t> too_long(config_.max_seq_len + 1, 1000);
  auto long_out = rt->Run(Batch({too_long}));
  EXPECT_EQ(long_out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(long_out.status().reason(), "input_too_long");

  auto out_of_vocab = rt->Run(Batch({{101, 30522, 102}}));
  EXPECT_EQ(out_of_vocab.status().code(), StatusCode::kInvalidArgument)
      << out_of_vocab.status().ToString();
  EXPECT_EQ(out_of_vocab.status().reason(), "token_out_of_range");
  auto negative = rt->Run(Batch({{101, -5, 102}}));
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument)
      << negative.status().ToString();
  // Still usable afterwards.
  EXPECT_TRUE(rt->Run(Batch({{101, 102}})).ok());
}

TEST_F(TinyBert, UnloadIsIdempotentAndReloadWorks) {
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(config_).ok());
  const Status twice = rt.Load(config_);
  EXPECT_EQ(twice.code(), StatusCode::kInternal);
  rt.Unload();
  rt.Unload();
  EXPECT_EQ(rt.Run(Batch({{101, 102}})).status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(rt.Load(config_).ok());
  EXPECT_TRUE(rt.Run(Batch({{101, 102}})).ok());
}

TEST_F(TinyBert, AppliesThreadCountOnTheCallingThread) {
  ModelConfig config = config_;
  config.intra_op_threads = 2;
  auto rt = Load(config);
  ASSERT_NE(rt, nullptr);
  int seen = 0;
  std::thread executor([&] {
    // This thread already has its own count, as an executor that ran
    // another model before this one was loaded would.
    at::set_num_threads(1);
    ASSERT_TRUE(rt->Run(Batch({{101, 2000, 102}})).ok());
    seen = at::get_num_threads();
  });
  executor.join();
  EXPECT_EQ(seen, 2);
}

TEST_F(TinyBert, PassRunsOnTheBatchsThreadCountOnItsOwnThreadOnly) {
  ModelConfig config = config_;
  config.intra_op_threads = 2;
  auto rt = Load(config);
  ASSERT_NE(rt, nullptr);
  EXPECT_TRUE(rt->TakesThreadCount());
  auto two = rt->Run(Batch({{101, 2000, 102}}));
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  int narrow = 0;
  int wide = 0;
  std::vector<float> narrow_row;
  std::thread executor([&] {
    TokenBatch one = Batch({{101, 2000, 102}});
    one.threads = 1;
    auto out = rt->Run(one);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    narrow = at::get_num_threads();
    narrow_row = Row(*out, 0);
    ASSERT_TRUE(rt->Run(Batch({{101, 2000, 102}})).ok());  // 0: the model's own
    wide = at::get_num_threads();
  });
  executor.join();
  EXPECT_EQ(narrow, 1);
  EXPECT_EQ(wide, 2);
  // The count is the executor thread's: this thread keeps the model's, and
  // so does the process-wide default a new thread starts from.
  EXPECT_EQ(at::get_num_threads(), 2);
  int fresh = 0;
  std::thread([&] { fresh = at::get_num_threads(); }).join();
  EXPECT_EQ(fresh, 2);
  // Fewer threads, same numbers.
  EXPECT_LT(MaxAbsDiff(narrow_row, Row(*two, 0)), 1e-5);
}

// ---- Error handling and output forms, with small fixtures built here.

class TorchScriptFixtures : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("shoal-ts-test-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves a module with one embedding table, submodule `table` with a
  // [rows, 8] weight, whose forward looks `ids` ("input_ids" or
  // "token_type_ids", which it then takes as well) up in it.
  ModelConfig TableFixture(const std::string& table, int64_t rows, const std::string& ids) {
    torch::jit::Module emb("Emb");
    emb.register_parameter("weight", torch::ones({rows, 8}), /*is_buffer=*/false);
    torch::jit::Module m("Fixture");
    m.register_module(table, emb);
    const std::string extra = ids == "input_ids" ? "" : ", " + ids;
    m.define("def forward(self, input_ids, attention_mask" + extra + "):\n    return torch.embedding(self." + table +
             ".weight, " + ids + ")\n");
    m.save((dir_ / "model.pt").string());
    ModelConfig c;
    c.name = "fixture";
    c.dir = dir_.string();
    c.normalize = false;
    return c;
  }

  // Saves a TorchScript module whose forward(input_ids, attention_mask) is `body`.
  ModelConfig Fixture(const std::string& body, int dim = 0) {
    torch::jit::Module m("Fixture");
    m.define("def forward(self, input_ids, attention_mask):\n" + body);
    m.save((dir_ / "model.pt").string());
    ModelConfig c;
    c.name = "fixture";
    c.dir = dir_.string();
    c.dim = dim;
    c.normalize = false;
    return c;
  }

  fs::path dir_;
};

// Each hidden vector is [id, id, id, id]: mean pooling gives the mean real id.
constexpr const char* kHidden =
    "    h = input_ids.float().unsqueeze(-1).repeat(1, 1, 4)\n";

void ExpectMeanOfIds(TorchScriptRuntime& rt) {
  auto out = rt.Run(Batch({{2, 4, 6}, {10, 20}}));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->dim, 4);
  EXPECT_EQ(Row(*out, 0), std::vector<float>(4, 4.0f));
  EXPECT_EQ(Row(*out, 1), std::vector<float>(4, 15.0f));
}

TEST_F(TorchScriptFixtures, AcceptsPlainTensorOutput) {
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(Fixture(std::string(kHidden) + "    return h\n")).ok());
  EXPECT_EQ(rt.Dim(), 4);
  ExpectMeanOfIds(rt);
}

TEST_F(TorchScriptFixtures, AcceptsTupleOutput) {
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(Fixture(std::string(kHidden) + "    return (h, attention_mask)\n")).ok());
  ExpectMeanOfIds(rt);
}

TEST_F(TorchScriptFixtures, AcceptsDictOutput) {
  TorchScriptRuntime rt;
  const Status st = rt.Load(Fixture(std::string(kHidden) +
                                    "    return {'pooler_output': h[:, 0], "
                                    "'last_hidden_state': h}\n"));
  ASSERT_TRUE(st.ok()) << st.ToString();
  ExpectMeanOfIds(rt);
}

TEST_F(TorchScriptFixtures, TreatsTwoDimensionalOutputAsPooled) {
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(Fixture("    return input_ids.float().sum(1, keepdim=True).repeat(1, 3)\n")).ok());
  EXPECT_EQ(rt.Dim(), 3);
  auto out = rt.Run(Batch({{2, 4, 6}, {10, 20}}));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(Row(*out, 0), std::vector<float>(3, 12.0f));
  // Padding ids are 0, so the row sum is unaffected.
  EXPECT_EQ(Row(*out, 1), std::vector<float>(3, 30.0f));
}

TEST_F(TorchScriptFixtures, UnexpectedOutputIsInternal) {
  TorchScriptRuntime scalar;
  Status st = scalar.Load(Fixture("    return input_ids.float().sum()\n"));
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  TorchScriptRuntime text;
  st = text.Load(Fixture("    return 'hello'\n"));
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  TorchScriptRuntime dict;
  st = dict.Load(Fixture(std::string(kHidden) + "    return {'logits': h}\n"));
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
}

TEST_F(TorchScriptFixtures, ModelThatThrowsIsInternal) {
  TorchScriptRuntime rt;
  const Status st = rt.Load(Fixture("    assert input_ids.size(0) < 0, 'boom'\n    return input_ids\n"));
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  EXPECT_NE(st.message().find("boom"), std::string::npos) << st.message();
}

TEST_F(TorchScriptFixtures, IndexErrorInsideModelIsInvalidArgument) {
  // No recognisable word_embeddings table, so the id check happens in torch.
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(Fixture("    return torch.embedding(torch.ones(10, 4), input_ids)\n")).ok());
  EXPECT_TRUE(rt.Run(Batch({{1, 9}})).ok());
  auto out = rt.Run(Batch({{1, 20}}));
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << out.status().ToString();
}

// The token embedding tables of common exports are recognised by name
// (a table named otherwise is not), so ids past them are refused before the
// pass, as they must be on a GPU.
TEST_F(TorchScriptFixtures, RecognisesCommonEmbeddingTableNames) {
  for (const std::string table : {"word_embeddings", "embed_tokens", "wte", "tok_embeddings", "token_embedding",
                                   "lookup"}) {
    TorchScriptRuntime rt;
    ASSERT_TRUE(rt.Load(TableFixture(table, 50, "input_ids")).ok()) << table;
    EXPECT_TRUE(rt.Run(Batch({{1, 49}})).ok()) << table;
    auto out = rt.Run(Batch({{1, 50}}));
    EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << table << ": " << out.status().ToString();
    if (table == "lookup") {
      EXPECT_NE(out.status().reason(), "token_out_of_range") << "an unrecognised table was recognised";
    } else {
      EXPECT_EQ(out.status().reason(), "token_out_of_range") << table << ": " << out.status().ToString();
      EXPECT_NE(out.status().message().find("size 50"), std::string::npos) << out.status().message();
    }
  }
}

// Segment ids past the model's token type table (a pair sent to a model
// with one segment, RoBERTa-style) are refused before the pass.
TEST_F(TorchScriptFixtures, SegmentIdsOutsideTheTokenTypeTableAreRefused) {
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(TableFixture("token_type_embeddings", 1, "token_type_ids")).ok());
  TokenBatch single = Batch({{1, 2, 3}});
  EXPECT_TRUE(rt.Run(single).ok());
  TokenBatch pair = single;
  pair.token_type_ids = {0, 0, 1};
  auto out = rt.Run(pair);
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << out.status().ToString();
  EXPECT_EQ(out.status().reason(), "token_type_out_of_range") << out.status().ToString();
  pair.token_type_ids = {0, 0, 0};
  EXPECT_TRUE(rt.Run(pair).ok());
}

TEST_F(TorchScriptFixtures, MissingModelFileIsNotFound) {
  ModelConfig c;
  c.name = "missing";
  c.dir = dir_.string();
  TorchScriptRuntime rt;
  const Status st = rt.Load(c);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_EQ(st.reason(), "model_file_not_found");
}

TEST_F(TorchScriptFixtures, CorruptModelFileIsInternal) {
  ModelConfig c;
  c.name = "corrupt";
  c.dir = dir_.string();
  {
    std::ofstream out(dir_ / "model.pt", std::ios::binary);
    out << "this is not a TorchScript archive";
  }
  TorchScriptRuntime garbage;
  Status st = garbage.Load(c);
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();

  // A real archive cut in half.
  const std::string tiny = ModelsDir() + "/tiny-bert/model.pt";
  ASSERT_TRUE(fs::exists(tiny)) << MissingModelHelp(ModelsDir() + "/tiny-bert");
  {
    std::ifstream in(tiny, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream out(dir_ / "model.pt", std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  TorchScriptRuntime truncated;
  st = truncated.Load(c);
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();

  fs::remove(dir_ / "model.pt");
  fs::create_directory(dir_ / "model.pt");
  TorchScriptRuntime directory;
  EXPECT_EQ(directory.Load(c).code(), StatusCode::kNotFound);
}

TEST_F(TorchScriptFixtures, BadPoolingIsInvalidArgument) {
  ModelConfig c = Fixture(std::string(kHidden) + "    return h\n");
  c.pooling = "max";
  TorchScriptRuntime rt;
  EXPECT_EQ(rt.Load(c).code(), StatusCode::kInvalidArgument);
}

// A CUDA error that leaves the process's context unusable stops the
// runtime's GPU for good; only such errors do. libtorch puts it in the
// middle of its text: a TorchScript traceback before, CUDA's hints after.
TEST(DeviceFault, OnlyCudaErrorsThatBreakTheContextAreDeviceFaults) {
  using internal::DeviceFaultLine;
  EXPECT_EQ(DeviceFaultLine("The following operation failed in the TorchScript interpreter.\n"
                            "Traceback of TorchScript, serialized code (most recent call last):\n"
                            "RuntimeError: CUDA error: device-side assert triggered\n"
                            "CUDA kernel errors might be asynchronously reported at some other API call.\n"
                            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.\n"),
            "RuntimeError: CUDA error: device-side assert triggered");
  EXPECT_EQ(DeviceFaultLine("CUDA error: an illegal memory access was encountered"),
            "CUDA error: an illegal memory access was encountered");
  EXPECT_FALSE(DeviceFaultLine("CUDA error: unspecified launch failure").empty());
  EXPECT_FALSE(DeviceFaultLine("CUDA error: misaligned address").empty());
  EXPECT_FALSE(DeviceFaultLine("CUDA driver error: an illegal memory access was encountered").empty());
  EXPECT_FALSE(DeviceFaultLine("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`").empty());
  EXPECT_FALSE(DeviceFaultLine("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED").empty());
  EXPECT_FALSE(DeviceFaultLine("CUDA error: unknown error").empty());  // a GPU fallen off the bus
  EXPECT_FALSE(DeviceFaultLine("CUDA error: uncorrectable NVLink error detected during the execution").empty());
  EXPECT_FALSE(DeviceFaultLine("CUDA error: operation not supported on global/shared address space").empty());
  // Errors the context survives: out of memory, a bad launch or argument, a
  // cuBLAS handle that could not be allocated or an unsupported call.
  EXPECT_EQ(DeviceFaultLine("CUDA out of memory. Tried to allocate 2.00 GiB"), "");
  EXPECT_EQ(DeviceFaultLine("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), "");
  EXPECT_EQ(DeviceFaultLine("CUDA error: invalid configuration argument"), "");
  EXPECT_EQ(DeviceFaultLine("CUDA error: too many resources requested for launch"), "");
  EXPECT_EQ(DeviceFaultLine("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "");
  EXPECT_EQ(DeviceFaultLine("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx( handle)`"), "");
  // Named outside a CUDA error line (a model's own message): not a fault.
  EXPECT_EQ(DeviceFaultLine("AssertionError: device-side assert triggered"), "");
  EXPECT_EQ(DeviceFaultLine("The size of tensor a (3) must match the size of tensor b (4)"), "");
  EXPECT_EQ(DeviceFaultLine("index out of range in self"), "");
}

// What a caller is told of a libtorch error: the line that says what
// failed, not a traceback's first line or the hints CUDA puts last.
TEST(ErrorSummary, TellsTheErrorNotTheTracebackOrTheHints) {
  using internal::ErrorSummary;
  EXPECT_EQ(ErrorSummary("CUDA error: invalid configuration argument\n"
                         "CUDA kernel errors might be asynchronously reported at some other API call.\n"),
            "CUDA error: invalid configuration argument");
  EXPECT_EQ(ErrorSummary("The following operation failed in the TorchScript interpreter.\n"
                         "Traceback of TorchScript, serialized code (most recent call last):\n"
                         "  File \"code/__torch__/model.py\", line 12, in forward\n"
                         "    raise ValueError(\"not this\")\n"
                         "RuntimeError: CUDA error: invalid configuration argument\n"
                         "CUDA kernel errors might be asynchronously reported at some other API call.\n"
                         "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.\n"),
            "RuntimeError: CUDA error: invalid configuration argument");
  EXPECT_EQ(ErrorSummary("The following operation failed in the TorchScript interpreter.\n"
                         "Traceback of TorchScript, original code (most recent call last):\n"
                         "builtins.IndexError: index out of range in self\n"),
            "builtins.IndexError: index out of range in self");
  // No line names an error: the last one that is not blank.
  EXPECT_EQ(ErrorSummary("The following operation failed in the TorchScript interpreter.\n"
                         "the tensors differ in size  \n\n"),
            "the tensors differ in size");
}

// Runs only where libtorch has CUDA and sees a GPU, and only when asked
// (SHOAL_GPU_FAULT_TEST=1, as scripts/gpu_check.sh does in a process of its
// own): it breaks its process's CUDA context on purpose. A model that looks
// ids up in a table the host check does not know trips a device-side
// assert; the runtime reports its GPU failed, takes no more work, and a
// later load on that GPU fails the same way without touching it.
TEST_F(TorchScriptFixtures, GpuFaultADeviceSideAssertStopsTheGpuForTheProcess) {
  if (!BuiltWithCuda() || !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA libtorch or no GPU here";
  if (std::getenv("SHOAL_GPU_FAULT_TEST") == nullptr)
    GTEST_SKIP() << "breaks its process's CUDA context: run it on its own with SHOAL_GPU_FAULT_TEST=1";
  torch::jit::Module words("Words");
  words.register_parameter("weight", torch::ones({100, 8}), /*is_buffer=*/false);
  torch::jit::Module other("Other");
  other.register_parameter("weight", torch::ones({10, 8}), /*is_buffer=*/false);
  torch::jit::Module m("Fixture");
  m.register_module("word_embeddings", words);  // the vocabulary the host checks: 100 ids
  m.register_module("other", other);            // 10 rows, looked up with the same ids
  m.define("def forward(self, input_ids, attention_mask):\n"
           "    return torch.embedding(self.other.weight, input_ids) + self.word_embeddings.weight[0]\n");
  m.save((dir_ / "model.pt").string());
  ModelConfig c;
  c.name = "fixture";
  c.dir = dir_.string();
  c.normalize = false;
  c.device = "cuda:0";
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(c).ok());
  ASSERT_TRUE(rt.Run(Batch({{1, 9}})).ok());
  auto broken = rt.Run(Batch({{1, 50}}));  // inside the vocabulary, outside `other`
  EXPECT_EQ(broken.status().code(), StatusCode::kUnavailable) << broken.status().ToString();
  EXPECT_EQ(broken.status().reason(), "device_fault") << broken.status().ToString();
  EXPECT_FALSE(rt.Available());
  EXPECT_EQ(rt.DeviceHealth().reason(), "device_fault");
  EXPECT_EQ(rt.Run(Batch({{1, 2}})).status().reason(), "device_fault");
  TorchScriptRuntime next;
  EXPECT_EQ(next.Load(c).reason(), "device_fault");
  rt.Unload();
}

// On the CPU the same text is the failure of one pass: the runtime goes on.
TEST_F(TorchScriptFixtures, ACudaErrorTextOnTheCpuIsNotADeviceFault) {
  TorchScriptRuntime rt;
  ASSERT_TRUE(rt.Load(Fixture("    assert input_ids.size(0) < 3, 'CUDA error: device-side assert triggered'\n" +
                              std::string(kHidden) + "    return h\n"))
                  .ok());
  auto out = rt.Run(Batch({{1}, {2}, {3}}));
  EXPECT_EQ(out.status().code(), StatusCode::kInternal) << out.status().ToString();
  EXPECT_TRUE(rt.Available());
  EXPECT_TRUE(rt.DeviceHealth().ok()) << rt.DeviceHealth().ToString();
  EXPECT_TRUE(rt.Run(Batch({{1}, {2}})).ok());
}

}  // namespace
}  // namespace shoal
