// ChildProcess: runs a built binary (usually `shoal`) for end-to-end tests.
// The child gets its own process group and a pipe on stdout that a reader
// thread drains into lines, so tests can wait for "ready" lines that carry a
// port. The destructor SIGKILLs the child's group and every descendant it
// can find, then reaps: a failed test never leaves servers behind.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace shoal::e2e {

struct ChildOptions {
  std::vector<std::string> argv;  // argv[0] is the path of the binary
  // Added to (or replacing in) the test's own environment.
  std::vector<std::pair<std::string, std::string>> env;
  // Child's stderr goes here (appended); empty: inherit the test's stderr.
  std::string stderr_path;
};

class ChildProcess {
 public:
  // Spawns the child; throws std::runtime_error when it cannot.
  static std::unique_ptr<ChildProcess> Spawn(const ChildOptions& options);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Blocks until a stdout line matches `pattern` (std::regex_search) and
  // returns its match groups, or nullopt after `timeout` or once stdout is
  // closed. Lines already read count too. Thread-safe.
  std::optional<std::vector<std::string>> WaitForLine(const std::string& pattern,
                                                      std::chrono::milliseconds timeout);
  // Every stdout line read so far, joined with '\n'.
  std::string StdoutSoFar() const;

  // Sends `sig` to the child only (not its group). No-op once reaped.
  void Signal(int sig);
  // Waits up to `timeout` for the child to exit and reaps it. Returns the
  // raw wait status, or nullopt if it is still running. Idempotent.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  bool Exited() const { return exited_; }
  // SIGKILL to the child's group and its descendants, then reap. Idempotent.
  void Kill();

 private:
  ChildProcess() = default;
  void ReadLoop();

  pid_t pid_ = -1;
  bool exited_ = false;
  int wait_status_ = 0;
  int stdout_fd_ = -1;

  mutable std::mutex mu_;  // guards lines_, stdout_closed_
  std::condition_variable cv_;
  std::vector<std::string> lines_;
  bool stdout_closed_ = false;
  std::atomic<bool> stop_reader_{false};
  std::thread reader_;
};

// Pids of every live process whose parent chain leads to `pid` (from /proc).
std::vector<pid_t> Descendants(pid_t pid);
// True while /proc/<pid> exists and is not a zombie.
bool ProcessAlive(pid_t pid);
// "exit 0", "signal 9" for a raw wait status.
std::string DescribeWaitStatus(int status);

}  // namespace shoal::e2e
