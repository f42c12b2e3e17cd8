// shoal_bench_serving: how close served throughput comes to the model's own
// limit on this machine, in one run.
//
//  1. raw     the TorchScript model called directly (Runtime::Run) at batch
//             sizes 1..128, padded like the worker pads: tokens/s per size
//             and the best (the physical limit).
//  2. served  a private nats-server -js, a Worker and a Gateway in this
//             process, wired as `shoal serve` wires them; N closed-loop
//             keep-alive HTTP clients, one short sentence per request;
//             tokens/s from usage.prompt_tokens, and served/raw.
//  3. latency open-loop Poisson arrivals at half the served request rate:
//             p50/p99.
//  4. null    the same served set-up with the "null" runtime (no model):
//             requests/s, i.e. the per-request cost of gateway+queue+worker.
//
// Client, nats-server and machine-wide CPU are sampled over every measured
// window so the figures can be judged on a shared machine.
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "gateway/gateway.h"
#include "loadgen/http_load.h"
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"
#include "runtime/runtime.h"
#include "tokenize/wordpiece_tokenizer.h"
#include "worker/worker.h"

namespace shoal::bench {
namespace {

using loadgen::JsonPostRequest;
using loadgen::LoadOptions;
using loadgen::LoadResult;
using loadgen::RunLoad;

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Flags {
  std::string model_dir = SHOAL_DEFAULT_MODELS_DIR "/minilm-l6";
  double duration_s = 10;   // measured window of each served phase
  double warmup_s = 2;
  double raw_s_per_batch = 1.5;
  std::vector<int> raw_batches = {1, 8, 16, 32, 64, 128};
  std::vector<int> raw_mix;  // {lo, hi}: also raw at uniformly random batch sizes
  int clients = 64;
  int client_threads = 1;
  int threads = 0;          // intra-op threads (0: all cores)
  int device_slots = WorkerOptions{}.device_slots;  // the worker's (0: auto)
  int http_threads = 2;
  int chunk_size = 32;
  int64_t max_wait_us = -1;      // -1: the model's shoal.json
  int max_batch_size = -1;
  int64_t max_batch_tokens = -1;
  bool queue_memory = false;
  bool separate_connections = false;
  double latency_rate = 0;  // 0: half the served request rate
  int sentences = 1024;
  std::string phases = "raw,served,latency,null";
  std::string out;
  std::string log_level = "warn";
  std::string omp_wait_policy = "inherit";
  bool recheck = true;
  bool load_on_thread = false;  // load models on short-lived threads (see OnThread)       // raw again at the end, also under the other policy

  bool Has(const std::string& phase) const {
    std::stringstream ss(phases);
    for (std::string p; std::getline(ss, p, ',');)
      if (p == phase) return true;
    return false;
  }
};

// ----- Inputs ------------------------------------------------------------------

// Deterministic short English sentences of 10..16 tokens incl. [CLS]/[SEP].
std::vector<std::string> MakeSentences(const WordPieceTokenizer& tok, int count) {
  static const char* kWords[] = {
      "the", "a", "small", "model", "serves", "many", "requests", "on", "one", "machine", "every", "day",
      "queue", "worker", "pulls", "work", "from", "shared", "stream", "and", "runs", "batches", "of",
      "short", "text", "fast", "quiet", "river", "flows", "past", "old", "stone", "bridge", "near",
      "town", "children", "play", "in", "green", "park", "after", "school", "while", "their", "parents",
      "talk", "about", "weather", "news", "market", "prices", "rose", "again", "this", "week", "because",
      "demand", "for", "fresh", "bread", "was", "high", "new", "library", "opens", "at", "nine", "with",
      "books", "music", "films", "people", "read", "quickly", "under", "bright", "lights", "train",
      "leaves", "station", "late", "night", "rain", "falls", "softly", "over", "hills", "farmers",
      "harvest", "wheat", "before", "winter", "comes", "doctor", "visits", "patients", "hospital",
      "morning", "students", "write", "essays", "history", "science", "art", "city", "builds", "roads",
      "houses", "workers", "clean", "streets", "early", "cat", "sleeps", "warm", "window", "dog", "runs",
      "along", "beach", "sun", "sets", "behind", "mountains", "team", "won", "game", "last", "evening"};
  constexpr int kNumWords = static_cast<int>(sizeof(kWords) / sizeof(kWords[0]));
  std::mt19937 gen(20240501);
  std::uniform_int_distribution<int> word(0, kNumWords - 1), len(7, 13);
  std::vector<std::string> out;
  while (static_cast<int>(out.size()) < count) {
    std::string s;
    const int n = len(gen);
    for (int i = 0; i < n; ++i) {
      std::string w = kWords[word(gen)];
      if (i == 0) w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
      if (i) s.push_back(' ');
      s += w;
    }
    s.push_back('.');
    const int tokens = tok.CountTokens(s);
    if (tokens >= 10 && tokens <= 16) out.push_back(std::move(s));
  }
  return out;
}

// ----- System counters ---------------------------------------------------------

double ProcessCpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

double PidCpuSeconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t rp = s.rfind(')');
  if (rp == std::string::npos) return 0;
  std::istringstream in(s.substr(rp + 2));
  std::string field;
  double utime = 0, stime = 0;
  // Fields after the command: state(3) ... utime(14) stime(15).
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stod(field);
    if (i == 15) stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Busy seconds of the whole machine (all processes, all cores).
double MachineBusySeconds() {
  std::ifstream f("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  f >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  return (user + nice + system + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// ----- Raw model throughput ------------------------------------------------------

struct RawPoint {
  int batch = 0;
  int64_t calls = 0;
  double tokens_per_s = 0;    // real (unpadded) tokens
  double ms_per_batch = 0;
  double padded_fraction = 0;  // padded tokens / real tokens - 1
  double other_cores = 0;      // CPU used by other processes meanwhile
  bool mixed = false;          // batch sizes drawn at random; `batch` is their mean
};

TokenBatch PadBatch(const std::vector<std::vector<int32_t>>& rows, size_t first, int n, int32_t pad, int64_t* real) {
  TokenBatch tb;
  tb.rows = n;
  *real = 0;
  for (int r = 0; r < n; ++r) tb.seq_len = std::max<int>(tb.seq_len, rows[(first + r) % rows.size()].size());
  tb.input_ids.assign(static_cast<size_t>(n) * tb.seq_len, pad);
  tb.attention_mask.assign(static_cast<size_t>(n) * tb.seq_len, 0);
  for (int r = 0; r < n; ++r) {
    const auto& ids = rows[(first + r) % rows.size()];
    std::copy(ids.begin(), ids.end(), tb.input_ids.begin() + static_cast<size_t>(r) * tb.seq_len);
    std::fill_n(tb.attention_mask.begin() + static_cast<size_t>(r) * tb.seq_len, ids.size(), 1);
    *real += static_cast<int64_t>(ids.size());
  }
  return tb;
}

// Runs forward passes of next_size() rows each until `seconds` of forward
// time (and at least three passes) have been measured.
Result<RawPoint> MeasureRaw(Runtime& rt, const std::vector<std::vector<int32_t>>& rows, int32_t pad, double seconds,
                            size_t* cursor, const std::function<int()>& next_size) {
  RawPoint p;
  int64_t real = 0, tokens = 0, padded = 0, row_count = 0;
  double busy = 0;
  const double machine0 = MachineBusySeconds(), proc0 = ProcessCpuSeconds();
  const auto wall0 = Clock::now();
  while (busy < seconds || p.calls < 3) {
    const int b = next_size();
    TokenBatch tb = PadBatch(rows, *cursor, b, pad, &real);
    *cursor += b;
    const auto t0 = Clock::now();
    auto r = rt.Run(tb);
    busy += Seconds(Clock::now() - t0);
    if (!r.ok()) return r.status();
    ++p.calls;
    row_count += b;
    tokens += real;
    padded += static_cast<int64_t>(tb.rows) * tb.seq_len;
  }
  const double wall = Seconds(Clock::now() - wall0);
  p.other_cores = std::max(0.0, (MachineBusySeconds() - machine0 - (ProcessCpuSeconds() - proc0)) / wall);
  p.batch = static_cast<int>(row_count / p.calls);
  p.tokens_per_s = static_cast<double>(tokens) / busy;
  p.ms_per_batch = busy * 1000 / static_cast<double>(p.calls);
  p.padded_fraction = static_cast<double>(padded) / static_cast<double>(tokens) - 1;
  return p;
}

void PrintRaw(const std::string& label, const RawPoint& p) {
  std::printf("  %-10s %9.0f tokens/s  %8.2f ms/batch  padding +%4.1f%%  (%lld calls; other processes %.2f cores)\n",
              label.c_str(), p.tokens_per_s, p.ms_per_batch, 100 * p.padded_fraction,
              static_cast<long long>(p.calls), p.other_cores);
  std::fflush(stdout);
}

// The raw sweep: one point per batch size, then (when `mix` is {lo, hi}) a
// last point at batch sizes drawn uniformly from [lo, hi] per call, as a
// served worker sees them (each new shape may cost the graph executor a
// re-specialisation).
Result<std::vector<RawPoint>> RunRaw(const std::vector<int>& batches, double seconds_per_batch, ModelConfig config,
                                     const WordPieceTokenizer& tok, const std::vector<std::string>& sentences,
                                     int threads, const std::vector<int>& mix = {}) {
  config.intra_op_threads = threads;
  ASSIGN_OR_RETURN(auto rt, CreateRuntime(config.runtime));
  RETURN_IF_ERROR(rt->Load(config));
  std::vector<std::vector<int32_t>> rows;
  for (const auto& s : sentences) rows.push_back(tok.Encode(s, config.max_seq_len).ids);
  std::vector<RawPoint> out;
  size_t cursor = 0;
  for (int b : batches) {
    // Warm-up: the graph executor specialises on new shapes.
    int64_t real = 0;
    for (int i = 0; i < 3; ++i, cursor += b)
      if (auto r = rt->Run(PadBatch(rows, cursor, b, tok.pad_id(), &real)); !r.ok()) return r.status();
    ASSIGN_OR_RETURN(RawPoint p, MeasureRaw(*rt, rows, tok.pad_id(), seconds_per_batch, &cursor, [b] { return b; }));
    PrintRaw("batch " + std::to_string(b), p);
    out.push_back(p);
  }
  if (mix.size() == 2) {
    std::mt19937 gen(7);
    std::uniform_int_distribution<int> size(mix[0], mix[1]);
    ASSIGN_OR_RETURN(RawPoint p, MeasureRaw(*rt, rows, tok.pad_id(), 2 * seconds_per_batch, &cursor,
                                            [&] { return size(gen); }));
    p.mixed = true;
    PrintRaw("mixed " + std::to_string(mix[0]) + ".." + std::to_string(mix[1]), p);
    out.push_back(p);
  }
  rt->Unload();
  return out;
}

// Raw throughput at one batch size in a fresh process of this program, under
// another OpenMP wait policy (libgomp fixes it at load time). Its output
// goes to /dev/null; the figure comes back through a JSON file.
Result<RawPoint> RawInChild(const Flags& f, int batch, double seconds, const std::string& policy,
                          const fs::path& json_path) {
  std::vector<std::string> args = {"shoal_bench_serving", "--phases", "raw", "--no-recheck",
                                   "--raw-batches", std::to_string(batch), "--raw-s", std::to_string(seconds),
                                   "--omp-wait-policy", policy, "--threads", std::to_string(f.threads),
                                   "--model-dir", f.model_dir, "--out", json_path.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return Internal("posix_spawn failed: " + std::string(std::strerror(rc)));
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return Internal("raw child process failed");
  std::ifstream in(json_path);
  try {
    const json j = json::parse(in).at("raw").at("points").at(0);
    RawPoint p;
    p.batch = batch;
    p.tokens_per_s = j.at("tokens_per_s").get<double>();
    p.ms_per_batch = j.at("ms_per_batch").get<double>();
    p.calls = j.at("calls").get<int64_t>();
    p.other_cores = j.at("cpu_cores_other_processes").get<double>();
    p.padded_fraction = j.at("padding_fraction").get<double>();
    return p;
  } catch (const json::exception& e) {
    return Internal(std::string("raw child: ") + e.what());
  }
}

// Runs fn on a new thread and waits for it. libgomp keeps an OpenMP team for
// every thread that ran a parallel region and, once it manages more threads
// than there are CPUs, cuts its spin-wait to almost nothing; a team dies
// with its thread.
template <typename Fn>
auto OnThread(bool enabled, Fn fn) -> decltype(fn()) {
  if (!enabled) return fn();
  std::optional<decltype(fn())> out;
  std::thread([&] { out.emplace(fn()); }).join();
  return std::move(*out);
}

// ----- The served stack -------------------------------------------------------------

// A model repository holding one model: links to the real artifacts plus a
// shoal.json with the benchmark's batching overrides.
Result<std::string> MakeRepository(const Flags& f, const fs::path& root) {
  std::ifstream in(fs::path(f.model_dir) / "shoal.json");
  if (!in) return NotFound("no shoal.json in " + f.model_dir);
  json cfg;
  try {
    cfg = json::parse(in);
  } catch (const json::exception& e) {
    return InvalidArgument(std::string("shoal.json: ") + e.what());
  }
  auto& b = cfg["batching"];
  if (f.max_wait_us >= 0) b["max_wait_us"] = f.max_wait_us;
  if (f.max_batch_size > 0) b["max_batch_size"] = f.max_batch_size;
  if (f.max_batch_tokens > 0) b["max_batch_tokens"] = f.max_batch_tokens;
  const fs::path dir = root / "repo" / cfg.value("name", "model");
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(fs::absolute(f.model_dir)))
    if (e.path().filename() != "shoal.json") fs::create_symlink(e.path(), dir / e.path().filename());
  std::ofstream(dir / "shoal.json") << cfg.dump(2);
  return (root / "repo").string();
}

class Stack {
 public:
  static Result<std::unique_ptr<Stack>> Start(const Flags& f, const std::string& repo, const fs::path& data_dir,
                                              const std::string& runtime_override) {
    auto s = std::unique_ptr<Stack>(new Stack());
    NatsServerOptions ns;
    ns.data_dir = (data_dir / "jetstream").string();
    ASSIGN_OR_RETURN(s->nats_, NatsServerProcess::Start(ns));
    NatsOptions no;
    no.url = s->nats_->url();
    no.name = "bench-gateway";
    ASSIGN_OR_RETURN(s->gw_client_, NatsClient::Connect(no));
    NatsClient* wk_client = s->gw_client_.get();
    if (f.separate_connections) {
      no.name = "bench-worker";
      ASSIGN_OR_RETURN(s->wk_client_, NatsClient::Connect(no));
      wk_client = s->wk_client_.get();
    }
    WorkerOptions wo;
    wo.model_repository = repo;
    wo.intra_op_threads = f.threads;
    wo.device_slots = f.device_slots;
    wo.runtime_override = runtime_override;
    wo.stream.file_storage = !f.queue_memory;
    ASSIGN_OR_RETURN(s->worker_, Worker::Create(wo, wk_client, &s->metrics_));
    GatewayOptions go;
    go.http.port = 0;
    go.http.threads = f.http_threads;
    go.dispatcher.chunk_size = f.chunk_size;
    ASSIGN_OR_RETURN(s->gateway_, Gateway::Create(go, s->gw_client_.get(), &s->metrics_));
    return s;
  }
  ~Stack() {
    if (gateway_) gateway_->Stop();
    if (worker_) worker_->Stop();
    gateway_.reset();
    worker_.reset();
    wk_client_.reset();
    gw_client_.reset();
    if (nats_) nats_->Stop();
  }
  int port() const { return gateway_->port(); }
  pid_t nats_pid() const { return nats_->pid(); }
  MetricsRegistry& metrics() { return metrics_; }

 private:
  Stack() = default;
  MetricsRegistry metrics_;  // outlives everything below
  std::unique_ptr<NatsServerProcess> nats_;
  std::unique_ptr<NatsClient> gw_client_;
  std::unique_ptr<NatsClient> wk_client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<Gateway> gateway_;
};

// One blocking request; the HTTP status, or -1 when the connection failed.
int PostOnce(int port, const std::string& request, std::string* body) {
  namespace asio = boost::asio;
  namespace http = boost::beast::http;
  try {
    asio::io_context io;
    asio::ip::tcp::socket sock(io);
    sock.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)});
    asio::write(sock, asio::buffer(request));
    boost::beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(sock, buf, res);
    if (body) *body = res.body();
    return res.result_int();
  } catch (const std::exception&) {
    return -1;
  }
}

// The gateway learns the catalog in the background: wait for a 200.
Status WaitReady(int port, const std::string& request) {
  const auto until = Clock::now() + std::chrono::seconds(30);
  std::string body;
  int code = -1;
  while (Clock::now() < until) {
    code = PostOnce(port, request, &body);
    if (code == 200) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Unavailable("gateway not ready after 30 s: HTTP " + std::to_string(code) + " " + body.substr(0, 200));
}

// ----- Measured phases ---------------------------------------------------------

struct Window {
  double proc_cpu = 0, nats_cpu = 0, machine_busy = 0;
  double fwd_s = 0, rows = 0;
  int64_t fwd_calls = 0;
};

struct PhaseReport {
  LoadResult load;
  double proc_cores = 0;     // this process (gateway, worker, model, client)
  double client_cores = 0;
  double nats_cores = 0;
  double other_cores = 0;    // the rest of the machine (other processes)
  double model_busy = 0;     // fraction of the window spent in forward passes
  double avg_batch_rows = 0;
  int64_t forward_passes = 0;
};

Result<PhaseReport> RunPhase(Stack& stack, const std::string& model, LoadOptions lo) {
  Histogram* fwd = stack.metrics().GetHistogram("shoal_worker_forward_seconds", "Forward pass time.",
                                                {{"model", model}}, LatencyBuckets());
  Histogram* rows = stack.metrics().GetHistogram("shoal_worker_batch_rows", "Rows per forward pass.",
                                                 {{"model", model}}, SizeBuckets());
  const pid_t nats = stack.nats_pid();
  auto sample = [&] {
    Window w;
    w.proc_cpu = ProcessCpuSeconds();
    w.nats_cpu = PidCpuSeconds(nats);
    w.machine_busy = MachineBusySeconds();
    w.fwd_s = fwd->Sum();
    w.fwd_calls = fwd->Count();
    w.rows = rows->Sum();
    return w;
  };
  Window a, b;
  lo.port = stack.port();
  lo.on_window_start = [&] { a = sample(); };
  lo.on_window_end = [&] { b = sample(); };
  ASSIGN_OR_RETURN(LoadResult r, RunLoad(lo));
  PhaseReport p;
  const double t = r.window_s;
  p.proc_cores = (b.proc_cpu - a.proc_cpu) / t;
  p.client_cores = r.client_cpu_s / t;
  p.nats_cores = (b.nats_cpu - a.nats_cpu) / t;
  p.other_cores = std::max(0.0, (b.machine_busy - a.machine_busy) / t - p.proc_cores - p.nats_cores);
  p.model_busy = (b.fwd_s - a.fwd_s) / t;
  p.forward_passes = b.fwd_calls - a.fwd_calls;
  p.avg_batch_rows = p.forward_passes > 0 ? (b.rows - a.rows) / static_cast<double>(p.forward_passes) : 0;
  p.load = std::move(r);
  return p;
}

void PrintPhase(const char* name, const PhaseReport& p, bool tokens) {
  const LoadResult& r = p.load;
  std::printf("  %-8s %9.1f req/s", name, r.RequestsPerS());
  if (tokens) std::printf("  %9.0f tokens/s", r.TokensPerS());
  std::printf("  p50 %7.2f ms  p99 %7.2f ms  (%lld ok, %lld errors", r.PercentileMs(50), r.PercentileMs(99),
              static_cast<long long>(r.completed), static_cast<long long>(r.errors));
  if (r.due) std::printf(", %lld arrivals", static_cast<long long>(r.due));
  if (r.dropped) std::printf(", %lld dropped", static_cast<long long>(r.dropped));
  std::printf(")\n");
  std::printf("           CPU cores: shoal process %.2f (of which client %.2f), nats-server %.2f, other processes %.2f\n",
              p.proc_cores, p.client_cores, p.nats_cores, p.other_cores);
  std::printf("           forward passes %lld, avg rows %.1f, model busy %.0f%% of the window\n",
              static_cast<long long>(p.forward_passes), p.avg_batch_rows, 100 * p.model_busy);
  if (!r.first_error.empty()) std::printf("           first error: %s\n", r.first_error.c_str());
  std::fflush(stdout);
}

json PhaseJson(const PhaseReport& p) {
  const LoadResult& r = p.load;
  return {{"window_s", r.window_s},
          {"requests", r.completed},
          {"errors", r.errors},
          {"dropped", r.dropped},
          {"arrivals", r.due},
          {"requests_per_s", r.RequestsPerS()},
          {"tokens_per_s", r.TokensPerS()},
          {"p50_ms", r.PercentileMs(50)},
          {"p90_ms", r.PercentileMs(90)},
          {"p99_ms", r.PercentileMs(99)},
          {"max_ms", r.latencies_ms.empty() ? 0.0 : r.latencies_ms.back()},
          {"cpu_cores_process", p.proc_cores},
          {"cpu_cores_client", p.client_cores},
          {"cpu_cores_nats_server", p.nats_cores},
          {"cpu_cores_other_processes", p.other_cores},
          {"model_busy_fraction", p.model_busy},
          {"forward_passes", p.forward_passes},
          {"avg_batch_rows", p.avg_batch_rows},
          {"connections", r.connections_used}};
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Shoal serving benchmark: raw model vs served throughput, latency at half load, null-runtime overhead"};
  app.add_option("--model-dir", f.model_dir, "Model directory (shoal.json, model.pt, vocab.txt)")->capture_default_str();
  app.add_option("--duration-s", f.duration_s, "Measured seconds of each served phase")->capture_default_str();
  app.add_option("--warmup-s", f.warmup_s, "Unmeasured seconds before each served phase")->capture_default_str();
  app.add_option("--raw-s", f.raw_s_per_batch, "Measured seconds per raw batch size")->capture_default_str();
  app.add_option("--raw-batches", f.raw_batches, "Raw batch sizes")->delimiter(',')->capture_default_str();
  app.add_option("--raw-mix", f.raw_mix, "LO,HI: also raw at random batch sizes in [LO, HI]")->delimiter(',')->expected(2);
  app.add_option("--clients", f.clients, "Concurrent closed-loop HTTP clients")->capture_default_str();
  app.add_option("--client-threads", f.client_threads, "Threads of the HTTP client")->capture_default_str();
  app.add_option("--threads", f.threads, "Intra-op threads, raw and worker (0: all cores)")->capture_default_str();
  app.add_option("--device-slots", f.device_slots, "Worker's device slots (0: auto, as shoal serve)")
      ->check(CLI::Range(0, 64))->capture_default_str();
  app.add_option("--http-threads", f.http_threads, "Gateway HTTP io threads")->capture_default_str();
  app.add_option("--chunk-size", f.chunk_size, "Gateway inputs per queue message")->capture_default_str();
  app.add_option("--max-wait-us", f.max_wait_us, "Batching window (-1: the model's shoal.json)")->capture_default_str();
  app.add_option("--max-batch-size", f.max_batch_size, "Rows per batch (-1: shoal.json)")->capture_default_str();
  app.add_option("--max-batch-tokens", f.max_batch_tokens, "Padded tokens per batch (-1: shoal.json)")->capture_default_str();
  app.add_flag("--queue-memory", f.queue_memory, "Keep the work stream in memory instead of on disk");
  app.add_flag("--separate-connections", f.separate_connections, "Gateway and worker on their own NATS connections");
  app.add_option("--latency-rate", f.latency_rate, "Open-loop requests/s (0: half the served rate)")->capture_default_str();
  app.add_option("--phases", f.phases, "Comma-separated subset of raw,served,latency,null")->capture_default_str();
  app.add_option("--out", f.out, "Also write the results as JSON to this file");
  app.add_option("--log-level", f.log_level, "debug | info | warn | error")->capture_default_str();
  app.add_option("--omp-wait-policy", f.omp_wait_policy,
                 "OpenMP idle threads: inherit (the environment's OMP_WAIT_POLICY), passive or active")
      ->check(CLI::IsMember({"inherit", "passive", "active"}))
      ->capture_default_str();
  app.add_flag("--load-on-thread", f.load_on_thread,
               "Load models (and run the raw phase) on short-lived threads, so only the worker's executor keeps an OpenMP team");
  app.add_flag("!--no-recheck", f.recheck, "Skip measuring the raw limit again at the end");
  CLI11_PARSE(app, argc, argv);

  // libgomp reads OMP_WAIT_POLICY once, when it is loaded: to change it,
  // set it and start this program again.
  if (f.omp_wait_policy != "inherit") {
    const std::string want = f.omp_wait_policy == "passive" ? "PASSIVE" : "ACTIVE";
    const char* have = std::getenv("OMP_WAIT_POLICY");
    if (have == nullptr || want != have) {
      setenv("OMP_WAIT_POLICY", want.c_str(), 1);
      execv("/proc/self/exe", argv);
      std::perror("execv /proc/self/exe");
      return 1;
    }
  }

  LogLevel level;
  if (!ParseLogLevel(f.log_level, &level)) {
    std::fprintf(stderr, "bad --log-level\n");
    return 2;
  }
  SetLogLevel(level);
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "shoal_bench_serving: %s\n", s.ToString().c_str());
    return 1;
  };

