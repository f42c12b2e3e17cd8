#include "runtime/process/process_runtime.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/child_process.h"
#include "common/log.h"
#include "common/search_path.h"
#include "runtime/process/frame.h"

extern char** environ;

namespace shoal {
namespace {

using runtime_protocol::NowMonoUs;
using runtime_protocol::Reply;

constexpr int64_t kFirstBackoffMs = 100;

Status Crashed(const std::string& why) { return Unavailable("runtime process: " + why, "runtime_crashed"); }

// Process `pid`'s resident set, and the part of it that is file-backed or
// shared memory (statm's third field); 0, 0 when it cannot be read.
std::pair<int64_t, int64_t> StatmBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/statm");
  int64_t size = 0, resident = 0, shared = 0;
  if (!(in >> size >> resident >> shared)) return {0, 0};
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  return {resident * page, shared * page};
}

// The pages only process `pid` maps (smaps_rollup's Private_Clean and
// Private_Dirty): what it adds beside the process it was forked from, whose
// pages it shares copy-on-write. Without smaps_rollup (Linux < 4.14), its
// anonymous resident pages, which may count shared ones twice.
int64_t PrivateBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  int64_t kib = 0;
  bool found = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Private_Clean:", 0) != 0 && line.rfind("Private_Dirty:", 0) != 0) continue;
    kib += std::strtoll(line.c_str() + line.find(':') + 1, nullptr, 10);
    found = true;
  }
  if (found) return kib * 1024;
  const auto [resident, shared] = StatmBytes(pid);
  return std::max<int64_t>(resident - shared, 0);
}

// What a runtime's processes hold: the leader's resident set, plus the
// private pages of every other process in its process group (workers it
// forked, a model server it started). Their whole resident sets would
// count the pages they share with the leader twice.
int64_t GroupResidentBytes(pid_t leader) {
  int64_t total = StatmBytes(leader).first;
  std::error_code ec;
  // increment(ec), not ++: a readdir error ends the scan instead of throwing.
  for (auto it = std::filesystem::directory_iterator("/proc", ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::strtol(name.c_str(), nullptr, 10));
    if (pid == leader) continue;
    // stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and ')'.
    std::ifstream in("/proc/" + name + "/stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;  // gone since the listing
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 1));
    char state = 0;
    long ppid = 0, pgrp = 0;
    if (!(fields >> state >> ppid >> pgrp) || pgrp != leader) continue;
    total += PrivateBytes(pid);
  }
  return total;
}

// Whether child `pid` has exited, leaving it unreaped: while it is a zombie
// its pid, and so its process group's id, cannot be reused, so the group
// kill of KillGroupAndReap reaches only what it started. `info` (may be
// null) says how it ended.
bool HasExited(pid_t pid, siginfo_t* info) {
  siginfo_t local{};
  siginfo_t* i = info != nullptr ? info : &local;
  i->si_pid = 0;
  if (::waitid(P_PID, static_cast<id_t>(pid), i, WEXITED | WNOHANG | WNOWAIT) != 0) return errno == ECHILD;
  return i->si_pid == pid;
}

// Kills what is left of `pid`'s process group (`pid` too, if it still
// runs), then reaps `pid`.
void KillGroupAndReap(pid_t pid) {
  siginfo_t info{};
  // Reaped already (never here): its group's id may be another's by now.
  if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 && errno == ECHILD) return;
  ::kill(-pid, SIGKILL);
  ::kill(pid, SIGKILL);  // also when it has left its group (or not yet joined it)
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
}

// A descriptor that becomes readable when `pid` exits; -1 where the kernel
// has no pidfd_open (before Linux 5.3).
int OpenPidFd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

// The reason for a runtime's refusal: its own error code where it is one the
// protocol names, else `fallback`. A runtime's code never becomes one the
// worker acts on itself (device_fault would take the whole worker out of the
// fleet).
std::string RuntimeReason(const std::string& code, const char* fallback) {
  static constexpr std::string_view kProtocolCodes[] = {
      "unsupported_protocol", "unsupported_task", "unknown_op", "not_loaded",
      "invalid_batch",        "bad_output",       "model_load_failed", "runtime_error"};
  for (std::string_view known : kProtocolCodes)
    if (code == known) return code;
  return fallback;
}

