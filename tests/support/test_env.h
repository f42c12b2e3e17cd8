// Helpers shared by Shoal's integration and end-to-end tests: a private
// nats-server per test (real JetStream on a free loopback port), temp dirs
// and the paths of the source tree, build tree and generated models.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "queue/nats_server_process.h"

namespace shoal::testing {

// A fresh empty directory under $TMPDIR, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Starts nats-server -js on a free port; aborts the test on failure.
class TestNatsServer {
 public:
  TestNatsServer();
  std::string url() const { return proc_->url(); }
  NatsServerProcess& process() { return *proc_; }

 private:
  TempDir dir_;
  std::unique_ptr<NatsServerProcess> proc_;
};

// Writes a model repository of tiny-bert copies named `names` (artifacts
// linked, so each loads on its own) plus `broken` models whose model file is
// garbage, into the existing directory `dir`.
void MakeFleetRepository(const std::string& dir, const std::vector<std::string>& names,
                         const std::vector<std::string>& broken = {});

std::string SourceDir();   // $SHOAL_SOURCE_DIR
std::string BinaryDir();   // $SHOAL_BINARY_DIR
std::string ModelsDir();   // $SHOAL_MODELS_DIR or <source>/models
std::string ShoalBinary(); // <binary>/src/cli/shoal

}  // namespace shoal::testing
