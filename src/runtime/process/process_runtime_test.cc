// The out-of-process runtime: frames and messages on their own, then real
// runtime processes — Shoal's Python runtime serving the eager tiny-bert
// (checked against the TorchScript model's reference embeddings), killed
// and restarted, and misbehaving runtimes (tests/data/runtimes) that must
// never crash or hang the worker.
#include "runtime/process/process_runtime.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/process/frame.h"
#include "runtime/process/protocol.h"

namespace shoal {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;
namespace rp = runtime_protocol;

std::string SourceDir() {
  const char* v = std::getenv("SHOAL_SOURCE_DIR");
  return v && *v ? v : SHOAL_DEFAULT_SOURCE_DIR;
}

template <typename Pred>
bool Eventually(Pred pred, std::chrono::milliseconds timeout = 20s) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// ----- Frames and messages ------------------------------------------------

class Frames : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }
  int64_t Soon() const { return rp::NowMonoUs() + 500'000; }
  int fds_[2] = {-1, -1};
};

TEST_F(Frames, RoundTripIncludingEmptyAndLarge) {
  for (const std::string& payload : {std::string(), std::string("hello"), std::string(300'000, 'x')}) {
    std::thread writer([&] { EXPECT_TRUE(rp::WriteFrame(fds_[0], payload, Soon()).ok()); });
    auto got = rp::ReadFrame(fds_[1], 1 << 20, Soon());
    writer.join();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, payload);
  }
}

TEST_F(Frames, OversizedSilentAndClosedPeersAreErrorsNotHangs) {
  ASSERT_TRUE(rp::WriteFrame(fds_[0], std::string(2000, 'x'), Soon()).ok());
  auto big = rp::ReadFrame(fds_[1], 1000, Soon());
  EXPECT_EQ(big.status().reason(), "frame_too_large");
  auto silent = rp::ReadFrame(fds_[0], 1000, rp::NowMonoUs() + 50'000);
  EXPECT_EQ(silent.status().code(), StatusCode::kDeadlineExceeded);
  ::close(fds_[1]);
  fds_[1] = -1;
  auto closed = rp::ReadFrame(fds_[0], 1000, Soon());
  EXPECT_EQ(closed.status().reason(), "peer_closed");
  EXPECT_EQ(rp::WriteFrame(fds_[0], "x", Soon()).code(), StatusCode::kUnavailable);
}

// Peak resident memory of this process (VmHWM), in bytes.
int64_t PeakResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

// A header within the limit that claims far more than follows (a runtime
// that breaks off, or lies) costs the memory of what was sent, not of the
// claim: the frame is grown as bytes arrive.
TEST_F(Frames, AClaimedSizeIsNotCommittedBeforeItsBytesArrive) {
  const int64_t peak_before = PeakResidentBytes();
  ASSERT_GT(peak_before, 0);
  constexpr uint32_t kClaimed = 1u << 30;  // 1 GiB
  const unsigned char head[4] = {kClaimed >> 24, (kClaimed >> 16) & 0xff, (kClaimed >> 8) & 0xff, kClaimed & 0xff};
  ASSERT_EQ(::send(fds_[0], head, 4, 0), 4);
  ASSERT_EQ(::send(fds_[0], "0123456789", 10, 0), 10);
  ::close(fds_[0]);
  fds_[0] = -1;
  auto got = rp::ReadFrame(fds_[1], int64_t{2} << 30, Soon());
  EXPECT_EQ(got.status().reason(), "peer_closed") << got.status().ToString();
  EXPECT_LT(PeakResidentBytes() - peak_before, int64_t{64} << 20) << "the claimed size was committed";
}

TEST(RuntimeMessages, RepliesAreCheckedField_by_field) {
  EXPECT_EQ(rp::DecodeReply("not msgpack \xc1").status().reason(), "malformed_frame");
  EXPECT_EQ(rp::DecodeReply("\x91\x01").status().reason(), "malformed_frame");  // an array
  EXPECT_EQ(rp::DecodeReply("\x81\xa2ok\xc3").status().reason(), "malformed_frame");  // no id
  // {"id": 7, "ok": true, "dim": 3}
  auto r = rp::DecodeReply(std::string("\x83\xa2id\x07\xa2ok\xc3\xa3" "dim\x03", 14));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->id, 7u);
  EXPECT_TRUE(r->ok);
  EXPECT_EQ(r->dim, 3);
  // {"id": 1, "ok": true, "embeddings": "text"}: embeddings must be bin.
  EXPECT_EQ(rp::DecodeReply(std::string("\x83\xa2id\x01\xa2ok\xc3\xaa" "embeddings\xa4text", 26)).status().reason(),
            "malformed_frame");
  // {<an array claiming 2^32-1 elements>: ...}: refused before the decoder
  // reserves 64 GiB for it.
  auto huge = rp::DecodeReply(std::string("\x81\xdd\xff\xff\xff\xff", 6));
  EXPECT_EQ(huge.status().reason(), "malformed_frame");
  EXPECT_NE(huge.status().message().find("a header claims 4294967295"), std::string::npos) << huge.status().ToString();
  // {"id": 1, "ok": true, "rows": 2^32 + 1}: not read as 1 row.
  EXPECT_EQ(rp::DecodeReply(std::string("\x83\xa2id\x01\xa2ok\xc3\xa4rows\xcf\x00\x00\x00\x01\x00\x00\x00\x01", 23))
                .status()
                .reason(),
            "malformed_frame");
}

// ----- Real runtime processes --------------------------------------------

ModelConfig PythonModel() {
  auto c = LoadModelConfig(SourceDir() + "/models/tiny-bert-py");
  EXPECT_TRUE(c.ok()) << c.status().ToString() << " (run scripts/setup.sh to generate the demo models)";
  ModelConfig m = c.ok() ? *c : ModelConfig{};
  m.process.health_interval_ms = 100;
  m.process.max_restart_backoff_ms = 200;
  return m;
}

ModelConfig BadModel(const std::string& mode) {
  ModelConfig m = PythonModel();
  m.process.command = {"/usr/bin/python3", SourceDir() + "/tests/data/runtimes/bad_runtime.py", "--mode", mode};
  return m;
}

// The reference inputs of tiny-bert, padded into one batch.
TokenBatch ReferenceBatch(const json& ref) {
  TokenBatch b;
  b.rows = static_cast<int>(ref["inputs"].size());
  for (const auto& in : ref["inputs"]) b.seq_len = std::max<int>(b.seq_len, static_cast<int>(in["input_ids"].size()));
  b.input_ids.assign(static_cast<size_t>(b.rows) * b.seq_len, 0);
  b.attention_mask.assign(b.input_ids.size(), 0);
  for (int r = 0; r < b.rows; ++r) {
    const auto& ids = ref["inputs"][r]["input_ids"];
    for (size_t t = 0; t < ids.size(); ++t) {
      b.input_ids[static_cast<size_t>(r) * b.seq_len + t] = ids[t].get<int64_t>();
      b.attention_mask[static_cast<size_t>(r) * b.seq_len + t] = 1;
    }
  }
  return b;
}

json TorchScriptReference() {
  std::ifstream in(SourceDir() + "/models/tiny-bert/reference.json");
  return json::parse(in);
}

void ExpectMatchesReference(const Embeddings& e, const json& ref) {
  ASSERT_EQ(e.rows, static_cast<int>(ref["embeddings"].size()));
  for (int r = 0; r < e.rows; ++r)
    for (int k = 0; k < e.dim; ++k)
      ASSERT_NEAR(e.data[static_cast<size_t>(r) * e.dim + k], ref["embeddings"][r][k].get<double>(), 1e-4)
          << "row " << r << " component " << k;
}

TEST(ProcessRuntime, PythonRuntimeServesTheEagerModelLikeTorchScript) {
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(PythonModel()).ok());
  EXPECT_EQ(rt.Dim(), 64);
  EXPECT_GT(rt.MemoryBytes(), 1 << 20);  // the runtime process's resident set
  const json ref = TorchScriptReference();
  auto out = rt.Run(ReferenceBatch(ref));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ExpectMatchesReference(*out, ref);
  const pid_t pid = rt.pid();
  rt.Unload();
  EXPECT_EQ(::kill(pid, 0), -1) << "the runtime process outlived Unload()";
}