// Resolves a path given in the model config: absolute as is, else relative
// to the model directory.
std::string InModelDir(const ModelConfig& c, const std::string& p) {
  if (p.empty()) return c.dir;
  if (p.front() == '/') return p;
  return (std::filesystem::path(c.dir) / p).lexically_normal().string();
}

// The program a command names, found on the PATH of `env` (the runtime's,
// where the config may put a virtualenv's bin first): execvpe would search
// the worker's own PATH. A name with a slash is used as is; without a PATH
// in `env`, execvpe's own search applies.
Result<std::string> FindProgram(const std::string& name, const std::vector<std::string>& env, const std::string& cwd) {
  if (name.empty() || name.find('/') != std::string::npos) return name;
  const std::string* path = nullptr;
  for (const auto& e : env)
    if (e.rfind("PATH=", 0) == 0) path = &e;
  if (path == nullptr) return name;
  const std::string dirs = path->substr(5);
  if (std::string found = SearchPath(dirs, name, cwd); !found.empty()) return found;
  return Status(StatusCode::kBadGateway, "runtime command '" + name + "' is not on the runtime's PATH (" + dirs + ")",
                "runtime_start_failed");
}

// Starts `argv` with `env` in `cwd`; the child dies with this thread's
// process (PDEATHSIG), so a killed worker never leaves runtimes behind.
Result<pid_t> Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env, const std::string& cwd) {
  if (argv.empty()) return InvalidArgument("runtime command is empty");
  ASSIGN_OR_RETURN(const std::string program, FindProgram(argv[0], env, cwd));
  std::vector<char*> args, envp;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Internal(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Child: plain system calls only. Its own process group, so a restart
    // kills whatever it started too; none of the worker's descriptors (the
    // NATS connection, the HTTP listener) leak into it.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    UnblockAllSignalsInChild();
    if (::getppid() != parent) ::_exit(127);
    if (::syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
      for (int fd = 3; fd < 65536; ++fd) ::close(fd);
    }
    // No terminal input: in a background group, a read of the worker's
    // terminal (a debugger, a library's prompt) would stop the runtime
    // (SIGTTIN) and look like a hang. stdout and stderr stay the worker's.
    // (After the close: a worker at its descriptor limit has room now.)
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull < 0 || ::dup2(devnull, 0) < 0) ::_exit(126);
    if (devnull != 0) ::close(devnull);
    if (::chdir(cwd.c_str()) != 0) ::_exit(126);
    ::execvpe(program.c_str(), args.data(), envp.data());
    ::_exit(127);
  }
  // Here too, so the group exists before anything kills it: the child may
  // not have run yet.
  ::setpgid(pid, pid);
  return pid;
}

}  // namespace

ProcessRuntime::~ProcessRuntime() { Unload(); }

Status ProcessRuntime::Load(const ModelConfig& config) {
  if (config.process.command.empty()) return InvalidArgument("runtime 'process' needs process.command");
  config_ = config;
  try {
    supervisor_ = std::thread([this] { SuperviseLoop(); });
  } catch (const std::exception& e) {
    return Internal(std::string("cannot start the runtime's supervisor thread: ") + e.what());
  }
  std::unique_lock<std::mutex> lock(sup_mu_);
  start_requested_ = true;
  sup_cv_.notify_all();
  sup_cv_.wait(lock, [this] { return start_done_; });
  Status s = start_status_;
  lock.unlock();
  if (!s.ok()) Unload();
  return s;
}

