// The `shoal` binary: serve (embedded default), gateway, worker, models,
// bench. The only place that reads flags and environment variables; every
// option has both (--flag and SHOAL_FLAG), declared together below.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "blob/blob_store.h"
#include "cli/bench_command.h"
#include "cli/internal/env_option.h"
#include "cli/internal/split.h"
#include "cli/models_command.h"
#include "common/log.h"
#include "common/metrics.h"
#include "gateway/gateway.h"
#include "gateway/http_server.h"
#include "gateway/routes.h"
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"
#include "runtime/runtime.h"
#include "worker/worker.h"

namespace shoal {
namespace {

// Adds an option with its environment variable in one place.
template <typename T>
CLI::Option* Opt(CLI::App* app, const std::string& flag, T& value, const std::string& env, const std::string& help) {
  return cli::EnvOption(app, flag, value, env, help);
}
CLI::Option* Flag(CLI::App* app, const std::string& flag, bool& value, const std::string& env, const std::string& help) {
  return app->add_flag(flag, value, help)->envname(env)->capture_default_str();
}

struct CommonFlags {
  std::string nats_url = "nats://127.0.0.1:4222";
  std::string log_level = "info";
};

void AddCommon(CLI::App* app, CommonFlags& c, bool with_url) {
  if (with_url) Opt(app, "--nats-url", c.nats_url, "SHOAL_NATS_URL", "NATS server URL(s), comma-separated");
  Opt(app, "--log-level", c.log_level, "SHOAL_LOG_LEVEL", "debug | info | warn | error");
}

struct StreamFlags {
  int64_t max_msgs = 100000;
  int64_t max_bytes = int64_t{1} << 30;
  int replicas = 1;
  bool memory = false;
};

void AddStream(CLI::App* app, StreamFlags& s) {
  Opt(app, "--queue-max-msgs", s.max_msgs, "SHOAL_QUEUE_MAX_MSGS", "Work queue bound in messages (full: 429)");
  Opt(app, "--queue-max-bytes", s.max_bytes, "SHOAL_QUEUE_MAX_BYTES", "Work queue bound in bytes (full: 429)");
  Opt(app, "--stream-replicas", s.replicas, "SHOAL_STREAM_REPLICAS", "Stream replicas (3 in a NATS cluster)");
  Flag(app, "--queue-memory", s.memory, "SHOAL_QUEUE_MEMORY", "Keep the queue in memory instead of on disk");
}

void ApplyStream(const StreamFlags& f, WorkStreamOptions* s) {
  s->max_msgs = f.max_msgs;
  s->max_bytes = f.max_bytes;
  s->replicas = f.replicas;
  s->file_storage = !f.memory;
}

void AddGateway(CLI::App* app, GatewayOptions& g) {
  Opt(app, "--host", g.http.host, "SHOAL_HOST", "HTTP listen address");
  Opt(app, "--port", g.http.port, "SHOAL_PORT", "HTTP port (0: pick a free one)");
  Opt(app, "--http-threads", g.http.threads, "SHOAL_HTTP_THREADS", "HTTP I/O threads");
  Opt(app, "--max-body-bytes", g.http.max_body_bytes, "SHOAL_MAX_BODY_BYTES", "Largest request body (over: 413)");
  Opt(app, "--max-receiving-bytes", g.http.max_receiving_bytes, "SHOAL_MAX_RECEIVING_BYTES",
      "Request bodies still arriving, all connections together (over: 503 server_busy)");
  Opt(app, "--max-connections", g.http.max_connections, "SHOAL_MAX_CONNECTIONS",
      "Open HTTP connections, idle ones included (over: 503 server_busy)");
  Opt(app, "--chunk-size", g.dispatcher.chunk_size, "SHOAL_CHUNK_SIZE", "Inputs per queue message");
  Opt(app, "--max-inputs", g.router.max_inputs, "SHOAL_MAX_INPUTS", "Inputs per request (over: 400)");
  Opt(app, "--request-timeout-ms", g.router.default_timeout_ms, "SHOAL_REQUEST_TIMEOUT_MS",
      "Deadline of a request without a Shoal-Timeout-Ms header (then: 504)");
  Opt(app, "--gateway-id", g.dispatcher.gateway_id, "SHOAL_GATEWAY_ID", "Gateway id (default: random)");
  Opt(app, "--dispatch", g.dispatcher.dispatch, "SHOAL_DISPATCH",
      "pull: workers pull from the shared queue; push: the gateway sends each chunk straight to one worker "
      "(the baseline for comparison; not durable)")
      ->check(CLI::IsMember({"pull", "push"}));
  Opt(app, "--push-policy", g.dispatcher.push_policy, "SHOAL_PUSH_POLICY",
      "push: least-loaded (least estimated outstanding rows) or p2c (power of two choices)")
      ->check(CLI::IsMember({"least-loaded", "p2c"}));
  Opt(app, "--push-worker-timeout-ms", g.dispatcher.push_worker_timeout_ms, "SHOAL_PUSH_WORKER_TIMEOUT_MS",
      "push: a worker silent (no load report) this long is dropped and its requests fail with 503 worker_lost");
  Opt(app, "--wait-for-load", g.router.wait_for_load, "SHOAL_WAIT_FOR_LOAD",
      "A request for a model no worker has loaded waits for the load (true) or gets 503 model_loading with Retry-After (false)");
  Opt(app, "--cancel-on-disconnect", g.http.watch_clients, "SHOAL_CANCEL_ON_DISCONNECT",
      "A client that disconnects (or closes its sending side) before its answer stops its request's work (true); "
      "false for proxies that half-close once the request is sent");
}

Result<int64_t> ParseBytes(const std::string& text);
// A flag check for byte sizes, so a bad one is a parse error like any other
// value that does not parse (exit status 105, before anything starts).
const CLI::Validator kByteSize(
    [](std::string& text) {
      auto bytes = ParseBytes(text);
      return bytes.ok() ? std::string() : bytes.status().message();
    },
    "BYTES");

// Blob offload (docs/blob-store.md), for gateway, worker and serve alike.
struct BlobFlags {
  std::string store;  // empty: the command's default
  std::string threshold = "1MiB";
  std::string max_queued = "1GiB";
  std::string max_fetched = "1GiB";
  int64_t ttl_ms = int64_t{3600} * 1000;
  int64_t sweep_interval_ms = 15 * 60 * 1000;
};

void AddBlob(CLI::App* app, BlobFlags& b, const std::string& default_store) {
  Opt(app, "--blob-store", b.store, "SHOAL_BLOB_STORE",
      "Blob store for payloads over --blob-threshold: file:///dir, nats://[bucket] (NATS object store) or none "
      "(default: " + default_store + ")");
  Opt(app, "--blob-threshold", b.threshold, "SHOAL_BLOB_THRESHOLD",
      "Work messages and replies larger than this go through the blob store (B, KiB, MiB, ...)")
      ->check(kByteSize);
  Opt(app, "--blob-max-queued", b.max_queued, "SHOAL_BLOB_MAX_QUEUED",
      "Payload bytes a gateway holds while they wait to be stored; past it a request that needs the store gets "
      "503 blob_store_busy (B, KiB, MiB, ...)")
      ->check(kByteSize);
  Opt(app, "--blob-max-fetched", b.max_fetched, "SHOAL_BLOB_MAX_FETCHED",
      "Payload bytes a worker holds fetched from the store until their work is answered; past it pulled work waits "
      "for room before its payload is fetched (B, KiB, MiB, ...)")
      ->check(kByteSize);
  Opt(app, "--blob-ttl-ms", b.ttl_ms, "SHOAL_BLOB_TTL_MS", "Age after which a leftover blob is an orphan and swept");
  Opt(app, "--blob-sweep-interval-ms", b.sweep_interval_ms, "SHOAL_BLOB_SWEEP_INTERVAL_MS",
      "How often a gateway sweeps orphan blobs (0: never)");
}

// `sweeps`: whether this process runs the orphan sweep (gateways do).
Result<BlobOffloadOptions> ApplyBlob(const BlobFlags& b, const std::string& default_store, bool sweeps) {
  BlobOffloadOptions o;
  o.store_url = b.store.empty() ? default_store : b.store;
  if (o.store_url == "none") o.store_url.clear();
  ASSIGN_OR_RETURN(o.threshold_bytes, ParseBytes(b.threshold));
  ASSIGN_OR_RETURN(o.max_queued_bytes, ParseBytes(b.max_queued));
  ASSIGN_OR_RETURN(o.max_fetched_bytes, ParseBytes(b.max_fetched));
  o.ttl_ms = b.ttl_ms;
  o.sweep_interval_ms = sweeps ? b.sweep_interval_ms : 0;
  RETURN_IF_ERROR(o.Validate());
  return o;
}

struct WorkerFlags {
  WorkerOptions options;
  std::string models_csv;
  std::string memory_budget = "0";
  std::string host_memory_budget = "0";
  std::string pin_csv;
  std::string preload_csv = "all";
  int metrics_port = -1;
  std::string omp_wait_policy = "inherit";
};

void AddWorker(CLI::App* app, WorkerFlags& w) {
  Opt(app, "--models-dir", w.options.model_repository, "SHOAL_MODELS_DIR", "Model repository directory");
  Opt(app, "--models", w.models_csv, "SHOAL_MODELS", "Comma-separated model names to serve (default: all)");
  Opt(app, "--threads", w.options.intra_op_threads, "SHOAL_THREADS", "Intra-op threads per forward pass (0: model config / all cores)");
  Opt(app, "--runtime", w.options.runtime_override, "SHOAL_RUNTIME", "Override the runtime of every embed, score and classify model (null: no model, overhead only; sim: simulated)");
  Opt(app, "--max-batch-tokens", w.options.max_batch_tokens, "SHOAL_MAX_BATCH_TOKENS", "Padded tokens per forward pass, every model (0: model config)");
  Opt(app, "--max-batch-size", w.options.max_batch_size, "SHOAL_MAX_BATCH_SIZE", "Rows per forward pass, every model (0: model config)");
  Opt(app, "--max-wait-us", w.options.max_wait_us, "SHOAL_MAX_WAIT_US", "Longest wait to fill a batch, every model (-1: model config)");
  Opt(app, "--omp-wait-policy", w.omp_wait_policy, "SHOAL_OMP_WAIT_POLICY",
      "OpenMP idle threads: inherit (OMP_WAIT_POLICY as set), passive, or active (only on a machine dedicated to this worker)")
      ->check(CLI::IsMember({"inherit", "passive", "active"}));
  Opt(app, "--device", w.options.device, "SHOAL_DEVICE",
      "Where TorchScript models run: cpu, cuda or cuda:N (needs a libtorch with CUDA); the memory budget is this device's");
  Opt(app, "--memory-budget", w.memory_budget, "SHOAL_MEMORY_BUDGET",
      "Memory for resident models on this device, e.g. 2GiB, 512MiB, 3000000000 (0: unlimited)")
      ->check(kByteSize);
  Opt(app, "--host-memory-budget", w.host_memory_budget, "SHOAL_HOST_MEMORY_BUDGET",
      "GPU workers: memory for resident models whose runtime computes on the host (socket, OCR, OpenAI), apart "
      "from the GPU's --memory-budget (0: unlimited)")
      ->check(kByteSize);
  Opt(app, "--max-models", w.options.max_models, "SHOAL_MAX_MODELS", "Most models resident at once (0: unlimited)");
  Opt(app, "--eviction", w.options.eviction, "SHOAL_EVICTION",
      "Which idle model goes first when a load needs room: lru (least recently used) or gdsf (uses x load time / "
      "footprint, lowest first)")
      ->check(CLI::IsMember({"lru", "gdsf"}));
  Opt(app, "--load-nice", w.options.load_nice, "SHOAL_LOAD_NICE",
      "Nice value (0..19) of model loads, so a load uses the CPU that serving leaves idle (0: serving's priority)");
  Opt(app, "--huge-pages", w.options.huge_pages, "SHOAL_HUGE_PAGES",
      "While a model loads, put its tensors of 32 MiB and more on transparent huge pages (faster loads; true or false)");
  Opt(app, "--keep-freed-memory", w.options.keep_freed_memory, "SHOAL_KEEP_FREED_MEMORY",
      "Keep memory freed by forward passes for the next pass instead of returning it to the system (true or false)");
  Opt(app, "--pin", w.pin_csv, "SHOAL_PIN", "Comma-separated models loaded at start and never evicted");
  Opt(app, "--preload", w.preload_csv, "SHOAL_PRELOAD",
      "Models loaded at start while they fit without evicting: all, none, or comma-separated names");
  Opt(app, "--device-slots", w.options.device_slots, "SHOAL_DEVICE_SLOTS", "Forward passes running at once on this device, each on --threads threads (0: auto, one per core; "
      "a model alone on the device runs on all cores, models that compete run side by side on one core each)");
  Opt(app, "--turn-quantum-ms", w.options.turn_quantum_ms, "SHOAL_TURN_QUANTUM_MS",
      "While other models wait for the device, cut a model's batch to about this many ms of its measured cost, so a "
      "model draining a backlog hands the device on sooner (0: full batches always)");
  Opt(app, "--scale-out-backlog", w.options.scale_out_backlog, "SHOAL_SCALE_OUT_BACKLOG",
      "Load another replica of a model when its waiting messages per replica exceed this and there is room (0: never)");
  Opt(app, "--demand-poll-ms", w.options.demand_poll_ms, "SHOAL_DEMAND_POLL_MS", "How often the queue's backlog per model is read");
  Opt(app, "--claim-ttl-ms", w.options.claim_ttl_ms, "SHOAL_CLAIM_TTL_MS", "Life of a placement claim for a cold model");
  Opt(app, "--retry-failed-after-ms", w.options.retry_failed_after_ms, "SHOAL_RETRY_FAILED_AFTER_MS",
      "A model that failed to load is tried again on demand after this long");
  Opt(app, "--worker-id", w.options.worker_id, "SHOAL_WORKER_ID", "Worker id (default: host-pid-random)");
  Opt(app, "--ack-wait-ms", w.options.consumer.ack_wait_ms, "SHOAL_ACK_WAIT_MS", "Redeliver work unacked this long (crashed worker)");
  Opt(app, "--max-deliver", w.options.consumer.max_deliver, "SHOAL_MAX_DELIVER", "Deliveries before work goes to the dead-letter stream");
  Opt(app, "--heartbeat-ms", w.options.heartbeat_interval_ms, "SHOAL_HEARTBEAT_MS", "Registry heartbeat interval");
  Opt(app, "--heartbeat-ttl-ms", w.options.heartbeat_ttl_ms, "SHOAL_HEARTBEAT_TTL_MS", "Registry entry lifetime without heartbeat");
  Opt(app, "--load-report-ms", w.options.load_report_interval_ms, "SHOAL_LOAD_REPORT_MS",
      "Load report interval on shoal.load.<worker> for push-dispatching gateways (0: off)");
  Opt(app, "--max-held-rows", w.options.max_held_rows, "SHOAL_MAX_HELD_ROWS",
      "Stop pulling while this worker holds this many rows, all models together (0: no bound; each model pulls up to its batch budget)");
  Opt(app, "--pull-ahead", w.options.pull_ahead, "SHOAL_PULL_AHEAD",
      "Most forward passes' worth of work a worker claims ahead of its device, all models together: open pulls "
      "plus pulled work waiting (0: no bound; each model pulls whenever its batcher has room)");
  Opt(app, "--pull-idle-poll-ms", w.options.pull_idle_poll_ms, "SHOAL_PULL_IDLE_POLL_MS",
      "With --pull-ahead: how long a claimed pull waits for work before its claim moves on to another model");
  Opt(app, "--fetch-poll-ms", w.options.fetch_poll_ms, "SHOAL_FETCH_POLL_MS",
      "Long-poll of an idle model's pull (returns as soon as work arrives)");
}


// "2GiB", "512MiB", "1.5GB", "3000000000" -> bytes.
Result<int64_t> ParseBytes(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return InvalidArgument("bad byte size '" + text + "'");
  }
  std::string unit = text.substr(used);
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},          {"B", 1},         {"KB", 1e3},  {"MB", 1e6},  {"GB", 1e9},
      {"KiB", 1024.0},  {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"K", 1024.0},
      {"M", 1048576.0}, {"G", 1073741824.0}};
  for (const auto& [name, factor] : kUnits) {
    if (unit == name) {
      if (!(value >= 0)) return InvalidArgument("byte size must be >= 0: '" + text + "'");
      if (!(value * factor < 9.2e18)) return InvalidArgument("byte size too large: '" + text + "'");
      return static_cast<int64_t>(value * factor);
    }
  }
  return InvalidArgument("bad byte size unit in '" + text + "' (use B, KB, MB, GB, KiB, MiB, GiB)");
}

