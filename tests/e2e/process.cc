#include "e2e/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace shoal::e2e {
namespace {

// Reads /proc/<pid>/stat: state and parent pid. False if the process is gone.
bool ReadStat(pid_t pid, char* state, pid_t* ppid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  // The command name is in parentheses and may contain spaces.
  auto close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  rest >> *state >> *ppid;
  return static_cast<bool>(rest);
}

}  // namespace

std::vector<pid_t> Descendants(pid_t root) {
  std::multimap<pid_t, pid_t> children;  // parent -> child
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    pid_t pid = static_cast<pid_t>(std::stol(name));
    char state = 0;
    pid_t ppid = 0;
    if (ReadStat(pid, &state, &ppid)) children.emplace(ppid, pid);
  }
  std::vector<pid_t> out;
  std::vector<pid_t> todo = {root};
  while (!todo.empty()) {
    pid_t p = todo.back();
    todo.pop_back();
    auto [b, e] = children.equal_range(p);
    for (auto it = b; it != e; ++it) {
      out.push_back(it->second);
      todo.push_back(it->second);
    }
  }
  return out;
}

bool ProcessAlive(pid_t pid) {
  char state = 0;
  pid_t ppid = 0;
  return pid > 0 && ReadStat(pid, &state, &ppid) && state != 'Z' && state != 'X';
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

std::unique_ptr<ChildProcess> ChildProcess::Spawn(const ChildOptions& o) {
  if (o.argv.empty()) throw std::invalid_argument("ChildProcess: empty argv");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));

  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : o.env) env[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = o.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
  if (!o.stderr_path.empty())
    posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, o.stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                     0644);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  // Own process group, default signal mask and dispositions: the test
  // runner's blocked signals must not leak into the server.
  sigset_t empty, all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, args[0].c_str(), &fa, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    throw std::runtime_error("cannot start " + args[0] + ": " + std::strerror(rc));
  }
  auto p = std::unique_ptr<ChildProcess>(new ChildProcess());
  p->pid_ = pid;
  p->stdout_fd_ = fds[0];
  p->reader_ = std::thread([raw = p.get()] { raw->ReadLoop(); });
  return p;
}

ChildProcess::~ChildProcess() {
  Kill();
  stop_reader_ = true;
  if (reader_.joinable()) reader_.join();
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

void ChildProcess::ReadLoop() {
  std::string partial;
  char buf[4096];
  while (!stop_reader_) {
    pollfd pfd{stdout_fd_, POLLIN, 0};
    int r = ::poll(&pfd, 1, 100);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    ssize_t n = ::read(stdout_fd_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    partial.append(buf, static_cast<size_t>(n));
    std::vector<std::string> complete;
    size_t nl;
    while ((nl = partial.find('\n')) != std::string::npos) {
      complete.push_back(partial.substr(0, nl));
      partial.erase(0, nl + 1);
    }
    if (!complete.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& l : complete) lines_.push_back(std::move(l));
      cv_.notify_all();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!partial.empty()) lines_.push_back(std::move(partial));
  stdout_closed_ = true;
  cv_.notify_all();
}

std::optional<std::vector<std::string>> ChildProcess::WaitForLine(const std::string& pattern,
                                                                  std::chrono::milliseconds timeout) {
  const std::regex re(pattern);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  size_t checked = 0;
  for (;;) {
    for (; checked < lines_.size(); ++checked) {
      std::smatch m;
      if (std::regex_search(lines_[checked], m, re)) {
        std::vector<std::string> groups;
        for (const auto& g : m) groups.push_back(g.str());
        return groups;
      }
    }
    if (stdout_closed_) return std::nullopt;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && checked == lines_.size()) return std::nullopt;
  }
}

std::string ChildProcess::StdoutSoFar() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& l : lines_) out += l + "\n";
  return out;
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0 && !exited_) ::kill(pid_, sig);
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (exited_) return wait_status_;
  if (pid_ <= 0) return std::nullopt;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      wait_status_ = status;
      return status;
    }
    if (r < 0 && errno != EINTR) return std::nullopt;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void ChildProcess::Kill() {
  if (pid_ <= 0 || exited_) return;
  // Descendants first: `shoal serve` puts its nats-server in a group of its
  // own, which a signal to our child's group would miss.
  for (pid_t d : Descendants(pid_)) ::kill(d, SIGKILL);
  ::kill(-pid_, SIGKILL);
  ::kill(pid_, SIGKILL);
  Wait(std::chrono::seconds(10));
}

}  // namespace shoal::e2e