void ProcessRuntime::Unload() {
  {
    std::lock_guard<std::mutex> lock(sup_mu_);
    stop_ = true;
  }
  sup_cv_.notify_all();
  // A restart waiting for the runtime's hello or load (up to the start
  // timeout) ends at once when the process does: what it started is not
  // wanted any more. (The connect loop sees stop_ itself.)
  if (restarting_) {
    // Under reap_mu_: a pid still in pid_ is not reaped yet, so it is the
    // runtime's and not a process that reused it.
    std::lock_guard<std::mutex> reap(reap_mu_);
    const pid_t pid = pid_.load();
    if (pid > 0) ::kill(pid, SIGKILL);
  }
  if (supervisor_.joinable()) supervisor_.join();
}

Status ProcessRuntime::Start() {
  const ProcessConfig& p = config_.process;
  const int64_t deadline = NowMonoUs() + p.start_timeout_ms * 1000;
  char dir_template[] = "/tmp/shoal-runtime-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) return Internal(std::string("mkdtemp: ") + std::strerror(errno));
  {
    std::lock_guard<std::mutex> lock(io_mu_);
    socket_dir_ = dir_template;
  }
  const std::string socket_path = std::string(dir_template) + "/runtime.sock";

  std::vector<std::string> argv = p.command;
  if (argv[0].find('/') != std::string::npos) argv[0] = InModelDir(config_, argv[0]);
  // The worker's environment, less what the config and Shoal set: a name
  // given twice would reach getenv() with the worker's value first.
  std::vector<std::pair<std::string, std::string>> own = p.env;
  own.emplace_back("SHOAL_RUNTIME_SOCKET", socket_path);
  own.emplace_back("SHOAL_MODEL_DIR", config_.dir);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (std::none_of(own.begin(), own.end(), [&](const auto& kv) { return kv.first == name; }))
      env.emplace_back(entry);
  }
  for (const auto& [k, v] : own) env.push_back(k + "=" + v);
  auto spawned = Spawn(argv, env, InModelDir(config_, p.cwd));
  if (!spawned.ok()) {
    std::lock_guard<std::mutex> io(io_mu_);
    StopProcessLocked(false);  // removes the socket directory
    return spawned.status();
  }
  const pid_t pid = *spawned;
  pid_ = pid;

  // The runtime listens; connect once it does (or give up if it exits).
  int fd = -1;
  while (true) {
    siginfo_t exited{};
    if (HasExited(pid, &exited)) {
      {
        std::lock_guard<std::mutex> io(io_mu_);
        StopProcessLocked(false);  // kills its group, reaps it, removes the socket directory
      }
      return Status(StatusCode::kBadGateway,
                    "runtime process exited during start (" +
                        (exited.si_code == CLD_EXITED ? "exit code " + std::to_string(exited.si_status)
                                                      : "signal " + std::to_string(exited.si_status)) +
                        "): " + argv[0],
                    "runtime_start_failed");
    }
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    ::close(fd);
    fd = -1;
    if (NowMonoUs() > deadline || stop_) break;  // unloading: a restart's wait would hold up the unload
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::lock_guard<std::mutex> lock(io_mu_);
  if (fd < 0) {
    StopProcessLocked(false);
    if (stop_) return Unavailable("the model was unloaded while its runtime started", "runtime_start_failed");
    return DeadlineExceeded("runtime process did not listen on its socket within " +
                                std::to_string(p.start_timeout_ms) + " ms",
                            "runtime_start_failed");
  }
  fd_ = fd;
  pidfd_ = OpenPidFd(pid);
  auto fail = [&](Status s) {
    StopProcessLocked(false);
    return s;
  };
  const int64_t left_ms = std::max<int64_t>(1, (deadline - NowMonoUs()) / 1000);
  const uint64_t hello_id = next_id_++;
  auto hello = CallLocked(runtime_protocol::EncodeHello(hello_id, "shoal-worker"), hello_id, left_ms);
  if (!hello.ok()) return fail(hello.status());
  if (!hello->ok) return fail(Status(StatusCode::kBadGateway, "runtime refused hello: " + hello->error_message,
                                     RuntimeReason(hello->error_code, "runtime_start_failed")));
  if (hello->protocol != runtime_protocol::kProtocolVersion) {
    return fail(Status(StatusCode::kBadGateway,
                       "runtime speaks protocol " + std::to_string(hello->protocol) + ", this worker speaks " +
                           std::to_string(runtime_protocol::kProtocolVersion),
                       "unsupported_protocol"));
  }
  if (std::find(hello->tasks.begin(), hello->tasks.end(), config_.task) == hello->tasks.end()) {
    return fail(Status(StatusCode::kBadGateway, "runtime " + hello->runtime + " does not do task '" + config_.task + "'",
                       "unsupported_task"));
  }
  const uint64_t load_id = next_id_++;
  auto loaded = CallLocked(runtime_protocol::EncodeLoad(load_id, config_), load_id,
                           std::max<int64_t>(1, (deadline - NowMonoUs()) / 1000));
  if (!loaded.ok()) return fail(loaded.status());
  if (!loaded->ok) {
    return fail(Status(StatusCode::kBadGateway, "runtime could not load the model: " + loaded->error_message,
                       "model_load_failed"));
  }
  if (loaded->dim <= 0) return fail(Status(StatusCode::kBadGateway, "runtime reported no dim", "runtime_protocol_error"));
  // The width the model config names, or (a restart) the width it served:
  // callers and the catalog rely on it.
  const int want_dim = config_.dim > 0 ? config_.dim : dim_.load();
  if (want_dim > 0 && loaded->dim != want_dim) {
    return fail(Status(StatusCode::kBadGateway,
                       "runtime loaded the model with width " + std::to_string(loaded->dim) + ", " +
                           (config_.dim > 0 ? "the model config says " : "it served ") + std::to_string(want_dim),
                       "model_load_failed"));
  }
  // A full batch must fit a frame both ways, or every full batch would
  // fail as a protocol error and restart the runtime. Requests: an int32
  // id and a uint8 mask per token (and a uint8 segment id for text pairs),
  // at most max_batch_tokens and at most max_batch_size rows of
  // max_seq_len; replies: float32 × dim per row. (4 KiB for the map
  // around them.) Sizes are bounded by the config's checks: no overflow.
  const BatchingConfig& b = config_.batching;
  const int64_t rows = b.max_batch_size;
  const int64_t tokens = std::min<int64_t>(b.max_batch_tokens, rows * config_.max_seq_len);
  const int64_t reply_bytes = rows * loaded->dim * 4 + 4096;
  const int64_t request_bytes = tokens * (config_.TakesPairs() ? 6 : 5) + 4096;
  if (std::max(reply_bytes, request_bytes) > config_.process.max_frame_bytes) {
    return fail(Status(StatusCode::kBadGateway,
                       "process.max_frame_bytes (" + std::to_string(config_.process.max_frame_bytes) +
                           ") is smaller than a full batch needs: " + std::to_string(reply_bytes) +
                           " bytes of reply (max_batch_size x dim x 4) and " + std::to_string(request_bytes) +
                           " of request (max_batch_tokens, or max_batch_size x max_seq_len if less, x 5, x 6 for "
                           "text pairs)",
                       "model_load_failed"));
  }
  dim_ = loaded->dim;
  memory_bytes_ = std::max(loaded->memory_bytes, GroupResidentBytes(pid));
  up_ = true;
  LOG_INFO("runtime", "process runtime " << hello->runtime << " (pid " << pid << ") serves " << config_.name << ", dim "
                                         << loaded->dim);
  return Status::Ok();
}