// `shoal` blocks SIGINT and SIGTERM in every thread (one waits for them);
// a runtime it starts gets neither blocked: a mask survives exec, and a
// runtime that stops its own helpers with SIGTERM would hang until killed.
TEST(ProcessRuntime, ARuntimeStartsWithNoSignalBlocked) {
  sigset_t shutdown_signals, before;
  sigemptyset(&shutdown_signals);
  sigaddset(&shutdown_signals, SIGINT);
  sigaddset(&shutdown_signals, SIGTERM);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &shutdown_signals, &before), 0);  // as main() does
  ProcessRuntime rt;
  const Status loaded = rt.Load(PythonModel());
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &before, nullptr), 0);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  std::ifstream status("/proc/" + std::to_string(rt.pid()) + "/status");
  std::string blocked;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("SigBlk:", 0) == 0) blocked = line.substr(line.find_first_not_of(" \t", 7));
  EXPECT_EQ(blocked, "0000000000000000");
}

TEST(ProcessRuntime, AKilledRuntimeIsRestartedAndServesAgain) {
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(PythonModel()).ok());
  const json ref = TorchScriptReference();
  const pid_t first = rt.pid();
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  // While it is down, a batch fails as "unavailable" (the worker hands it
  // back to the queue), never as the callers' error.
  auto during = rt.Run(ReferenceBatch(ref));
  if (!during.ok()) {
    EXPECT_EQ(during.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(during.status().reason(), "runtime_crashed");
  }
  ASSERT_TRUE(Eventually([&] { return rt.up() && rt.pid() != first && rt.pid() > 0; })) << "never restarted";
  EXPECT_GE(rt.restarts(), 1);
  auto after = rt.Run(ReferenceBatch(ref));
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  ExpectMatchesReference(*after, ref);
}