// Fills the worker options that need parsing from their flags.
Status ApplyWorkerFlags(WorkerFlags& w) {
  w.options.models = cli::SplitNonEmpty(w.models_csv, ',');
  ASSIGN_OR_RETURN(w.options.memory_budget_bytes, ParseBytes(w.memory_budget));
  ASSIGN_OR_RETURN(w.options.host_memory_budget_bytes, ParseBytes(w.host_memory_budget));
  w.options.pinned = cli::SplitNonEmpty(w.pin_csv, ',');
  w.options.preload = w.preload_csv == "none" ? std::vector<std::string>{} : cli::SplitNonEmpty(w.preload_csv, ',');
  // A GPU this build cannot use fails before anything starts.
  return CheckComputeDevice(w.options.device);
}

// SIGINT and SIGTERM are blocked in every thread and taken by one thread of
// their own (BlockSignals, before any other thread starts). While a command
// starts (nats-server, model loads: minutes, or a load that hangs), one ends
// the process at once, exit status 128 + the signal: nothing is served yet,
// and the nats-server and runtime processes it started die with it
// (PDEATHSIG). Once serving (MarkServing), the first one starts the
// orderly stop; a second one while stopping ends the process at once.
std::mutex g_signal_mu;
std::condition_variable g_signal_cv;
int g_signal = 0;        // guarded by g_signal_mu: the one that asked to stop (0: none yet)
bool g_serving = false;  // guarded by g_signal_mu: MarkServing() has been called

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// Asks the command to stop as `sig` would (WaitForSignal returns it).
void RequestStop(int sig) {
  {
    std::lock_guard<std::mutex> lock(g_signal_mu);
    if (g_signal == 0) g_signal = sig;
  }
  g_signal_cv.notify_all();
}