Result<Reply> ProcessRuntime::CallLocked(const std::string& frame, uint64_t id, int64_t timeout_ms) {
  const int64_t deadline = NowMonoUs() + timeout_ms * 1000;
  // With the pidfd, a process that dies mid-call ends the wait at once,
  // even when processes it started (forked multiprocessing workers) still
  // hold the socket open.
  RETURN_IF_ERROR(runtime_protocol::WriteFrame(fd_, frame, deadline, pidfd_));
  ASSIGN_OR_RETURN(std::string data,
                   runtime_protocol::ReadFrame(fd_, config_.process.max_frame_bytes, deadline, pidfd_));
  last_io_mono_us_ = NowMonoUs();
  auto reply = runtime_protocol::DecodeReply(data);
  if (!reply.ok()) return Status(StatusCode::kBadGateway, reply.status().message(), "malformed_frame");
  if (reply->id != id) {
    return Status(StatusCode::kBadGateway,
                  "runtime answered request " + std::to_string(reply->id) + " to request " + std::to_string(id),
                  "malformed_frame");
  }
  return reply;
}

void ProcessRuntime::MarkDownLocked(const Status& why) {
  LOG_WARN("runtime", "process runtime for " << config_.name << " is down: " << why.ToString());
  up_ = false;
  StopProcessLocked(false);
}

