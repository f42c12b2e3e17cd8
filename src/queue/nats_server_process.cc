#include "queue/nats_server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "common/child_process.h"
#include "common/search_path.h"

namespace shoal {

Status NatsServerOptions::Validate() const {
  if (data_dir.empty()) return InvalidArgument("nats-server data_dir is required");
  if (port < 0 || port > 65535) return InvalidArgument("nats-server port out of range");
  return Status::Ok();
}

Result<int> PickFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Internal("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return Unavailable("bind() to a free port failed");
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

std::string FindExecutable(const std::string& binary) {
  if (binary.empty()) return "";
  if (binary.find('/') != std::string::npos) return binary;
  // PATH unset: what execvp searches then; an empty entry within it is the
  // working directory, as for execvp, but none is added.
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr && *path != '\0' ? path : "/bin:/usr/bin";
  dirs += ":/usr/local/sbin:/usr/sbin:/sbin";
  return SearchPath(dirs, binary);
}

bool PortAcceptsConnections(const std::string& host, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

namespace {

// The server's log from `offset` on says it is ready. Its port answering is
// not enough: another process may have taken the port picked for it first
// (this server then fails to bind and exits).
bool LogSaysReady(const std::string& log, std::streamoff offset) {
  std::ifstream in(log, std::ios::binary);
  if (!in || !in.seekg(offset)) return false;
  std::string line;
  while (std::getline(in, line))
    if (line.find("Server is ready") != std::string::npos) return true;
  return false;
}

// Starts argv with stdin from /dev/null, stdout and stderr to `log`, in its
// own process group (a Ctrl-C aimed at us is forwarded by us, in order) and,
// with `die_with_parent`, PR_SET_PDEATHSIG (which posix_spawn cannot set).
// Fork and exec, with a close-on-exec pipe that carries the errno of a
// failed exec back. Returns 0 or that errno.
int Spawn(std::vector<char*>& argv, const std::string& log, bool die_with_parent, int inherit_fd, pid_t* pid) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return errno;
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    const int e = errno;
    ::close(pipefd[0]);
    ::close(pipefd[1]);
    return e;
  }
  if (child == 0) {
    // Only async-signal-safe calls from here on.
    ::setpgid(0, 0);
    UnblockAllSignalsInChild();
    int e = 0;
    if (die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);  // the parent died already
    }
    if (inherit_fd >= 0) {
      const int flags = ::fcntl(inherit_fd, F_GETFD);
      if (flags >= 0) ::fcntl(inherit_fd, F_SETFD, flags & ~FD_CLOEXEC);
    }
    const int in = ::open("/dev/null", O_RDONLY);
    const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (in < 0 || out < 0 || ::dup2(in, STDIN_FILENO) < 0 || ::dup2(out, STDOUT_FILENO) < 0 ||
        ::dup2(out, STDERR_FILENO) < 0) {
      e = errno;
    } else {
      ::execv(argv[0], argv.data());
      e = errno;
    }
    (void)!::write(pipefd[1], &e, sizeof e);
    ::_exit(127);
  }
  ::close(pipefd[1]);
  int e = 0;
  ssize_t n;
  do {
    n = ::read(pipefd[0], &e, sizeof e);
  } while (n < 0 && errno == EINTR);
  ::close(pipefd[0]);
  if (n == static_cast<ssize_t>(sizeof e)) {  // exec failed: reap the child
    ::waitpid(child, nullptr, 0);
    return e != 0 ? e : ENOEXEC;
  }
  *pid = child;
  return 0;
}

}  // namespace

Result<std::unique_ptr<NatsServerProcess>> NatsServerProcess::Start(const NatsServerOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  std::error_code ec;
  std::filesystem::create_directories(o.data_dir, ec);
  if (ec) return Internal("cannot create " + o.data_dir + ": " + ec.message());
  const std::string binary = FindExecutable(o.binary);
  if (binary.empty()) {
    return Unavailable("cannot start " + o.binary + ": not found on PATH nor in /usr/local/sbin, /usr/sbin "
                       "or /sbin (install the nats-server package: scripts/install-deps.sh)");
  }
  const std::string log = o.log_file.empty() ? o.data_dir + "/nats-server.log" : o.log_file;
  // A port picked here may be taken by another process before the server
  // binds it; the server then exits, and another port is tried.
  constexpr int kPickedPortTries = 3;
  for (int attempt = 1;; ++attempt) {
    auto proc = std::unique_ptr<NatsServerProcess>(new NatsServerProcess());
    proc->options_ = o;
    proc->port_ = o.port;
    if (proc->port_ == 0) {
      ASSIGN_OR_RETURN(proc->port_, PickFreePort());
    }
    // The log is appended to across runs: only what this run writes tells
    // that it is ready.
    const uintmax_t logged = std::filesystem::file_size(log, ec);
    const std::streamoff log_offset = ec ? 0 : static_cast<std::streamoff>(logged);
    std::string port = std::to_string(proc->port_);
    std::vector<std::string> args = {binary, "-sd", o.data_dir, "-a", o.host, "-p", port, "-l", log};
    if (o.jetstream) args.insert(args.begin() + 1, "-js");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    pid_t pid = -1;
    int rc = Spawn(argv, log, o.die_with_parent, o.inherit_fd, &pid);
    if (rc != 0) return Unavailable("cannot start " + binary + ": " + std::strerror(rc));
    proc->pid_ = pid;
    bool exited = false;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(o.ready_timeout_ms);
    while (std::chrono::steady_clock::now() < deadline) {
      int wstatus = 0;
      if (::waitpid(pid, &wstatus, WNOHANG) == pid) {
        proc->pid_ = -1;
        exited = true;
        break;
      }
      if (PortAcceptsConnections(o.host, proc->port_) && LogSaysReady(log, log_offset)) return proc;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (exited && o.port == 0 && attempt < kPickedPortTries) continue;
    if (exited) return Unavailable("nats-server exited during start-up; see " + log);
    proc->Stop();
    return Unavailable("nats-server did not accept connections within " +
                       std::to_string(o.ready_timeout_ms) + " ms; see " + log);
  }
}

std::string NatsServerProcess::url() const {
  return "nats://" + options_.host + ":" + std::to_string(port_);
}

void NatsServerProcess::Stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 250; ++i) {  // 5 s grace: it flushes its file store
    int wstatus = 0;
    if (::waitpid(pid_, &wstatus, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

NatsServerProcess::~NatsServerProcess() { Stop(); }

}  // namespace shoal
