// shoal_bench_load: how long a TorchScript model takes to load, with
// libtorch's own allocator against weights on transparent huge pages
// (runtime/torch/huge_pages.h, the worker's --huge-pages), in one run.
//
// Each side runs in a child process of its own (the allocator cannot be
// removed once installed), and the sides alternate for --rounds rounds so
// that drift on a shared machine falls on both. A child loads the model
// twice untimed (page cache, libtorch's one-time costs), then times
// --loads Load() + Unload() pairs and, on the last load, forward passes of
// 8 rows x 16 tokens on one thread (median time, page faults per pass).
// Both sides keep freed memory as the worker does, unless
// --keep-freed-memory false. Prints only.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/model_config.h"
#include "common/process_memory.h"
#include "runtime/runtime.h"
#include "token_batch.h"
#include "runtime/torch/huge_pages.h"

namespace shoal::bench {
namespace {

using Ms = std::chrono::duration<double, std::milli>;

long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One side in this process: prints "load_ms pass_ms memory_bytes", one line
// per timed load (pass_ms and memory on the last line only, else 0).
int Child(const std::string& model_dir, bool huge, bool keep_freed, int loads) {
  // As the worker does (--keep-freed-memory): the passes timed below then
  // reuse their activations' memory.
  if (keep_freed) KeepFreedMemory(kKeptBlockBytes, kKeptFreeBytes);
  if (huge && !UseHugePagesForLargeTensors()) {
    std::fprintf(stderr, "no transparent huge pages here (mode '%s')\n", TransparentHugePageMode().c_str());
    return 2;
  }
  auto config = LoadModelConfig(model_dir);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  config->intra_op_threads = 1;
  for (int i = 0; i < loads + 2; ++i) {
    auto rt = CreateRuntime(config->runtime);
    if (!rt.ok()) return 1;
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = (*rt)->Load(*config);
    const double load_ms = Ms(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    double pass_ms = 0, faults_per_pass = 0;
    if (i == loads + 1) {
      const TokenBatch b = MakeBatch(8, 16);
      std::vector<double> passes;
      long faults_before = 0;
      for (int p = 0; p < 60; ++p) {
        if (p == 10) faults_before = MinorFaults();
        const auto p0 = std::chrono::steady_clock::now();
        if (!(*rt)->Run(b).ok()) return 1;
        if (p >= 10) passes.push_back(Ms(std::chrono::steady_clock::now() - p0).count());
      }
      faults_per_pass = static_cast<double>(MinorFaults() - faults_before) / 50;
      pass_ms = Median(passes);
    }
    if (i >= 2)
      std::printf("%.3f %.3f %.1f %lld\n", load_ms, pass_ms, faults_per_pass,
                  i == loads + 1 ? static_cast<long long>((*rt)->MemoryBytes()) : 0LL);
    (*rt)->Unload();
  }
  return 0;
}

struct Side {
  std::vector<double> load_ms, pass_ms, faults_per_pass;
  long long memory = 0;
};

bool RunChild(const std::string& self, const std::string& model_dir, bool huge, bool keep_freed, int loads,
              Side* side) {
  const std::string cmd = "'" + self + "' --child " + (huge ? "huge" : "plain") + " --loads " + std::to_string(loads) +
                          " --keep-freed-memory " + (keep_freed ? "true" : "false") + " --model-dir '" + model_dir +
                          "'";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return false;
  double load_ms = 0, pass_ms = 0, faults = 0;
  long long memory = 0;
  while (std::fscanf(p, "%lf %lf %lf %lld", &load_ms, &pass_ms, &faults, &memory) == 4) {
    side->load_ms.push_back(load_ms);
    if (pass_ms > 0) {
      side->pass_ms.push_back(pass_ms);
      side->faults_per_pass.push_back(faults);
    }
    if (memory > 0) side->memory = memory;
  }
  return pclose(p) == 0;
}

}  // namespace
}  // namespace shoal::bench

int main(int argc, char** argv) {
  using namespace shoal::bench;
  CLI::App app{"TorchScript load time: libtorch's allocator against weights on transparent huge pages"};
  std::string models_dir = SHOAL_DEFAULT_MODELS_DIR, child, model_dir;
  std::vector<std::string> models = {"tiny-bert", "minilm-l6"};
  int rounds = 5, loads = 6;
  bool keep_freed = true;
  app.add_option("--models-dir", models_dir, "Model repository")->capture_default_str();
  app.add_option("--models", models, "Models to load")->capture_default_str();
  app.add_option("--rounds", rounds, "Rounds; each runs both sides, alternating which goes first")->capture_default_str();
  app.add_option("--loads", loads, "Timed loads per side and round")->capture_default_str();
  app.add_option("--keep-freed-memory", keep_freed,
                 "Both sides keep freed memory for reuse, as the worker does by default (true or false)")
      ->capture_default_str();
  app.add_option("--child", child, "(internal) run one side: plain or huge");
  app.add_option("--model-dir", model_dir, "(internal) the child's model");
  CLI11_PARSE(app, argc, argv);
  if (!child.empty()) return Child(model_dir, child == "huge", keep_freed, loads);

  const std::string self = "/proc/" + std::to_string(::getpid()) + "/exe";
  std::printf("shoal_bench_load: %d rounds x %d timed loads per side, freed memory %s (kernel THP mode: %s)\n\n",
              rounds, loads, keep_freed ? "kept" : "glibc's defaults", shoal::TransparentHugePageMode().c_str());
  std::printf("%-12s %26s %26s %8s %22s %8s %22s %18s\n", "model", "load p50 ms plain / huge", "load min ms plain / huge",
              "ratio", "8x16 pass ms pl / hg", "ratio", "faults/pass pl / hg", "MiB plain / huge");
  for (const std::string& name : models) {
    Side plain, huge;
    for (int r = 0; r < rounds; ++r) {
      const bool huge_first = r % 2 == 1;
      for (int k = 0; k < 2; ++k) {
        const bool is_huge = (k == 0) == huge_first;
        if (!RunChild(self, models_dir + "/" + name, is_huge, keep_freed, loads, is_huge ? &huge : &plain)) {
          std::fprintf(stderr, "%s: the %s side failed\n", name.c_str(), is_huge ? "huge" : "plain");
          return 1;
        }
      }
    }
    const double lp = Median(plain.load_ms), lh = Median(huge.load_ms);
    const double mp = *std::min_element(plain.load_ms.begin(), plain.load_ms.end());
    const double mh = *std::min_element(huge.load_ms.begin(), huge.load_ms.end());
    const double pp = Median(plain.pass_ms), ph = Median(huge.pass_ms);
    std::printf("%-12s %12.1f / %-11.1f %12.1f / %-11.1f %8.2f %10.2f / %-9.2f %8.2f %10.0f / %-9.0f %8.1f / %-8.1f\n",
                name.c_str(), lp, lh, mp, mh, lh / lp, pp, ph, ph / pp, Median(plain.faults_per_pass),
                Median(huge.faults_per_pass), plain.memory / 1048576.0, huge.memory / 1048576.0);
  }
  std::printf("\nratio: huge / plain (below 1: faster with huge pages)\n");
  return 0;
}