void ProcessRuntime::StopProcessLocked(bool graceful) {
  if (fd_ >= 0 && graceful) {
    const uint64_t id = next_id_++;
    (void)CallLocked(runtime_protocol::EncodeSimple(id, "shutdown"), id, 1000);
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (pidfd_ >= 0) ::close(pidfd_);
  pidfd_ = -1;
  std::lock_guard<std::mutex> reap(reap_mu_);
  if (const pid_t pid = pid_.exchange(-1); pid > 0) {
    const int64_t until = NowMonoUs() + (graceful ? 2'000'000 : 0);
    while (!HasExited(pid, nullptr) && NowMonoUs() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    KillGroupAndReap(pid);  // its whole process group: anything it left behind too
  }
  if (!socket_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(socket_dir_, ec);
    socket_dir_.clear();
  }
}

Result<Embeddings> ProcessRuntime::Run(const TokenBatch& batch) {
  if (restarting_ || !up_) return Unavailable("runtime process for " + config_.name + " is restarting", "runtime_crashed");
  std::lock_guard<std::mutex> lock(io_mu_);
  if (!up_ || fd_ < 0) return Unavailable("runtime process for " + config_.name + " is restarting", "runtime_crashed");
  const uint64_t id = next_id_++;
  auto reply = CallLocked(runtime_protocol::EncodeRun(id, config_.task, batch),
                          id, config_.process.request_timeout_ms);
  if (!reply.ok()) {
    // The stream cannot be trusted any more: restart, and let the work be
    // redelivered.
    MarkDownLocked(reply.status());
    return Crashed(reply.status().message());
  }
  if (!reply->ok) {
    return Status(StatusCode::kInternal, "runtime: " + reply->error_message,
                  RuntimeReason(reply->error_code, "runtime_error"));
  }
  const int dim = dim_.load();
  if (reply->rows != batch.rows || reply->embeddings.size() != static_cast<size_t>(batch.rows) * dim * sizeof(float)) {
    return Internal("runtime returned " + std::to_string(reply->rows) + " rows / " +
                        std::to_string(reply->embeddings.size()) + " bytes for " + std::to_string(batch.rows) +
                        " rows of dim " + std::to_string(dim),
                    "runtime_error");
  }
  Embeddings out;
  out.rows = batch.rows;
  out.dim = dim;
  out.data.resize(static_cast<size_t>(batch.rows) * dim);
  std::memcpy(out.data.data(), reply->embeddings.data(), reply->embeddings.size());
  return out;
}

Status ProcessRuntime::Health() const {
  std::lock_guard<std::mutex> lock(sup_mu_);
  return gave_up_;
}

void ProcessRuntime::SuperviseLoop() {
  // Restarts back off exponentially while the process keeps dying soon
  // after a start; a process that stayed up for a minute starts afresh.
  constexpr int64_t kStableUs = 60'000'000;
  int64_t backoff_ms = kFirstBackoffMs;
  int64_t next_start_us = 0;
  int64_t up_since_us = 0;
  bool was_up = false;
  int failed_starts = 0;  // restarts in a row whose Start() failed
  bool gave_up = false;
  std::unique_lock<std::mutex> lock(sup_mu_);
  sup_cv_.wait(lock, [this] { return stop_.load() || start_requested_; });
  if (!stop_) {
    lock.unlock();
    Status s = Start();
    lock.lock();
    start_status_ = s;
    if (!s.ok()) stop_ = true;  // Load() fails: nothing to supervise
    was_up = s.ok();
    up_since_us = NowMonoUs();
  } else {
    start_status_ = Unavailable("unloaded before start", "shutting_down");
  }
  start_done_ = true;
  sup_cv_.notify_all();
  while (!stop_) {
    sup_cv_.wait_for(lock, std::chrono::milliseconds(std::min<int64_t>(config_.process.health_interval_ms, 200)),
                     [this] { return stop_.load(); });
    if (stop_) break;
    lock.unlock();
    if (up_) {
      std::unique_lock<std::mutex> io(io_mu_, std::try_to_lock);  // a batch in flight is its own health check
      if (io.owns_lock() && up_) {
        siginfo_t exited{};
        const pid_t pid = pid_.load();
        if (pid > 0 && HasExited(pid, &exited)) {
          // The group outlives its leader: what the runtime started (worker
          // processes, helpers) would otherwise keep memory and ports.
          {
            std::lock_guard<std::mutex> reap(reap_mu_);
            pid_ = -1;
            KillGroupAndReap(pid);
          }
          MarkDownLocked(Crashed(exited.si_code == CLD_EXITED
                                     ? "exited with code " + std::to_string(exited.si_status)
                                     : "killed by signal " + std::to_string(exited.si_status)));
        } else if (NowMonoUs() - last_io_mono_us_ >= config_.process.health_interval_ms * 1000) {
          const uint64_t id = next_id_++;
          auto pong = CallLocked(runtime_protocol::EncodeSimple(id, "ping"), id,
                                 std::min<int64_t>(config_.process.request_timeout_ms, 5000));
          if (!pong.ok() || !pong->ok) MarkDownLocked(pong.ok() ? Crashed("ping refused") : pong.status());
        }
      }
    }
    const int64_t now = NowMonoUs();
    const bool up = up_;  // read once: Run may mark it down between two reads
    if (was_up && !up) {  // went down (here, or in Run)
      was_up = false;
      if (now - up_since_us >= kStableUs) backoff_ms = kFirstBackoffMs;
      next_start_us = now + backoff_ms * 1000;
      backoff_ms = std::min(backoff_ms * 2, config_.process.max_restart_backoff_ms);
    }
    if (!up && !gave_up && now >= next_start_us) {
      restarting_ = true;
      Status s = Start();
      restarting_ = false;
      if (!s.ok() && stop_) {
        // Unload killed the process it was starting: not a failed start.
        lock.lock();
        break;
      }
      if (s.ok()) {
        ++restarts_;
        failed_starts = 0;
        was_up = true;
        up_since_us = NowMonoUs();
      } else if (config_.process.max_failed_starts > 0 && ++failed_starts >= config_.process.max_failed_starts) {
        LOG_ERROR("runtime", "giving up on the runtime for " << config_.name << " after " << failed_starts
                                                             << " failed starts in a row: " << s.ToString());
        gave_up = true;
        std::lock_guard<std::mutex> g(sup_mu_);
        gave_up_ = Status(StatusCode::kBadGateway,
                          "its runtime failed to start " + std::to_string(failed_starts) +
                              " times in a row; last: " + s.message(),
                          "runtime_failed");
      } else {
        LOG_WARN("runtime", "restarting the runtime for " << config_.name << ": " << s.ToString() << "; next try in "
                                                          << backoff_ms << " ms");
        next_start_us = NowMonoUs() + backoff_ms * 1000;
        backoff_ms = std::min(backoff_ms * 2, config_.process.max_restart_backoff_ms);
      }
    }
    lock.lock();
  }
  lock.unlock();
  std::lock_guard<std::mutex> io(io_mu_);
  up_ = false;
  StopProcessLocked(/*graceful=*/true);
}

}  // namespace shoal