void SignalLoop() {
  const sigset_t set = ShutdownSignals();
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    bool serving = false, stopping = false;
    {
      std::lock_guard<std::mutex> lock(g_signal_mu);
      serving = g_serving;
      stopping = g_signal != 0;
    }
    if (!serving || stopping) {
      LOG_WARN("shoal", "signal " << sig << (serving ? " while stopping" : " while starting") << ": exiting now");
      std::_Exit(128 + sig);
    }
    RequestStop(sig);
  }
}

void BlockSignals() {
  const sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(SignalLoop).detach();
}

// The soft limit on open files up to the hard one (commonly 1024 against
// 524288 or more; at most 2^20): a gateway holds a descriptor per
// connection, and --max-connections assumes it may.
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t want = std::min(limit.rlim_max, rlim_t{1} << 20);
  if (limit.rlim_cur >= want) return;
  limit.rlim_cur = want;
  (void)::setrlimit(RLIMIT_NOFILE, &limit);
}

// From here a signal stops the command in order (WaitForSignal returns it)
// instead of ending the process: call it before saying it is ready.
void MarkServing() {
  std::lock_guard<std::mutex> lock(g_signal_mu);
  g_serving = true;
}

// Blocks until a signal (or a failed device) asks the command to stop.
int WaitForSignal() {
  std::unique_lock<std::mutex> lock(g_signal_mu);
  g_signal_cv.wait(lock, [] { return g_signal != 0; });
  return g_signal;
}

