// shoal_bench_runtime: what running a model out of process costs per batch,
// in one run.
//
//   in-process   tiny-bert, TorchScript on libtorch inside this process
//                (the "torchscript" runtime)
//   socket       tiny-bert-py, the same weights in eager PyTorch, served by
//                the Python reference runtime over the Unix socket (the
//                "process" runtime)
//   socket-null  the Python runtime with a model that returns zeros: the
//                protocol, copies and Python dispatch alone
//
// Median and p90 per batch at several batch sizes (16 tokens a row), and the
// ratios socket / in-process and socket-null / socket. Prints only.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/model_config.h"
#include "runtime/runtime.h"
#include "token_batch.h"

namespace shoal::bench {
namespace {

namespace fs = std::filesystem;

struct Stats {
  double p50_us = 0, p90_us = 0;
};

Stats Time(Runtime& rt, const TokenBatch& batch, int warmup, int iterations) {
  for (int i = 0; i < warmup; ++i) (void)rt.Run(batch);
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = rt.Run(batch);
    const auto t1 = std::chrono::steady_clock::now();
    if (!out.ok()) {
      std::fprintf(stderr, "run failed: %s\n", out.status().ToString().c_str());
      std::exit(1);
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[us.size() * 9 / 10]};
}

std::unique_ptr<Runtime> LoadOrDie(const ModelConfig& c) {
  auto rt = CreateRuntime(c.runtime);
  if (!rt.ok()) {
    std::fprintf(stderr, "%s\n", rt.status().ToString().c_str());
    std::exit(1);
  }
  Status s = (*rt)->Load(c);
  if (!s.ok()) {
    std::fprintf(stderr, "loading %s: %s\n", c.name.c_str(), s.ToString().c_str());
    std::exit(1);
  }
  return std::move(rt).value();
}

ModelConfig ConfigOrDie(const std::string& dir) {
  auto c = LoadModelConfig(dir);
  if (!c.ok()) {
    std::fprintf(stderr, "%s (run scripts/setup.sh)\n", c.status().ToString().c_str());
    std::exit(1);
  }
  return *c;
}

// A copy of tiny-bert-py whose model returns zeros: the socket path without
// the model.
ModelConfig NullPythonModel(const ModelConfig& py, const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream(dir / "model.py") << "import torch\n\n\nclass Zeros:\n    dim = 64\n\n"
                                     "    def embed(self, ids, mask):\n        return torch.zeros(ids.shape[0], 64)\n\n\n"
                                     "def load(model_dir, config):\n    return Zeros()\n";
  ModelConfig c = py;
  c.name = "null-py";
  c.dir = dir.string();
  c.process.command = {"/usr/bin/python3", (fs::path(py.dir) / "shoal_runtime.py").string()};
  return c;
}

}  // namespace
}  // namespace shoal::bench

int main(int argc, char** argv) {
  using namespace shoal;
  using namespace shoal::bench;
  CLI::App app{"Per-batch cost of the out-of-process runtime against in-process libtorch"};
  std::string models_dir = SHOAL_DEFAULT_MODELS_DIR;
  int iterations = 300, warmup = 30, seq_len = 16, threads = 1;
  std::vector<int> sizes = {1, 8, 32};
  app.add_option("--models-dir", models_dir, "Model repository with tiny-bert and tiny-bert-py")->capture_default_str();
  app.add_option("--iterations", iterations, "Timed batches per case")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed batches first")->capture_default_str();
  app.add_option("--seq-len", seq_len, "Tokens per row")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads of both runtimes")->capture_default_str();
  app.add_option("--batch-sizes", sizes, "Rows per batch")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  ModelConfig ts = ConfigOrDie(models_dir + "/tiny-bert");
  ModelConfig py = ConfigOrDie(models_dir + "/tiny-bert-py");
  ts.intra_op_threads = threads;
  py.intra_op_threads = threads;
  const fs::path tmp = fs::temp_directory_path() / ("shoal-runtime-bench-" + std::to_string(::getpid()));
  ModelConfig null_py = NullPythonModel(py, tmp);
  auto in_process = LoadOrDie(ts);
  auto socket = LoadOrDie(py);
  auto socket_null = LoadOrDie(null_py);

  std::printf("shoal_bench_runtime: %d timed batches per case (+%d warm-up), %d tokens a row, %d intra-op thread(s)\n\n",
              iterations, warmup, seq_len, threads);
  std::printf("%6s  %22s  %22s  %22s  %10s  %12s\n", "rows", "in-process p50/p90 us", "socket p50/p90 us",
              "socket-null p50/p90 us", "socket/in", "null/socket");
  for (int rows : sizes) {
    const TokenBatch b = MakeBatch(rows, seq_len);
    const Stats a = Time(*in_process, b, warmup, iterations);
    const Stats s = Time(*socket, b, warmup, iterations);
    const Stats n = Time(*socket_null, b, warmup, iterations);
    std::printf("%6d  %10.0f / %-9.0f  %10.0f / %-9.0f  %10.0f / %-9.0f  %10.2f  %12.2f\n", rows, a.p50_us, a.p90_us,
                s.p50_us, s.p90_us, n.p50_us, n.p90_us, s.p50_us / a.p50_us, n.p50_us / s.p50_us);
  }
  socket_null->Unload();
  socket->Unload();
  in_process->Unload();
  std::error_code ec;
  fs::remove_all(tmp, ec);
  return 0;
}