  auto config = LoadModelConfig(fs::absolute(f.model_dir).string());
  if (!config.ok()) return fail(config.status());
  WordPieceOptions to;
  to.lowercase = config->tokenizer.lowercase;
  to.strip_accents = config->tokenizer.strip_accents;
  to.tokenize_chinese_chars = config->tokenizer.tokenize_chinese_chars;
  auto tok = WordPieceTokenizer::FromFile(config->VocabPath(), to);
  if (!tok.ok()) return fail(tok.status());
  const auto sentences = MakeSentences(**tok, f.sentences);
  int64_t sentence_tokens = 0;
  for (const auto& s : sentences) sentence_tokens += (*tok)->CountTokens(s);
  const int threads = f.threads > 0 ? f.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const char* omp_wait = std::getenv("OMP_WAIT_POLICY");

  json results;
  results["machine"] = {{"nproc", std::thread::hardware_concurrency()},
                        {"cpu_model", CpuModel()},
                        {"loadavg_at_start", LoadAverage()}};
  results["settings"] = {{"model", config->name},
                         {"intra_op_threads", threads},
                         {"clients", f.clients},
                         {"client_threads", f.client_threads},
                         {"http_threads", f.http_threads},
                         {"chunk_size", f.chunk_size},
                         {"max_wait_us", f.max_wait_us >= 0 ? f.max_wait_us : config->batching.max_wait_us},
                         {"max_batch_size", f.max_batch_size > 0 ? f.max_batch_size : config->batching.max_batch_size},
                         {"max_batch_tokens",
                          f.max_batch_tokens > 0 ? f.max_batch_tokens : config->batching.max_batch_tokens},
                         {"queue", f.queue_memory ? "memory" : "file"},
                         {"separate_connections", f.separate_connections},
                         {"duration_s", f.duration_s},
                         {"warmup_s", f.warmup_s},
                         {"omp_wait_policy", omp_wait ? omp_wait : ""},
                         {"gomp_spincount", std::getenv("GOMP_SPINCOUNT") ? std::getenv("GOMP_SPINCOUNT") : ""},
                         {"load_on_thread", f.load_on_thread},
                         {"sentences", sentences.size()},
                         {"avg_tokens_per_sentence", static_cast<double>(sentence_tokens) / sentences.size()}};
  std::printf("shoal_bench_serving: %s, %u cores (%s), load average %s\n", config->name.c_str(),
              std::thread::hardware_concurrency(), CpuModel().c_str(), LoadAverage().c_str());
  std::printf("  %zu sentences, %.1f tokens each on average (incl. [CLS]/[SEP]); intra-op threads %d\n",
              sentences.size(), static_cast<double>(sentence_tokens) / sentences.size(), threads);
  std::printf("  OMP_WAIT_POLICY=%s, models loaded on %s\n", omp_wait ? omp_wait : "(unset)",
              f.load_on_thread ? "short-lived threads" : "the main thread (as shoal serve does)");
  const auto t_start = Clock::now();