// libgomp reads OMP_WAIT_POLICY once, when the process loads it, so a
// policy chosen by flag takes effect by re-executing this binary with the
// variable set. Returns only when no re-exec is needed (or it failed).
void ApplyOmpWaitPolicy(const std::string& policy, char** argv) {
  if (policy == "inherit") return;
  std::string want = policy == "active" ? "ACTIVE" : "PASSIVE";
  const char* have = std::getenv("OMP_WAIT_POLICY");
  if (have && want == have) return;
  ::setenv("OMP_WAIT_POLICY", want.c_str(), 1);
  ::execv("/proc/self/exe", argv);
  LOG_WARN("shoal", "cannot re-execute to apply --omp-wait-policy; continuing without it");
}

// Set when a worker's device has failed for the rest of the process
// (WorkerOptions::on_device_fault): the process then stops as on SIGTERM
// and exits 1, so that its supervisor starts a fresh one.
std::atomic<bool> g_device_failed{false};

void StopAfterDeviceFault(const Status&) {
  g_device_failed = true;
  RequestStop(SIGTERM);  // no real signal: one could end the process by SIGTERM, a clean stop to supervisors
}

int ExitCode(const char* component) {
  if (!g_device_failed) return 0;
  LOG_ERROR(component, "exiting 1: the device failed; a fresh process can use it again");
  return 1;
}

