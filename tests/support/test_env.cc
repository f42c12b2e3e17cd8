#include "support/test_env.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace shoal::testing {

namespace {
std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}
}  // namespace

TempDir::TempDir() {
  static std::atomic<int> counter{0};
  auto p = std::filesystem::temp_directory_path() /
           ("shoal-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  path_ = p.string();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

TestNatsServer::TestNatsServer() {
  NatsServerOptions o;
  o.data_dir = dir_.path() + "/js";
  auto r = NatsServerProcess::Start(o);
  if (!r.ok()) throw std::runtime_error("cannot start nats-server: " + r.status().ToString());
  proc_ = std::move(r).value();
}

std::string SourceDir() {
  return Env("SHOAL_SOURCE_DIR",
             std::filesystem::path(__FILE__).parent_path().parent_path().parent_path().string());
}
std::string BinaryDir() { return Env("SHOAL_BINARY_DIR", SourceDir() + "/build"); }
std::string ModelsDir() { return Env("SHOAL_MODELS_DIR", SourceDir() + "/models"); }
std::string ShoalBinary() { return BinaryDir() + "/src/cli/shoal"; }

void MakeFleetRepository(const std::string& dir, const std::vector<std::string>& names,
                         const std::vector<std::string>& broken) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(ModelsDir()) / "tiny-bert";
  std::ifstream in(src / "shoal.json");
  nlohmann::json config = nlohmann::json::parse(in);
  auto make = [&](const std::string& name, bool bad) {
    const fs::path d = fs::path(dir) / name;
    fs::create_directories(d);
    config["name"] = name;
    std::ofstream(d / "shoal.json") << config.dump(2);
    fs::create_symlink(src / "vocab.txt", d / "vocab.txt");
    if (bad) {
      std::ofstream(d / "model.pt") << "this is not a TorchScript archive";
    } else {
      fs::create_symlink(src / "model.pt", d / "model.pt");
    }
  };
  for (const auto& n : names) make(n, false);
  for (const auto& n : broken) make(n, true);
}

}  // namespace shoal::testing