  double raw_best = 0;
  int best_batch = 0;
  if (f.Has("raw")) {
    std::printf("\n[1] raw: Runtime::Run directly, %.1f s per batch size\n", f.raw_s_per_batch);
    auto raw = OnThread(f.load_on_thread, [&] {
      return RunRaw(f.raw_batches, f.raw_s_per_batch, *config, **tok, sentences, threads, f.raw_mix);
    });
    if (!raw.ok()) return fail(raw.status());
    json pts = json::array();
    for (const auto& p : *raw) {
      if (p.mixed) {
        results["raw"]["mixed"] = {{"mean_batch", p.batch}, {"tokens_per_s", p.tokens_per_s}};
        continue;
      }
      pts.push_back({{"batch", p.batch}, {"tokens_per_s", p.tokens_per_s}, {"ms_per_batch", p.ms_per_batch},
                     {"padding_fraction", p.padded_fraction}, {"calls", p.calls},
                     {"cpu_cores_other_processes", p.other_cores}});
      if (p.tokens_per_s > raw_best) raw_best = p.tokens_per_s, best_batch = p.batch;
    }
    std::printf("  best: %.0f tokens/s at batch %d\n", raw_best, best_batch);
    results["raw"]["points"] = pts;
    results["raw"]["best_tokens_per_s"] = raw_best;
    results["raw"]["best_batch"] = best_batch;
  }