int Fail(const Status& s) {
  // The reason is what docs and scripts key on (pinned_models_exceed_budget,
  // device_unavailable, ...).
  if (s.reason().empty()) {
    LOG_ERROR("shoal", s.ToString());
  } else {
    LOG_ERROR("shoal", StatusCodeName(s.code()) << " (" << s.reason() << "): " << s.message());
  }
  return 1;
}

// Takes `dir`/serve.lock for the rest of the process's life and returns its
// descriptor: two nats-servers must not share one JetStream store. The
// lock goes with the process however it ends (flock), so a killed serve
// leaves nothing to clean up; the nats-server inherits the descriptor, so
// the lock also lasts until that server has exited.
Result<int> LockDataDir(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Unavailable("cannot create data directory " + dir.string() + ": " + ec.message());
  const std::string path = (dir / "serve.lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Unavailable("cannot open " + path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      return Unavailable("cannot lock " + path + ": " + why);
    }
    char pid[32] = {};
    const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
    ::close(fd);
    const std::string holder = n > 0 ? " (pid " + std::string(pid, static_cast<size_t>(n)) + ")" : "";
    return Unavailable("another shoal serve" + holder + " is using the data directory " + dir.string() +
                           "; give this one its own --data-dir",
                       "data_dir_in_use");
  }
  const std::string me = std::to_string(::getpid());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    LOG_WARN("serve", "cannot write the pid into " << path << ": " << std::strerror(errno));
  }
  return fd;  // stays open (and locked) until exit
}