TEST(ProcessRuntime, RuntimesThatFailToStartFailTheLoadQuickly) {
  {
    ProcessRuntime rt;
    Status s = rt.Load(BadModel("wrong-version"));
    EXPECT_EQ(s.reason(), "unsupported_protocol") << s.ToString();
  }
  {
    // A runtime's own code is not one the worker acts on (device_fault
    // would take the whole worker out of the fleet).
    ProcessRuntime rt;
    Status s = rt.Load(BadModel("refuse-device"));
    EXPECT_EQ(s.reason(), "runtime_start_failed") << s.ToString();
    EXPECT_NE(s.message().find("its device broke"), std::string::npos) << s.ToString();
  }
  {
    ProcessRuntime rt;
    Status s = rt.Load(BadModel("exit"));
    EXPECT_EQ(s.reason(), "runtime_start_failed") << s.ToString();
    EXPECT_NE(s.message().find("exit code 3"), std::string::npos) << s.message();
  }
  {
    ModelConfig m = BadModel("silent");
    m.process.start_timeout_ms = 500;
    ProcessRuntime rt;
    Status s = rt.Load(m);
    EXPECT_EQ(s.reason(), "runtime_start_failed") << s.ToString();
  }
  {
    ModelConfig m = PythonModel();
    m.process.command = {"/nonexistent/runtime"};
    ProcessRuntime rt;
    EXPECT_EQ(rt.Load(m).reason(), "runtime_start_failed");
  }
  {
    // The runtime's width must be the config's: the catalog and the
    // `dimensions` check use the config's.
    ModelConfig m = PythonModel();
    m.dim = 32;
    ProcessRuntime rt;
    const Status s = rt.Load(m);
    EXPECT_EQ(s.reason(), "model_load_failed") << s.ToString();
    EXPECT_NE(s.message().find("width 64, the model config says 32"), std::string::npos) << s.ToString();
  }
  {
    // A full batch's reply (64 rows x 64 floats) would not fit a frame:
    // every full batch would fail and restart the runtime.
    ModelConfig m = PythonModel();
    m.process.max_frame_bytes = 16384;
    m.batching.max_batch_tokens = 1024;
    ProcessRuntime rt;
    const Status s = rt.Load(m);
    EXPECT_EQ(s.reason(), "model_load_failed") << s.ToString();
    EXPECT_NE(s.message().find("max_frame_bytes (16384) is smaller than a full batch needs"), std::string::npos)
        << s.ToString();
  }
  {
    // A token budget rows bound first (64 rows of 256 tokens) asks for no
    // larger frames than those rows.
    ModelConfig m = PythonModel();
    m.batching.max_batch_tokens = 20'000'000;
    ProcessRuntime rt;
    const Status s = rt.Load(m);
    EXPECT_TRUE(s.ok()) << s.ToString();
    rt.Unload();
  }
}

// PythonModel() started through a shell script in `dir`: `body` runs first,
// then `exec "$@"` starts the real runtime.
ModelConfig WrappedPythonModel(const std::string& dir, const std::string& body) {
  const std::string script = dir + "/wrap.sh";
  std::ofstream(script) << "#!/bin/sh\n" << body << "exec \"$@\"\n";
  ModelConfig m = PythonModel();
  std::vector<std::string> command = {"/bin/sh", script};
  command.insert(command.end(), m.process.command.begin(), m.process.command.end());
  m.process.command = command;
  return m;
}