  char tmpl[] = "/tmp/shoal-bench-XXXXXX";
  if (!mkdtemp(tmpl)) return fail(Internal("mkdtemp failed"));
  const fs::path tmp = tmpl;
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{tmp};
  auto repo = MakeRepository(f, tmp);
  if (!repo.ok()) return fail(repo.status());

  std::vector<std::string> requests;
  for (const auto& s : sentences)
    requests.push_back(JsonPostRequest("127.0.0.1", "/v1/embeddings", json({{"model", config->name}, {"input", s}}).dump()));
  LoadOptions closed;
  closed.requests = requests;
  closed.connections = f.clients;
  closed.threads = f.client_threads;
  closed.warmup_s = f.warmup_s;
  closed.duration_s = f.duration_s;

  double served_rps = 0;
  if (f.Has("served") || f.Has("latency")) {
    auto stack = OnThread(f.load_on_thread, [&] { return Stack::Start(f, *repo, tmp / "served", ""); });
    if (!stack.ok()) return fail(stack.status());
    if (Status s = WaitReady((*stack)->port(), requests[0]); !s.ok()) return fail(s);
    if (f.Has("served")) {
      std::printf("\n[2] served: gateway -> JetStream -> worker, %d closed-loop clients, %.0f s (+%.0f s warm-up)\n",
                  f.clients, f.duration_s, f.warmup_s);
      auto p = RunPhase(**stack, config->name, closed);
      if (!p.ok()) return fail(p.status());
      PrintPhase("served", *p, true);
      served_rps = p->load.RequestsPerS();
      results["served"] = PhaseJson(*p);
      if (raw_best > 0) {
        const double ratio = p->load.TokensPerS() / raw_best;
        std::printf("  served/raw = %.0f / %.0f = %.3f\n", p->load.TokensPerS(), raw_best, ratio);
        results["served_over_raw"] = ratio;
      }
    }
    if (f.Has("latency")) {
      const double rate = f.latency_rate > 0 ? f.latency_rate : served_rps / 2;
      if (rate <= 0) return fail(InvalidArgument("latency phase needs the served phase or --latency-rate"));
      std::printf("\n[3] latency: open loop, Poisson arrivals at %.1f req/s%s, %.0f s\n", rate,
                  f.latency_rate > 0 ? "" : " (half the served rate)", f.duration_s);
      LoadOptions open = closed;
      open.rate_per_s = rate;
      open.warmup_s = std::min(1.0, f.warmup_s);
      auto p = RunPhase(**stack, config->name, open);
      if (!p.ok()) return fail(p.status());
      PrintPhase("latency", *p, true);
      results["latency_half_load"] = PhaseJson(*p);
      results["latency_half_load"]["offered_rate_per_s"] = rate;
    }
  }

