// Helpers shared by Shoal's integration and end-to-end tests: a private
// nats-server per test (real JetStream on a free loopback port), temp dirs
// and the paths of the source tree, build tree and generated models.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "queue/nats_server_process.h"

namespace shoal::testing {

// Polls `pred` every `poll` until it holds; false once `timeout` has passed.
// Synchronisation only, never a timing assertion.
template <typename Pred>
bool Eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(20),
                std::chrono::milliseconds poll = std::chrono::milliseconds(20)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(poll);
  }
  return true;
}

// A fresh empty directory under $TMPDIR, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A loopback TCP port held by a listening socket that accepts nothing
// (for a port in use), closed by the destructor; port() is -1 when it
// could not be opened.
class HeldPort {
 public:
  HeldPort();
  ~HeldPort();
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = -1;
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