Result<std::unique_ptr<NatsClient>> ConnectNats(const std::string& url, const std::string& name) {
  NatsOptions o;
  o.url = url;
  o.name = name;
  return NatsClient::Connect(o);
}

// Serves the worker's metrics on their own port when asked (a gateway in
// the same process already serves them).
Result<std::unique_ptr<HttpServer>> WorkerMetricsServer(int port, MetricsRegistry* metrics) {
  HttpServerOptions o;
  o.host = "0.0.0.0";
  o.port = port;
  o.threads = 1;
  return HttpServer::Create(o, [metrics](HttpRequest&& req, HttpResponder respond) {
    HttpResponse r;
    if (req.path == "/metrics") {
      r.content_type = "text/plain; version=0.0.4";
      r.body = metrics->Render();
    } else if (req.path == "/healthz") {
      r.body = "{\"status\":\"ok\"}";
    } else {
      r = ErrorResponse(NotFound("no route for " + req.method + " " + req.path, "route_not_found"));
    }
    respond(std::move(r));
  });
}

std::string DefaultModelsDir() {
  // Next to the binary's source tree when run from a build dir, else ./models.
  if (const char* v = std::getenv("SHOAL_MODELS_DIR"); v && *v) return v;
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  for (auto p = exe.parent_path(); !ec && p.has_parent_path() && p != p.parent_path(); p = p.parent_path()) {
    if (std::filesystem::exists(p / "models" / "minilm-l6" / "shoal.json")) return (p / "models").string();
  }
  return "models";
}

}  // namespace
}  // namespace shoal