  if (f.Has("null")) {
    auto stack = OnThread(f.load_on_thread, [&] { return Stack::Start(f, *repo, tmp / "null", "null"); });
    if (!stack.ok()) return fail(stack.status());
    if (Status s = WaitReady((*stack)->port(), requests[0]); !s.ok()) return fail(s);
    std::printf("\n[4] null runtime: same path, no model, %d closed-loop clients, %.0f s\n", f.clients, f.duration_s);
    auto p = RunPhase(**stack, config->name, closed);
    if (!p.ok()) return fail(p.status());
    PrintPhase("null", *p, false);
    results["null_runtime"] = PhaseJson(*p);
    if (p->load.RequestsPerS() > 0) {
      const double rps = p->load.RequestsPerS();
      const double in_process_us = 1e6 * (p->proc_cores - p->client_cores) / rps, nats_us = 1e6 * p->nats_cores / rps;
      std::printf("  CPU per request: %.0f us gateway+worker (this process less the client) + %.0f us nats-server = %.0f us\n",
                  in_process_us, nats_us, in_process_us + nats_us);
      results["null_runtime"]["cpu_us_per_request_gateway_worker"] = in_process_us;
      results["null_runtime"]["cpu_us_per_request_nats_server"] = nats_us;
    }
  }

  // The machine may be shared: measure the limit again after the served
  // phases and keep the higher figure, so served/raw is not flattered.
  if (f.Has("raw") && best_batch > 0 && f.recheck) {
    std::printf("\n[5] raw again at batch %d (the machine may have changed)\n", best_batch);
    auto again = OnThread(f.load_on_thread, [&] {
      return RunRaw({best_batch}, 2 * f.raw_s_per_batch, *config, **tok, sentences, threads);
    });
    if (!again.ok()) return fail(again.status());
    const double second = again->front().tokens_per_s;
    results["raw"]["recheck_tokens_per_s"] = second;
    raw_best = std::max(raw_best, second);
    // Idle OpenMP threads spin (ACTIVE) or sleep (PASSIVE); either may be
    // the faster on a given machine, and the limit is the better of them.
    const char* now = std::getenv("OMP_WAIT_POLICY");
    const std::string other = now && std::string(now) == "PASSIVE" ? "active" : "passive";
    auto child = RawInChild(f, best_batch, 2 * f.raw_s_per_batch, other, tmp / "raw-other.json");
    if (!child.ok()) return fail(child.status());
    PrintRaw("batch " + std::to_string(best_batch), *child);
    std::printf("             (the line above: a separate process with OMP_WAIT_POLICY=%s)\n",
                other == "active" ? "ACTIVE" : "PASSIVE");
    results["raw"]["other_policy"] = other;
    results["raw"]["other_policy_tokens_per_s"] = child->tokens_per_s;
    raw_best = std::max(raw_best, child->tokens_per_s);
    results["raw"]["best_tokens_per_s"] = raw_best;
    if (results.contains("served")) {
      const double ratio = results["served"]["tokens_per_s"].get<double>() / raw_best;
      results["served_over_raw"] = ratio;
      std::printf("\nserved/raw = %.0f / %.0f = %.3f (raw: the best of the three raw measurements)\n",
                  results["served"]["tokens_per_s"].get<double>(), raw_best, ratio);
    }
  }

  const double total_s = Seconds(Clock::now() - t_start);
  results["machine"]["loadavg_at_end"] = LoadAverage();
  results["total_s"] = total_s;
  std::printf("\ndone in %.0f s; load average %s\n", total_s, LoadAverage().c_str());
  if (!f.out.empty()) {
    std::ofstream out(f.out);
    out << results.dump(2) << "\n";
    if (!out) return fail(Internal("cannot write " + f.out));
  }
  return 0;
}

}  // namespace
}  // namespace shoal::bench

int main(int argc, char** argv) { return shoal::bench::Main(argc, argv); }