// A runtime reads no terminal: its stdin is /dev/null (in a background
// process group, a read of the worker's terminal would stop it).
TEST(ProcessRuntime, ARuntimesStdinIsDevNull) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-stdin-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string mark = dir + "/stdin";
  ModelConfig m = WrappedPythonModel(dir, "readlink /proc/$$/fd/0 > \"$SHOAL_TEST_MARK\"\n");
  m.process.env.emplace_back("SHOAL_TEST_MARK", mark);
  // This process's stdin is a pipe meanwhile (a test runner's may be
  // /dev/null already).
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const int saved_stdin = ::dup(0);
  ASSERT_GE(saved_stdin, 0);
  ASSERT_GE(::dup2(pipe_fds[0], 0), 0);
  ProcessRuntime rt;
  const Status loaded = rt.Load(m);
  ::dup2(saved_stdin, 0);
  for (int fd : {saved_stdin, pipe_fds[0], pipe_fds[1]}) ::close(fd);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  std::string stdin_target;
  std::getline(std::ifstream(mark), stdin_target);
  EXPECT_EQ(stdin_target, "/dev/null");
  rt.Unload();
  std::filesystem::remove_all(dir);
}

// A runtime that started once and then cannot start again (its interpreter
// or model went away) is not restarted forever: after max_failed_starts
// failed starts in a row it gives up, and Health() says why.
TEST(ProcessRuntime, GivesUpAfterMaxFailedStartsInARow) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-giveup-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string mark = dir + "/started";
  ModelConfig m = WrappedPythonModel(
      dir, "if [ -e \"$SHOAL_TEST_MARK\" ]; then echo 'gone' >&2; exit 3; fi\ntouch \"$SHOAL_TEST_MARK\"\n");
  m.process.max_failed_starts = 3;
  m.process.env.emplace_back("SHOAL_TEST_MARK", mark);
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(m).ok());
  EXPECT_TRUE(rt.Health().ok());
  ASSERT_EQ(::kill(rt.pid(), SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] { return !rt.Health().ok(); })) << "still restarting";
  const Status h = rt.Health();
  EXPECT_EQ(h.code(), StatusCode::kBadGateway);
  EXPECT_EQ(h.reason(), "runtime_failed");
  EXPECT_NE(h.message().find("3 times in a row"), std::string::npos) << h.message();
  EXPECT_NE(h.message().find("exit code 3"), std::string::npos) << h.message();
  EXPECT_FALSE(rt.Available());
  EXPECT_EQ(rt.restarts(), 0);  // no start after the first succeeded
  rt.Unload();
  std::filesystem::remove_all(dir);
}

// Kills the runtime `m` starts, lets its restart run for `settle`, then
// unloads: that must not wait for the restart's start timeout (40 s), since
// the loader thread that unloads holds up every other model's load.
// Nor is the start it cut short a failed one: with max_failed_starts 1 the
// runtime would otherwise say it gave up.
void ExpectUnloadDuringARestartIsQuick(ModelConfig m, std::chrono::milliseconds settle) {
  m.process.start_timeout_ms = 40000;
  m.process.max_failed_starts = 1;
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(m).ok());
  const pid_t first = rt.pid();
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  ASSERT_TRUE(Eventually([&] { return rt.pid() > 0 && rt.pid() != first; })) << "no restart began";
  std::this_thread::sleep_for(settle);
  ASSERT_FALSE(rt.Available());
  auto unloaded = std::async(std::launch::async, [&] { rt.Unload(); });
  EXPECT_EQ(unloaded.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "Unload waited for the restart";
  unloaded.wait();
  EXPECT_TRUE(rt.Health().ok()) << rt.Health().ToString();
}

// While the restarted runtime has not listened yet (a slow import).
TEST(ProcessRuntime, UnloadDoesNotWaitForARestartStillStarting) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-slowstart-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  // The first start is quick; every later one sleeps before listening.
  ModelConfig m = WrappedPythonModel(dir, "if [ -e \"$SHOAL_TEST_MARK\" ]; then sleep 600; fi\ntouch \"$SHOAL_TEST_MARK\"\n");
  m.process.env.emplace_back("SHOAL_TEST_MARK", dir + "/started");
  ExpectUnloadDuringARestartIsQuick(m, std::chrono::milliseconds(300));  // its shell is asleep, not listening
  std::filesystem::remove_all(dir);
}