int main(int argc, char** argv) {
  using namespace shoal;
  RaiseOpenFileLimit();
  CLI::App app{"Shoal: a pull-based serving cluster for fleets of small models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shoal 0.1.0");

  // --- serve ---------------------------------------------------------------
  CLI::App* serve = app.add_subcommand("serve", "Run everything on this machine: a private nats-server -js, a gateway and a worker");
  CommonFlags serve_common;
  GatewayOptions serve_gw;
  serve_gw.http.port = 8080;
  WorkerFlags serve_wk;
  serve_wk.options.model_repository = DefaultModelsDir();
  StreamFlags serve_stream;
  std::string data_dir = ".shoal";
  int nats_port = 0;
  AddCommon(serve, serve_common, false);
  AddGateway(serve, serve_gw);
  AddWorker(serve, serve_wk);
  AddStream(serve, serve_stream);
  Opt(serve, "--data-dir", data_dir, "SHOAL_DATA_DIR", "Where the private nats-server keeps the queue");
  Opt(serve, "--nats-port", nats_port, "SHOAL_NATS_PORT", "Port of the private nats-server (0: a free one)");
  BlobFlags serve_blob;
  AddBlob(serve, serve_blob, "file://<data dir>/blobs");

  // --- gateway ---------------------------------------------------------------
  CLI::App* gateway = app.add_subcommand("gateway", "Run an HTTP gateway against a NATS cluster");
  CommonFlags gw_common;
  GatewayOptions gw;
  gw.http.host = "0.0.0.0";
  gw.http.port = 8080;
  AddCommon(gateway, gw_common, true);
  AddGateway(gateway, gw);
  BlobFlags gw_blob;
  AddBlob(gateway, gw_blob, "nats://SHOAL_BLOBS");

  // --- worker ----------------------------------------------------------------
  CLI::App* worker = app.add_subcommand("worker", "Run a worker that pulls work from a NATS cluster");
  CommonFlags wk_common;
  WorkerFlags wk;
  wk.options.model_repository = DefaultModelsDir();
  StreamFlags wk_stream;
  AddCommon(worker, wk_common, true);
  AddWorker(worker, wk);
  AddStream(worker, wk_stream);
  BlobFlags wk_blob;
  AddBlob(worker, wk_blob, "nats://SHOAL_BLOBS");
  Opt(worker, "--metrics-port", wk.metrics_port, "SHOAL_METRICS_PORT", "Serve /metrics on this port (-1: off)");
  int sim_workers = 1;
  Opt(worker, "--sim-workers", sim_workers, "SHOAL_SIM_WORKERS",
      "Run this many independent workers in this process (ids <worker-id>-0 ...), each with its own NATS "
      "connection and device scheduler: for simulated devices (runtime sim) on a small machine")
      ->check(CLI::Range(1, 256));

  // --- models ------------------------------------------------------------------
  ModelsCommandFlags models_flags;
  CLI::App* models = AddModelsCommand(&app, &models_flags);

  // --- bench -------------------------------------------------------------------
  BenchCommandFlags bench_flags;
  CLI::App* bench = AddBenchCommand(&app, &bench_flags);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the message, or the help asked for
    // `shoal models` and `shoal bench` end every bad value with 2, as they
    // do the values they check themselves.
    const bool reports_with_2 = models->parsed() || bench->parsed();
    return code != 0 && reports_with_2 ? 2 : code;
  }
  if (models->parsed()) return RunModelsCommand(models_flags);
  if (bench->parsed()) return RunBenchCommand(bench_flags);
  if (serve->parsed()) ApplyOmpWaitPolicy(serve_wk.omp_wait_policy, argv);
  if (worker->parsed()) ApplyOmpWaitPolicy(wk.omp_wait_policy, argv);
  // Before any thread starts: it may replace libtorch's allocator.
  if (serve->parsed()) Worker::PrepareProcess(serve_wk.options);
  if (worker->parsed()) Worker::PrepareProcess(wk.options);
  BlockSignals();

  auto set_level = [](const std::string& text) {
    LogLevel level;
    if (!ParseLogLevel(text, &level)) return false;
    SetLogLevel(level);
    return true;
  };

  if (serve->parsed()) {
    if (!set_level(serve_common.log_level)) return Fail(InvalidArgument("bad --log-level"));
    // Every option is checked before anything starts: a bad value exits
    // without having started (or written the data of) a nats-server.
    if (Status s = ApplyWorkerFlags(serve_wk); !s.ok()) return Fail(s);
    const std::string serve_store = "file://" + std::filesystem::absolute(data_dir).lexically_normal().string() + "/blobs";
    auto serve_gw_blob = ApplyBlob(serve_blob, serve_store, /*sweeps=*/true);
    if (!serve_gw_blob.ok()) return Fail(serve_gw_blob.status());
    serve_gw.blob = *serve_gw_blob;
    serve_wk.options.blob = *serve_gw_blob;
    serve_wk.options.blob.sweep_interval_ms = 0;
    ApplyStream(serve_stream, &serve_wk.options.stream);
    if (Status s = serve_wk.options.Validate(); !s.ok()) return Fail(s);
    if (Status s = serve_gw.Validate(); !s.ok()) return Fail(s);
    if (!serve_gw.blob.store_url.empty())
      if (Status s = CheckBlobStoreUrl(serve_gw.blob.store_url); !s.ok()) return Fail(s);
    if (auto models = Worker::SelectModels(serve_wk.options); !models.ok()) return Fail(models.status());
    auto lock_fd = LockDataDir(std::filesystem::absolute(data_dir));
    if (!lock_fd.ok()) return Fail(lock_fd.status());
    // A port in use fails here, not after every model has loaded.
    if (Status s = HttpServer::CheckAddress(serve_gw.http); !s.ok()) return Fail(s);
    NatsServerOptions ns;
    ns.inherit_fd = *lock_fd;
    ns.port = nats_port;
    ns.data_dir = std::filesystem::absolute(data_dir).string() + "/jetstream";
    ns.die_with_parent = true;  // started on the main thread: a killed shoal serve takes it along
    auto server = NatsServerProcess::Start(ns);
    if (!server.ok()) return Fail(server.status());
    LOG_INFO("serve", "nats-server -js on " << (*server)->url() << ", data in " << ns.data_dir);
    auto client = ConnectNats((*server)->url(), "shoal-serve");
    if (!client.ok()) return Fail(client.status());
    MetricsRegistry metrics;
    serve_wk.options.on_device_fault = StopAfterDeviceFault;
    auto w = Worker::Create(serve_wk.options, client->get(), &metrics);
    if (!w.ok()) return Fail(w.status());
    auto g = Gateway::Create(serve_gw, client->get(), &metrics);
    if (!g.ok()) return Fail(g.status());
    const auto models = (*w)->ModelNames();
    const std::string url = "http://" + (serve_gw.http.host == "0.0.0.0" ? std::string("127.0.0.1") : serve_gw.http.host) +
                            ":" + std::to_string((*g)->port());
    MarkServing();
    std::printf("Shoal is serving %zu model(s) at %s\n", models.size(), url.c_str());
    std::printf("Try:\n  curl -s %s/v1/embeddings -H 'Content-Type: application/json' \\\n"
                "    -d '{\"model\":\"%s\",\"input\":\"Shoal serves small models.\"}'\n",
                url.c_str(), models.empty() ? "minilm-l6" : models.front().c_str());
    std::printf("Press Ctrl-C to stop.\n");
    std::fflush(stdout);
    int sig = WaitForSignal();
    LOG_INFO("serve", "signal " << sig << ": shutting down");
    (*g)->Stop();
    (*w)->Stop();
    g->reset();
    w->reset();
    client->reset();
    (*server)->Stop();
    LOG_INFO("serve", "stopped");
    return ExitCode("serve");
  }

  if (gateway->parsed()) {
    if (!set_level(gw_common.log_level)) return Fail(InvalidArgument("bad --log-level"));
    auto client = ConnectNats(gw_common.nats_url, "shoal-gateway");
    if (!client.ok()) return Fail(client.status());
    MetricsRegistry metrics;
    auto gw_blob_opts = ApplyBlob(gw_blob, "nats://SHOAL_BLOBS", /*sweeps=*/true);
    if (!gw_blob_opts.ok()) return Fail(gw_blob_opts.status());
    gw.blob = *gw_blob_opts;
    auto g = Gateway::Create(gw, client->get(), &metrics);
    if (!g.ok()) return Fail(g.status());
    LOG_INFO("gateway", "listening on " << gw.http.host << ":" << (*g)->port() << ", NATS " << gw_common.nats_url);
    MarkServing();
    std::printf("shoal gateway listening on port %d\n", (*g)->port());
    std::fflush(stdout);
    int sig = WaitForSignal();
    LOG_INFO("gateway", "signal " << sig << ": shutting down");
    (*g)->Stop();
    return 0;
  }

  if (worker->parsed()) {
    if (!set_level(wk_common.log_level)) return Fail(InvalidArgument("bad --log-level"));
    MetricsRegistry metrics;
    if (Status s = ApplyWorkerFlags(wk); !s.ok()) return Fail(s);
    auto wk_blob_opts = ApplyBlob(wk_blob, "nats://SHOAL_BLOBS", /*sweeps=*/false);
    if (!wk_blob_opts.ok()) return Fail(wk_blob_opts.status());
    wk.options.blob = *wk_blob_opts;
    ApplyStream(wk_stream, &wk.options.stream);
    // Bound before the models load and the worker joins the fleet, so a
    // port in use fails at once.
    std::unique_ptr<HttpServer> metrics_server;
    if (wk.metrics_port >= 0) {
      auto m = WorkerMetricsServer(wk.metrics_port, &metrics);
      if (!m.ok()) return Fail(m.status());
      metrics_server = std::move(m).value();
      LOG_INFO("worker", "metrics on port " << metrics_server->port());
    }
    std::vector<std::unique_ptr<NatsClient>> clients;
    std::vector<std::unique_ptr<MetricsRegistry>> worker_metrics;  // one labelled view per simulated worker
    std::vector<std::unique_ptr<Worker>> workers;
    std::string base_id = wk.options.worker_id;
    if (sim_workers > 1 && base_id.empty()) base_id = "sim-" + std::to_string(::getpid());
    for (int k = 0; k < sim_workers; ++k) {
      auto client = ConnectNats(wk_common.nats_url, "shoal-worker");
      if (!client.ok()) return Fail(client.status());
      WorkerOptions o = wk.options;
      o.on_device_fault = StopAfterDeviceFault;
      MetricsRegistry* m = &metrics;
      if (sim_workers > 1) {
        o.worker_id = base_id + "-" + std::to_string(k);
        worker_metrics.push_back(std::make_unique<MetricsRegistry>(&metrics, Labels{{"worker", o.worker_id}}));
        m = worker_metrics.back().get();
      }
      auto w = Worker::Create(o, client->get(), m);
      if (!w.ok()) return Fail(w.status());
      clients.push_back(std::move(client).value());
      workers.push_back(std::move(w).value());
    }

    MarkServing();
    for (const auto& one : workers) std::printf("shoal worker %s ready\n", one->id().c_str());
    std::fflush(stdout);
    int sig = WaitForSignal();
    LOG_INFO("worker", "signal " << sig << ": shutting down");
    for (auto& one : workers) one->Stop();
    workers.clear();
    return ExitCode("worker");
  }
  return 0;
}
