#include "support/test_env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace shoal::testing {

namespace {
std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// A test binary that runs longer than SHOAL_TEST_WATCHDOG_S seconds (260
// by default: under the suite's CTest timeout of 300 s per binary, with
// time left for gdb; 0: off) gets the running test case named and every
// thread's stack printed to stderr (by gdb, when it is installed), and is
// aborted, so a rare hang leaves its stacks in the test log instead of a
// bare timeout. Installed in every test binary that links this file.
class HangWatchdog {
 public:
  // Starts the watchdog; the object is never destroyed (its thread polls it
  // until the process ends).
  static HangWatchdog* Start(int limit_s) {
    auto* w = new HangWatchdog(limit_s);
    std::thread([w] { w->Watch(); }).detach();
    return w;
  }
  void SetRunning(std::string name) {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = std::move(name);
  }

  // Forwards gtest's events to the watchdog (gtest owns and deletes it at exit).
  class Listener final : public ::testing::EmptyTestEventListener {
   public:
    explicit Listener(HangWatchdog* w) : w_(w) {}
    void OnTestStart(const ::testing::TestInfo& info) override {
      w_->SetRunning(std::string(info.test_suite_name()) + "." + info.name());
    }
    void OnTestEnd(const ::testing::TestInfo&) override { w_->SetRunning("(between test cases)"); }

   private:
    HangWatchdog* const w_;
  };

 private:
  explicit HangWatchdog(int limit_s)
      : deadline_(std::chrono::steady_clock::now() + std::chrono::seconds(limit_s)), limit_s_(limit_s) {}

  void Watch() {
    while (std::chrono::steady_clock::now() < deadline_) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::string running;
    {
      std::lock_guard<std::mutex> lock(mu_);
      running = running_;
    }
    // write(2), not stdio: a hung thread may hold stderr's lock.
    Say("\nwatchdog: this test binary has run over " + std::to_string(limit_s_) + " s; running: " + running +
        "\nwatchdog: every thread's stack follows\n");
    PrintStacks();
    std::abort();
  }

  static void Say(const std::string& text) { (void)!::write(2, text.data(), text.size()); }

  static void PrintStacks() {
    // Lets gdb attach where Yama restricts ptrace to descendants.
    (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    const std::string pid = std::to_string(::getpid());
    const pid_t child = ::fork();
    if (child == 0) {
      ::dup2(2, 1);
      ::execlp("timeout", "timeout", "30", "gdb", "-p", pid.c_str(), "-batch", "-nx", "-ex", "thread apply all bt",
               nullptr);
      ::_exit(126);
    }
    if (child > 0) {
      int status = 0;
      ::waitpid(child, &status, 0);
      // timeout(1) exits 127 when it cannot run gdb.
      if (WIFEXITED(status) && WEXITSTATUS(status) >= 126) Say("watchdog: gdb is not installed; no stacks\n");
    }
  }

  const std::chrono::steady_clock::time_point deadline_;
  const int limit_s_;
  std::mutex mu_;
  std::string running_ = "(before the first test case)";  // guarded by mu_
};

const bool kHangWatchdogInstalled = [] {
  const int limit_s = std::atoi(Env("SHOAL_TEST_WATCHDOG_S", "260").c_str());
  if (limit_s > 0)
    ::testing::UnitTest::GetInstance()->listeners().Append(new HangWatchdog::Listener(HangWatchdog::Start(limit_s)));
  return true;
}();
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

HeldPort::HeldPort() {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 && ::listen(fd_, 16) == 0 &&
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port_ = ntohs(addr.sin_port);
}

HeldPort::~HeldPort() {
  if (fd_ >= 0) ::close(fd_);
}

TestNatsServer::TestNatsServer() {
  NatsServerOptions o;
  o.data_dir = dir_.path() + "/js";
  // A test binary killed (a ctest timeout, a crash) takes its server with
  // it. Fixtures start it on the test's own (main) thread.
  o.die_with_parent = true;
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