// Once the restarted runtime listens and its `load` is slow: the unload
// kills it rather than wait for the answer.
TEST(ProcessRuntime, UnloadDoesNotWaitForARestartsSlowLoad) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-slowload-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  ModelConfig m = BadModel("slow-reload");
  m.process.env.emplace_back("SHOAL_TEST_MARK", dir + "/loaded");
  ExpectUnloadDuringARestartIsQuick(m, std::chrono::milliseconds(1500));  // it listens and sleeps in `load`
  std::filesystem::remove_all(dir);
}

// Whether `pid` is gone: no such process, or a zombie no one has reaped yet.
bool Gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// A runtime that dies while idle (noticed by the health check, not by a
// batch) takes what it started in its process group with it: a helper it
// spawned does not outlive it. And the config's env wins over the worker's
// own environment for a name both have.
TEST(ProcessRuntime, ADeadRuntimesGroupIsKilledAndItsEnvWins) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-group-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string child_file = dir + "/child";
  {
    // The environment the runtime was started with (what getenv() reads,
    // first match wins): the config's value, and the name once.
    ASSERT_EQ(::setenv("SHOAL_TEST_WHO", "worker", 1), 0);
    ModelConfig m = PythonModel();
    m.process.env = {{"SHOAL_TEST_WHO", "config"}};
    ProcessRuntime rt;
    ASSERT_TRUE(rt.Load(m).ok());
    ::unsetenv("SHOAL_TEST_WHO");
    std::ifstream environ_file("/proc/" + std::to_string(rt.pid()) + "/environ");
    std::vector<std::string> who;
    for (std::string entry; std::getline(environ_file, entry, '\0');)
      if (entry.rfind("SHOAL_TEST_WHO=", 0) == 0) who.push_back(entry);
    EXPECT_EQ(who, std::vector<std::string>{"SHOAL_TEST_WHO=config"});
  }
  ModelConfig m = WrappedPythonModel(dir, "sleep 600 &\necho $! > \"$SHOAL_TEST_CHILD\"\n");
  m.process.env = {{"SHOAL_TEST_CHILD", child_file}};
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(m).ok());
  pid_t child = 0;
  std::ifstream(child_file) >> child;
  ASSERT_GT(child, 0);
  ASSERT_FALSE(Gone(child));
  ASSERT_EQ(::kill(rt.pid(), SIGKILL), 0);
  EXPECT_TRUE(Eventually([&] { return Gone(child); }, 10s)) << "the runtime's helper outlived it";
  ::kill(child, SIGKILL);
  rt.Unload();
  std::filesystem::remove_all(dir);
}

// A command without a slash is looked up on the PATH the config gives the
// runtime (a virtualenv's bin first), not on the worker's; one on neither
// fails the load with a message that says so.
TEST(ProcessRuntime, TheCommandIsFoundOnTheRuntimesOwnPath) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-path-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  std::filesystem::create_directory(dir + "/venv-bin");
  const std::string program = dir + "/venv-bin/shoal-test-python";
  std::ofstream(program) << "#!/bin/sh\nexec /usr/bin/python3 \"$@\"\n";
  std::filesystem::permissions(program, std::filesystem::perms::owner_all);
  ModelConfig m = PythonModel();
  ASSERT_FALSE(m.process.command.empty());
  m.process.command[0] = "shoal-test-python";
  const char* worker_path = std::getenv("PATH");
  m.process.env = {{"PATH", dir + "/venv-bin:" + (worker_path ? worker_path : "/usr/bin:/bin")}};
  {
    ProcessRuntime rt;
    Status st = rt.Load(m);
    ASSERT_TRUE(st.ok()) << st.ToString();
    auto out = rt.Run(ReferenceBatch(TorchScriptReference()));
    ASSERT_TRUE(out.ok()) << out.status().ToString();
  }
  m.process.env = {{"PATH", dir + "/elsewhere"}};
  ProcessRuntime missing;
  Status st = missing.Load(m);
  EXPECT_EQ(st.reason(), "runtime_start_failed") << st.ToString();
  EXPECT_NE(st.message().find("not on the runtime's PATH"), std::string::npos) << st.ToString();
  std::filesystem::remove_all(dir);
}

TEST(ProcessRuntime, MisbehavingRepliesFailTheBatchAndRestartTheRuntime) {
  const json ref = TorchScriptReference();
  for (const std::string mode : {"oversized", "garbage", "hang"}) {
    ModelConfig m = BadModel(mode);
    m.process.request_timeout_ms = 500;
    m.process.max_frame_bytes = 1 << 20;
    ProcessRuntime rt;
    ASSERT_TRUE(rt.Load(m).ok()) << mode;
    const pid_t first = rt.pid();
    auto out = rt.Run(ReferenceBatch(ref));
    EXPECT_EQ(out.status().code(), StatusCode::kUnavailable) << mode << ": " << out.status().ToString();
    EXPECT_EQ(out.status().reason(), "runtime_crashed") << mode;
    EXPECT_TRUE(Eventually([&] { return rt.up() && rt.pid() != first; })) << mode << ": not restarted";
  }
}

// A runtime that dies mid-batch while a process it forked still holds the
// socket open (forked multiprocessing workers do): the batch fails at once
// (and goes back to the queue), not after request_timeout_ms, and the
// helper dies with its group.
TEST(ProcessRuntime, ARuntimeThatDiesWhileItsHelperHoldsTheSocketFailsTheBatchAtOnce) {
  std::string dir = (std::filesystem::temp_directory_path() / "shoal-helper-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  ModelConfig m = BadModel("fork-then-die");
  m.process.request_timeout_ms = 60000;
  m.process.env = {{"HELPER_PID_FILE", dir + "/helper"}};
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(m).ok());
  const pid_t first = rt.pid();
  auto out = rt.Run(ReferenceBatch(TorchScriptReference()));
  EXPECT_EQ(out.status().code(), StatusCode::kUnavailable) << out.status().ToString();
  EXPECT_NE(out.status().message().find("exited"), std::string::npos) << out.status().ToString();
  EXPECT_TRUE(Gone(first));
  pid_t helper = 0;
  std::ifstream(dir + "/helper") >> helper;
  ASSERT_GT(helper, 0);
  EXPECT_TRUE(Eventually([&] { return Gone(helper); }, 10s)) << "the runtime's helper outlived it";
  ::kill(helper, SIGKILL);
  rt.Unload();
  std::filesystem::remove_all(dir);
}

// A runtime whose model lives in a process it forked is counted with that
// process's own pages, not at the leader's resident set alone, so a
// worker's memory budget sees what the model holds.
TEST(ProcessRuntime, MemoryCountsWhatTheProcessesARuntimeStartedHold) {
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(BadModel("load-in-helper")).ok());
  std::ifstream statm("/proc/" + std::to_string(rt.pid()) + "/statm");
  int64_t size = 0, resident = 0;
  ASSERT_TRUE(statm >> size >> resident);
  const int64_t leader = resident * ::sysconf(_SC_PAGESIZE);
  // The helper writes 96 MiB of its own; the leader may have grown a little
  // since the count.
  EXPECT_GE(rt.MemoryBytes(), leader + (80 << 20)) << "leader " << leader;
  rt.Unload();
}

// A runtime that left the process group it was started in is still
// stopped: the group kill misses it, and the wait for it would never end.
TEST(ProcessRuntime, UnloadStopsARuntimeThatLeftItsProcessGroup) {
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(BadModel("leave-group")).ok());
  const pid_t pid = rt.pid();
  ASSERT_GT(pid, 0);
  ASSERT_NE(::getpgid(pid), pid);  // it did leave
  auto unloaded = std::make_shared<std::atomic<bool>>(false);
  std::thread unload([&rt, unloaded] {
    rt.Unload();
    *unloaded = true;
  });
  const bool in_time = Eventually([&] { return unloaded->load(); }, 10s);
  if (!in_time) ::kill(pid, SIGKILL);  // lets the stuck Unload end
  unload.join();
  EXPECT_TRUE(in_time) << "Unload waited for a runtime it did not kill";
  EXPECT_TRUE(Gone(pid));
}

TEST(ProcessRuntime, AnErrorReplyFailsOnlyThatBatch) {
  ProcessRuntime rt;
  ASSERT_TRUE(rt.Load(BadModel("error")).ok());
  const pid_t pid = rt.pid();
  auto out = rt.Run(ReferenceBatch(TorchScriptReference()));
  EXPECT_EQ(out.status().code(), StatusCode::kInternal);
  EXPECT_EQ(out.status().reason(), "runtime_error") << out.status().ToString();  // its code was device_fault
  EXPECT_NE(out.status().message().find("refuses every batch"), std::string::npos);
  std::this_thread::sleep_for(300ms);  // a few health checks
  EXPECT_TRUE(rt.up());
  EXPECT_EQ(rt.pid(), pid);  // not restarted: the runtime is healthy
}

}  // namespace
}  // namespace shoal
