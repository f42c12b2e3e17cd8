// shoal_bench_fleet: what serving a fleet of models from one memory budget
// costs, against the same traffic served by resident models.
//
// The fleet: --models (50) models named fleet-00..fleet-NN, one in
// --large-every (5) a copy of minilm-l6 (~90 MB), the rest copies of
// tiny-bert (a few MB); which ranks are large is a seeded shuffle, so
// popularity and size are not correlated. Popularity is Zipf(--zipf-s):
// fleet-00 is the most popular.
//
//  0. footprints  a worker with nothing preloaded loads two small and two
//                 large models; the second measurement of each size (past
//                 the process's one-time libtorch costs) sets the budget:
//                 --budget-models x the mean footprint of the fleet's mix.
//  1. reference   one resident small and one resident large model, no
//                 budget; every draw goes to the one of its size. The
//                 compute per request is that of the fleet phase; only the
//                 fleet effects (loads, evictions, cold waits) are missing.
//  2. fleet       the same draws to their own models on a worker with the
//                 budget; the most popular models that fit are preloaded.
//
// Both phases: a private nats-server -js, a Worker and a Gateway in this
// process (wired like `shoal serve`), one short sentence per /v1/embeddings
// request, sent by loadgen::RunLoad: --clients closed-loop keep-alive
// clients, or with --rates an open loop (Poisson arrivals, one window per
// rate, lowest first; each side's capacity is the highest rate it kept up
// with, and with every lower one).
// The client records every request: its model, whether that model was
// resident when the request was sent, and whether the model was (re)loaded
// while the request was out, or queued behind work that had waited for the
// model's load (work counted in shoal_worker_load_waits_total was pulled
// while the request was out: a model's queue is first in, first out). That
// gives the latency of requests that had to wait for a load; the worker's
// own shoal_worker_load_wait_seconds (queued until loaded) is reported
// beside it, and the worker's stage histograms (queue, batch, device turn,
// forward pass) show where the others spent their time. Loads, evictions, forward time and
// the CPU of this process, nats-server and the rest of the machine are
// sampled over every measured window.
#include <pthread.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
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
#include "gateway/gateway.h"
#include "loadgen/http_load.h"
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"
#include "worker/model_manager.h"
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
  std::string models_dir = SHOAL_DEFAULT_MODELS_DIR;
  std::string small_model = "tiny-bert";
  std::string large_model = "minilm-l6";
  int models = 50;
  int large_every = 5;       // 1 in this many models is large
  int budget_models = 10;    // the budget holds this many models of the mix
  double zipf_s = 1.1;
  int requests = 20000;      // pre-built draws, sent in turn (wrapping)
  int clients = 16;
  std::vector<double> rates;  // open loop, one window per rate; empty: closed loop
  double slo_ms = 1000;       // open loop: p99 bound for requests that did not wait for a load
  double duration_s = 30;
  double warmup_s = 10;
  int threads = 0;           // intra-op threads (0: all cores, as shoal serve)
  int64_t demand_poll_ms = 250;
  int64_t fetch_poll_ms = 500;  // the worker's default long-poll
  int load_nice = WorkerOptions{}.load_nice;
  int device_slots = WorkerOptions{}.device_slots;  // 0: auto (one per core, passes widen)
  int64_t turn_quantum_ms = WorkerOptions{}.turn_quantum_ms;
  bool huge_pages = WorkerOptions{}.huge_pages;
  bool keep_freed_memory = WorkerOptions{}.keep_freed_memory;
  std::string eviction = "lru";
  std::string preload = "top";  // top: most popular models that fit; none
  uint64_t seed = 1;
  std::string json_out;
  std::string log_level = "warn";
};

// ----- Traffic -----------------------------------------------------------------

// Deterministic short English sentences (7..13 words).
std::vector<std::string> MakeSentences(int count, uint64_t seed) {
  static const char* kWords[] = {
      "the", "a", "small", "model", "serves", "many", "requests", "on", "one", "machine", "every", "day",
      "queue", "worker", "pulls", "work", "from", "shared", "stream", "and", "runs", "batches", "of",
      "short", "text", "fast", "quiet", "river", "flows", "past", "old", "stone", "bridge", "near",
      "town", "children", "play", "in", "green", "park", "after", "school", "while", "their", "parents",
      "talk", "about", "weather", "news", "market", "prices", "rose", "again", "this", "week", "because",
      "demand", "for", "fresh", "bread", "was", "high", "new", "library", "opens", "at", "nine", "with"};
  constexpr int kNumWords = static_cast<int>(sizeof(kWords) / sizeof(kWords[0]));
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> word(0, kNumWords - 1), len(7, 13);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    std::string s;
    const int n = len(gen);
    for (int w = 0; w < n; ++w) {
      if (w) s.push_back(' ');
      s += kWords[word(gen)];
    }
    s.push_back('.');
    out.push_back(std::move(s));
  }
  return out;
}

// Zipf(s) over ranks 0..n-1: P(rank k) proportional to 1 / (k+1)^s.
std::vector<double> ZipfWeights(int n, double s) {
  std::vector<double> w(n);
  for (int k = 0; k < n; ++k) w[k] = 1.0 / std::pow(k + 1.0, s);
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  for (double& x : w) x /= total;
  return w;
}

std::vector<int> ZipfDraws(const std::vector<double>& weights, int count, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::discrete_distribution<int> d(weights.begin(), weights.end());
  std::vector<int> out(count);
  for (int& r : out) r = d(gen);
  return out;
}

// The fleet, by popularity rank: names[r] and whether rank r is large.
struct Fleet {
  std::string repo;
  std::vector<std::string> names;
  std::vector<bool> large;
  int FirstOfSize(bool want_large, int skip = 0) const {
    for (size_t r = 0; r < names.size(); ++r)
      if (large[r] == want_large && skip-- == 0) return static_cast<int>(r);
    return -1;
  }
};

// One model directory: the source's shoal.json under a new name, and links
// to every other file of the source.
Status MakeModelDir(const fs::path& source, const fs::path& dir, const std::string& name) {
  std::ifstream in(source / "shoal.json");
  if (!in) return NotFound("no shoal.json in " + source.string());
  json cfg;
  try {
    cfg = json::parse(in);
  } catch (const json::exception& e) {
    return InvalidArgument(source.string() + "/shoal.json: " + e.what());
  }
  cfg["name"] = name;
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(fs::absolute(source)))
    if (e.path().filename() != "shoal.json") fs::create_symlink(e.path(), dir / e.path().filename());
  std::ofstream(dir / "shoal.json") << cfg.dump(2);
  return Status::Ok();
}

Result<Fleet> MakeFleet(const Flags& f, const fs::path& root) {
  Fleet fleet;
  fleet.repo = (root / "repo").string();
  const int n = f.models, n_large = f.large_every > 0 ? n / f.large_every : 0;
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  std::mt19937_64 gen(f.seed ^ 0x5eed);
  std::shuffle(ranks.begin(), ranks.end(), gen);
  fleet.large.assign(n, false);
  for (int i = 0; i < n_large; ++i) fleet.large[ranks[i]] = true;
  for (int r = 0; r < n; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "fleet-%02d", r);
    fleet.names.push_back(name);
    const fs::path source = fs::path(f.models_dir) / (fleet.large[r] ? f.large_model : f.small_model);
    RETURN_IF_ERROR(MakeModelDir(source, fs::path(fleet.repo) / name, name));
  }
  return fleet;
}

// Pre-built requests, one per draw; model[i] names the target of requests[i].
struct Traffic {
  std::vector<std::string> requests;
  std::vector<std::string> model;
};

Traffic MakeTraffic(const std::vector<int>& draws, const std::vector<std::string>& target_of_rank,
                    const std::vector<std::string>& sentences) {
  Traffic t;
  for (size_t i = 0; i < draws.size(); ++i) {
    const std::string& m = target_of_rank[draws[i]];
    t.model.push_back(m);
    t.requests.push_back(JsonPostRequest("127.0.0.1", "/v1/embeddings",
                                         json({{"model", m}, {"input", sentences[i % sentences.size()]}}).dump()));
  }
  return t;
}

// ----- System counters -------------------------------------------------------------

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

// ----- The served stack ----------------------------------------------------------

class Stack {
 public:
  static Result<std::unique_ptr<Stack>> Start(const WorkerOptions& wo, const fs::path& data_dir) {
    auto s = std::unique_ptr<Stack>(new Stack());
    NatsServerOptions ns;
    ns.data_dir = (data_dir / "jetstream").string();
    ASSIGN_OR_RETURN(s->nats_, NatsServerProcess::Start(ns));
    NatsOptions no;
    no.url = s->nats_->url();
    no.name = "bench-fleet";
    ASSIGN_OR_RETURN(s->client_, NatsClient::Connect(no));
    ASSIGN_OR_RETURN(s->worker_, Worker::Create(wo, s->client_.get(), &s->metrics_));
    GatewayOptions go;
    go.http.port = 0;
    // The open loop keeps a connection per outstanding request (up to
    // LoadOptions::max_connections, 8192): requests waiting seconds for a
    // load would otherwise meet the gateway's default cap (4096, 503
    // server_busy), and the run would measure the cap, not serving.
    go.http.max_connections = 16384;
    ASSIGN_OR_RETURN(s->gateway_, Gateway::Create(go, s->client_.get(), &s->metrics_));
    return s;
  }
  ~Stack() {
    if (gateway_) gateway_->Stop();
    if (worker_) worker_->Stop();
    gateway_.reset();
    worker_.reset();
    client_.reset();
    if (nats_) nats_->Stop();
  }
  int port() const { return gateway_->port(); }
  pid_t nats_pid() const { return nats_->pid(); }
  Worker& worker() { return *worker_; }
  MetricsRegistry& metrics() { return metrics_; }

 private:
  Stack() = default;
  MetricsRegistry metrics_;  // outlives everything below
  std::unique_ptr<NatsServerProcess> nats_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<Gateway> gateway_;
};

WorkerOptions BaseWorkerOptions(const Flags& f, const Fleet& fleet) {
  WorkerOptions wo;
  wo.model_repository = fleet.repo;
  wo.intra_op_threads = f.threads;
  wo.demand_poll_ms = f.demand_poll_ms;
  wo.fetch_poll_ms = f.fetch_poll_ms;
  wo.load_nice = f.load_nice;
  wo.device_slots = f.device_slots;
  wo.turn_quantum_ms = f.turn_quantum_ms;
  wo.huge_pages = f.huge_pages;
  wo.keep_freed_memory = f.keep_freed_memory;
  wo.eviction = f.eviction;
  return wo;
}

// ----- HTTP client: one blocking keep-alive connection per client thread ----------

class Connection {
 public:
  explicit Connection(int port) : port_(port) {}
  // The HTTP status, or -1 when the connection failed (it reconnects on the
  // next call).
  int Post(const std::string& request, std::string* body) {
    namespace asio = boost::asio;
    namespace http = boost::beast::http;
    try {
      if (!sock_.is_open()) {
        sock_.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_)});
        sock_.set_option(asio::ip::tcp::no_delay(true));
        buf_.clear();
      }
      asio::write(sock_, asio::buffer(request));
      http::response_parser<http::string_body> parser;
      parser.body_limit(64 << 20);
      http::read(sock_, buf_, parser);
      *body = std::move(parser.get().body());
      if (!parser.get().keep_alive()) sock_.close();
      return parser.get().result_int();
    } catch (const std::exception& e) {
      *body = e.what();
      boost::system::error_code ignored;
      sock_.close(ignored);
      return -1;
    }
  }

 private:
  int port_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket sock_{io_};
  boost::beast::flat_buffer buf_;
};

// One request as the client saw it.
struct Outcome {
  int model = 0;              // index into the phase's model list
  bool cold = false;          // its model was not resident when it was sent
  bool reloaded = false;      // resident when sent, but (re)loaded before the answer
  // Resident when sent and not reloaded, but work that had waited for its
  // model's load was pulled while this request was out: it queued behind
  // the backlog the load left (the model's queue is first in, first out).
  bool behind_load = false;
  double latency_ms = 0;      // from when it was due (open loop) or sent (closed loop)
  int status = 0;             // HTTP status; 0: the connection failed

  // Did not wait for a load in any way: the requests the p99 bound holds.
  bool Clear() const { return !cold && !reloaded && !behind_load; }
};

struct ClientRun {
  std::vector<Outcome> done;  // the requests that count in the measured window
  LoadResult load;            // RunLoad's own counts
};

// Sends the traffic with loadgen::RunLoad. rate 0: closed loop, `clients`
// keep-alive connections each sending its next request when the previous is
// answered; counts what is answered in the window. rate > 0: open loop,
// Poisson arrivals at `rate` per second onto as many connections as needed,
// latency from the scheduled arrival; counts every request due in the
// window (all of them are waited for). The requests go out in the order of
// the draws. `at_window` runs on a client thread at the window's start and
// end.
ClientRun RunTraffic(int port, const Traffic& traffic, const std::vector<std::string>& models, ModelManager& manager,
                     MetricsRegistry& metrics, const Flags& f, double rate,
                     const std::function<void(bool start)>& at_window) {
  std::map<std::string, int> index;
  for (size_t i = 0; i < models.size(); ++i) index[models[i]] = static_cast<int>(i);
  std::vector<int> model_of(traffic.model.size());
  for (size_t i = 0; i < traffic.model.size(); ++i) model_of[i] = index.at(traffic.model[i]);
  std::vector<Counter*> loads, load_waits;
  for (const auto& m : models) {
    loads.push_back(metrics.GetCounter("shoal_worker_model_loads_total", "Model loads, by result.",
                                       {{"model", m}, {"result", "ok"}}));
    load_waits.push_back(metrics.GetCounter("shoal_worker_load_waits_total", "Requests that waited for a model to load.",
                                            {{"model", m}}));
  }
  LoadOptions o;
  o.port = port;
  o.requests = traffic.requests;
  o.rate_per_s = rate;
  o.connections = rate > 0 ? 64 : f.clients;
  o.max_connections = 8192;
  o.threads = 2;
  o.warmup_s = f.warmup_s;
  o.duration_s = f.duration_s;
  o.seed = f.seed;
  o.fail_when_all_failed = false;
  o.on_window_start = [&] { at_window(true); };
  o.on_window_end = [&] { at_window(false); };
  // What the client knew when it sent a request: whether its model was
  // resident (bit 0), the model's load count (bits 1-31) and its count of
  // pulled work that had waited for a load (bits 32-63).
  o.on_request_sent = [&](size_t k) -> uint64_t {
    const int m = model_of[k];
    const bool cold = !manager.IsLoaded(models[m]);
    return (static_cast<uint64_t>(load_waits[m]->Value()) << 32) |
           ((static_cast<uint64_t>(loads[m]->Value()) & 0x7fffffff) << 1) | (cold ? 1 : 0);
  };
  std::mutex mu;
  ClientRun run;
  o.on_request_done = [&](size_t k, uint64_t sent, int status, double latency_ms, bool in_window) {
    if (!in_window) return;
    Outcome out;
    out.model = model_of[k];
    out.cold = (sent & 1) != 0;
    out.reloaded = !out.cold && (static_cast<uint64_t>(loads[out.model]->Value()) & 0x7fffffff) != ((sent >> 1) & 0x7fffffff);
    out.behind_load = !out.cold && !out.reloaded && static_cast<uint64_t>(load_waits[out.model]->Value()) != (sent >> 32);
    out.latency_ms = latency_ms;
    out.status = status;
    std::lock_guard<std::mutex> lock(mu);
    run.done.push_back(out);
  };
  auto r = RunLoad(o);
  if (!r.ok()) {
    run.load.first_error = r.status().ToString();
    return run;
  }
  std::lock_guard<std::mutex> lock(mu);
  run.load = std::move(*r);
  return run;
}

// The gateway learns the catalog in the background: wait for a 200.
Status WaitReady(int port, const std::string& request) {
  Connection conn(port);
  std::string body;
  int code = -1;
  for (const auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;) {
    code = conn.Post(request, &body);
    if (code == 200) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Unavailable("gateway not ready after 60 s: HTTP " + std::to_string(code) + " " + body.substr(0, 200));
}

// ----- Worker-side counters over a window -----------------------------------------

struct FleetSample {
  double proc_cpu = 0, nats_cpu = 0, machine_busy = 0;
  int64_t loads = 0, evictions = 0, load_waits = 0, redelivered = 0, shortened = 0;
  double load_s = 0, forward_s = 0, rows = 0;
  int64_t passes = 0;
  std::vector<int64_t> wait_buckets;  // shoal_worker_load_wait_seconds, summed over models
  // Where requests spend their time, in LatencyBuckets() (summed over
  // models): kStages[i] names stage_buckets[i].
  std::vector<std::vector<int64_t>> stage_buckets;
};

// The stages of a request, in order: the gateway's whole HTTP request, then
// the worker's shared-queue wait (published -> pulled; the only stage that
// leaves out work that waited for a load), batch wait (pulled -> batch cut,
// device turn included), the turn wait alone, and the forward pass (per
// pass, not per request).
struct Stage {
  const char* metric;
  const char* help;   // as the gateway and worker register it
  const char* label;  // printed
  bool per_model;
};
constexpr Stage kStages[] = {
    {"shoal_http_request_seconds", "HTTP request latency by route.", "gateway HTTP", false},
    {"shoal_worker_queue_wait_seconds",
     "Time work waited in the shared queue before this worker pulled it, first deliveries only (work queued before "
     "the model was loaded here is counted in shoal_worker_load_wait_seconds instead).",
     "queue (published->pulled)", true},
    {"shoal_worker_batch_wait_seconds",
     "Time pulled work waited until its batch was cut, the wait for a device turn included.", "batch (pulled->cut)",
     true},
    {"shoal_worker_device_wait_seconds", "Time a formed batch waited for its turn on the device.", "device turn", true},
    {"shoal_worker_forward_seconds", "Forward pass time.", "forward pass", true},
};

// A histogram's bucket counts (LatencyBuckets()), summed over label sets.
std::vector<int64_t> SumBuckets(MetricsRegistry& m, const char* metric, const char* help,
                                const std::vector<Labels>& label_sets) {
  std::vector<int64_t> sum(LatencyBuckets().size() + 1, 0);
  for (const Labels& l : label_sets) {
    Histogram* h = m.GetHistogram(metric, help, l, LatencyBuckets());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += h->BucketCount(i);
  }
  return sum;
}

// What was counted between two SumBuckets() of the same histogram.
std::vector<int64_t> BucketDelta(const std::vector<int64_t>& before, const std::vector<int64_t>& after) {
  std::vector<int64_t> d(after.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = after[i] - before[i];
  return d;
}

FleetSample SampleFleet(MetricsRegistry& m, const std::vector<std::string>& models, pid_t nats) {
  FleetSample s;
  s.proc_cpu = ProcessCpuSeconds();
  s.nats_cpu = PidCpuSeconds(nats);
  s.machine_busy = MachineBusySeconds();
  std::vector<Labels> per_model;
  for (const auto& name : models) per_model.push_back({{"model", name}});
  for (const auto& name : models) {
    const Labels l = {{"model", name}};
    s.loads += m.GetCounter("shoal_worker_model_loads_total", "Model loads, by result.",
                            {{"model", name}, {"result", "ok"}})->Value();
    s.evictions += m.GetCounter("shoal_worker_model_evictions_total", "Models unloaded to make room for another.", l)
                       ->Value();
    s.load_waits += m.GetCounter("shoal_worker_load_waits_total", "Requests that waited for a model to load.", l)
                        ->Value();
    s.redelivered += m.GetCounter("shoal_worker_redelivered_total", "Work delivered more than once.", l)->Value();
    s.shortened += m.GetCounter("shoal_worker_batches_shortened_total", "", l)->Value();
    s.load_s += m.GetHistogram("shoal_worker_model_load_seconds", "Time to load a model.", l, LatencyBuckets())->Sum();
    Histogram* fwd = m.GetHistogram("shoal_worker_forward_seconds", "Forward pass time.", l, LatencyBuckets());
    s.forward_s += fwd->Sum();
    s.passes += fwd->Count();
    s.rows += m.GetHistogram("shoal_worker_batch_rows", "Rows per forward pass.", l, SizeBuckets())->Sum();
  }
  s.wait_buckets = SumBuckets(m, "shoal_worker_load_wait_seconds", "How long requests waited for a model to load.",
                              per_model);
  const std::vector<Labels> gateway = {Labels{{"route", "/v1/embeddings"}}};
  for (const Stage& stage : kStages)
    s.stage_buckets.push_back(SumBuckets(m, stage.metric, stage.help, stage.per_model ? per_model : gateway));
  return s;
}

// Percentile p (0..100) of bucketed counts, interpolated linearly inside the
// bucket (the +Inf bucket reports its lower bound).
double BucketPercentile(const std::vector<double>& bounds, const std::vector<int64_t>& counts, double p) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total == 0) return 0;
  const double rank = p / 100.0 * static_cast<double>(total);
  double seen = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] == 0 || seen + static_cast<double>(counts[i]) < rank) {
      seen += static_cast<double>(counts[i]);
      continue;
    }
    const double lo = i == 0 ? 0 : bounds[i - 1];
    if (i == bounds.size()) return lo;
    return lo + (bounds[i] - lo) * (rank - seen) / static_cast<double>(counts[i]);
  }
  return bounds.back();
}

// ----- Phases -------------------------------------------------------------------

struct Percentiles {
  int64_t n = 0;
  double p50_ms = 0, p99_ms = 0, max_ms = 0;
};

Percentiles LatencyOf(const std::vector<Outcome>& done, const std::function<bool(const Outcome&)>& keep) {
  LoadResult r;  // for its nearest-rank percentile
  for (const Outcome& o : done)
    if (o.status == 200 && keep(o)) r.latencies_ms.push_back(o.latency_ms);
  std::sort(r.latencies_ms.begin(), r.latencies_ms.end());
  Percentiles p;
  p.n = static_cast<int64_t>(r.latencies_ms.size());
  p.p50_ms = r.PercentileMs(50);
  p.p99_ms = r.PercentileMs(99);
  p.max_ms = r.latencies_ms.empty() ? 0 : r.latencies_ms.back();
  return p;
}

json PercentilesJson(const Percentiles& p) {
  return {{"requests", p.n}, {"p50_ms", p.p50_ms}, {"p99_ms", p.p99_ms}, {"max_ms", p.max_ms}};
}

struct PhaseReport {
  double rate = 0;              // offered requests/s; 0: closed loop
  double window_s = 0;
  int64_t ok = 0, errors = 0, tokens = 0;
  int64_t due = 0, dropped = 0;  // open loop: arrivals in the window; with no connection
  std::string first_error;
  Percentiles all, cold, warm;  // cold: had to wait for a load (cold or reloaded)
  Percentiles clear;            // warm and not behind a load's backlog
  std::string slow_clear;       // the models of the clear requests over 1 s, most frequent first
  std::string error_models;     // the models of the requests not answered 200, most frequent first
  int64_t cold_sent = 0, reloaded = 0;
  int64_t top_ok = 0, top_waited = 0;  // requests to the --budget-models most popular models
  double proc_cores = 0, client_cores = 0, nats_cores = 0, other_cores = 0;
  double model_busy = 0;        // forward seconds / window (passes at once add up)
  int64_t passes = 0;           // forward passes
  double rows_per_pass = 0;
  double forward_ms_per_request = 0;
  double loader_busy = 0;       // load seconds / window
  int64_t loads = 0, evictions = 0, load_waits = 0;
  int64_t redelivered = 0;      // work messages delivered more than once
  int64_t shortened = 0;        // batches cut to the turn quantum
  double worker_wait_p50_s = 0, worker_wait_p99_s = 0;
  std::vector<std::vector<int64_t>> stage_buckets;  // window deltas, as FleetSample
  double resident_mean = 0;
  int resident_min = 0, resident_max = 0;
  double loading_mean = 0;      // models loading (or queued to load)
  double memory_used_mean_mb = 0;
  double small_mb = 0, large_mb = 0;  // mean accounted footprint of a resident model
  double large_share = 0;       // of the answered requests

  double Rps() const { return ok / window_s; }
  double Tps() const { return static_cast<double>(tokens) / window_s; }
  // Open loop: answered (200) at least `share` of what was due, and the
  // requests that did not wait for a load (neither for their model's load
  // nor behind the work it left queued) stayed within `slo_ms` at p99.
  // `count_backlog`: the earlier, stricter reading, which counts requests
  // queued behind a load's backlog as not waiting for a load.
  bool KeptUp(double share, double slo_ms, bool count_backlog = false) const {
    const double p99 = count_backlog ? warm.p99_ms : clear.p99_ms;
    return due > 0 && static_cast<double>(ok) >= share * static_cast<double>(due) && p99 <= slo_ms;
  }
};

// Resident and loading models and accounted memory, sampled every 200 ms
// over the window.
class ResidentSampler {
 public:
  ResidentSampler(ModelManager& m, const std::vector<std::string>& models, const std::vector<bool>& large)
      : m_(m) {
    for (size_t i = 0; i < models.size(); ++i) large_[models[i]] = large[i];
  }
  ~ResidentSampler() { Stop(); }
  void Start() {
    thread_ = std::thread([this] {
      while (!stop_) {
        Sample();
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  void Fill(PhaseReport* p) {
    std::lock_guard<std::mutex> lock(mu_);
    if (counts_.empty()) return;
    p->resident_mean = std::accumulate(counts_.begin(), counts_.end(), 0.0) / static_cast<double>(counts_.size());
    p->resident_min = *std::min_element(counts_.begin(), counts_.end());
    p->resident_max = *std::max_element(counts_.begin(), counts_.end());
    p->memory_used_mean_mb = std::accumulate(mb_.begin(), mb_.end(), 0.0) / static_cast<double>(mb_.size());
    p->loading_mean = static_cast<double>(loading_) / static_cast<double>(counts_.size());
    for (int l = 0; l < 2; ++l)
      if (class_n_[l] > 0) (l ? p->large_mb : p->small_mb) = class_mb_[l] / static_cast<double>(class_n_[l]);
  }

 private:
  void Sample() {
    int loaded = 0, loading = 0;
    double class_mb[2] = {0, 0};
    int64_t class_n[2] = {0, 0};
    for (const ModelStatus& s : m_.Statuses()) {
      loading += s.state == ModelState::kLoading;
      if (s.state != ModelState::kLoaded) continue;
      ++loaded;
      const int l = large_.count(s.name) && large_.at(s.name) ? 1 : 0;
      class_mb[l] += static_cast<double>(s.memory_bytes) / (1 << 20);
      ++class_n[l];
    }
    const double mb = static_cast<double>(m_.memory_used_bytes()) / (1 << 20);
    std::lock_guard<std::mutex> lock(mu_);
    counts_.push_back(loaded);
    mb_.push_back(mb);
    loading_ += loading;
    for (int l = 0; l < 2; ++l) class_mb_[l] += class_mb[l], class_n_[l] += class_n[l];
  }

  ModelManager& m_;
  std::map<std::string, bool> large_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::vector<int> counts_;  // guarded by mu_
  std::vector<double> mb_;   // guarded by mu_
  int64_t loading_ = 0;      // guarded by mu_; summed over samples
  double class_mb_[2] = {0, 0};  // guarded by mu_; small, large
  int64_t class_n_[2] = {0, 0};  // guarded by mu_
};

// `top[i]`: models[i] is one of the --budget-models most popular (may be
// empty).
PhaseReport RunPhase(Stack& stack, const Traffic& traffic, const std::vector<std::string>& models,
                     const std::vector<bool>& large, const std::vector<bool>& top, const Flags& f, double rate) {
  FleetSample a, b;
  ResidentSampler resident(stack.worker().manager(), models, large);
  auto at_window = [&](bool start) {
    if (start) {
      a = SampleFleet(stack.metrics(), models, stack.nats_pid());
      resident.Start();
    } else {
      b = SampleFleet(stack.metrics(), models, stack.nats_pid());
      resident.Stop();
    }
  };
  ClientRun run =
      RunTraffic(stack.port(), traffic, models, stack.worker().manager(), stack.metrics(), f, rate, at_window);
  PhaseReport p;
  p.rate = rate;
  const double t = p.window_s = f.duration_s;
  int64_t large_ok = 0;
  for (const Outcome& o : run.done) {
    if (o.status != 200) {
      ++p.errors;
      continue;
    }
    ++p.ok;
    p.cold_sent += o.cold;
    p.reloaded += o.reloaded;
    large_ok += large[o.model];
    if (!top.empty() && top[o.model]) {
      ++p.top_ok;
      p.top_waited += o.cold || o.reloaded;
    }
  }
  p.large_share = p.ok ? static_cast<double>(large_ok) / static_cast<double>(p.ok) : 0;
  p.tokens = run.load.prompt_tokens;
  p.due = run.load.due;
  p.dropped = run.load.dropped;
  p.first_error = run.load.first_error;
  p.all = LatencyOf(run.done, [](const Outcome&) { return true; });
  p.cold = LatencyOf(run.done, [](const Outcome& o) { return o.cold || o.reloaded; });
  p.warm = LatencyOf(run.done, [](const Outcome& o) { return !o.cold && !o.reloaded; });
  p.clear = LatencyOf(run.done, [](const Outcome& o) { return o.Clear(); });
  // The models of the requests `pick` selects, most frequent first, with
  // how many of each.
  const auto models_of = [&](const std::function<bool(const Outcome&)>& pick) {
    std::map<int, int> n;
    for (const Outcome& o : run.done)
      if (pick(o)) ++n[o.model];
    std::vector<std::pair<int, int>> by(n.begin(), n.end());
    std::stable_sort(by.begin(), by.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
    std::string out;
    for (size_t i = 0; i < by.size() && i < 8; ++i) {
      out += (i ? ", " : "") + models[by[i].first] + (large[by[i].first] ? " (large)" : "") + " x" +
             std::to_string(by[i].second);
    }
    return out;
  };
  p.slow_clear = models_of([](const Outcome& o) { return o.status == 200 && o.Clear() && o.latency_ms > 1000; });
  p.error_models = models_of([](const Outcome& o) { return o.status != 200; });
  p.proc_cores = (b.proc_cpu - a.proc_cpu) / t;
  p.client_cores = run.load.client_cpu_s / t;
  p.nats_cores = (b.nats_cpu - a.nats_cpu) / t;
  p.other_cores = std::max(0.0, (b.machine_busy - a.machine_busy) / t - p.proc_cores - p.nats_cores);
  p.model_busy = (b.forward_s - a.forward_s) / t;
  p.loader_busy = (b.load_s - a.load_s) / t;
  p.passes = b.passes - a.passes;
  p.rows_per_pass = p.passes > 0 ? (b.rows - a.rows) / static_cast<double>(p.passes) : 0;
  p.forward_ms_per_request = p.ok > 0 ? 1000 * (b.forward_s - a.forward_s) / static_cast<double>(p.ok) : 0;
  p.loads = b.loads - a.loads;
  p.evictions = b.evictions - a.evictions;
  p.load_waits = b.load_waits - a.load_waits;
  p.redelivered = b.redelivered - a.redelivered;
  p.shortened = b.shortened - a.shortened;
  const std::vector<int64_t> waits = BucketDelta(a.wait_buckets, b.wait_buckets);
  p.worker_wait_p50_s = BucketPercentile(LatencyBuckets(), waits, 50);
  p.worker_wait_p99_s = BucketPercentile(LatencyBuckets(), waits, 99);
  for (size_t k = 0; k < b.stage_buckets.size(); ++k)
    p.stage_buckets.push_back(BucketDelta(a.stage_buckets[k], b.stage_buckets[k]));
  resident.Fill(&p);
  return p;
}

void PrintPhase(const char* name, const PhaseReport& p) {
  if (p.rate > 0) {
    std::printf("  %-9s offered %.0f/s: %lld due, %lld ok, %lld errors, %lld dropped (no connection)\n", name, p.rate,
                static_cast<long long>(p.due), static_cast<long long>(p.ok), static_cast<long long>(p.errors),
                static_cast<long long>(p.dropped));
  }
  std::printf("  %-9s %8.1f req/s %8.0f tokens/s   p50 %7.1f ms  p99 %8.1f ms  (%lld ok, %lld errors)\n", name,
              p.Rps(), p.Tps(), p.all.p50_ms, p.all.p99_ms, static_cast<long long>(p.ok),
              static_cast<long long>(p.errors));
  if (p.cold.n > 0) {
    std::printf("            waited for a load: %lld, p50 %.1f ms p99 %.1f ms; the rest p50 %.1f ms p99 %.1f ms\n",
                static_cast<long long>(p.cold.n), p.cold.p50_ms, p.cold.p99_ms, p.warm.p50_ms, p.warm.p99_ms);
    std::printf("            of the rest, %lld queued behind work that had waited for a load; the other %lld: p50 %.1f ms "
                "p99 %.1f ms max %.1f ms\n",
                static_cast<long long>(p.warm.n - p.clear.n), static_cast<long long>(p.clear.n), p.clear.p50_ms,
                p.clear.p99_ms, p.clear.max_ms);
    if (!p.slow_clear.empty()) std::printf("            their models over 1 s: %s\n", p.slow_clear.c_str());
  }
  if (!p.error_models.empty()) std::printf("            models of the errors: %s\n", p.error_models.c_str());
  std::printf("            large-model requests %.0f%%; resident models %.1f (%d..%d), loading %.1f, %.0f MiB accounted\n",
              100 * p.large_share, p.resident_mean, p.resident_min, p.resident_max, p.loading_mean,
              p.memory_used_mean_mb);
  std::printf("            accounted footprint of a resident model: small %.1f MiB, large %.1f MiB\n", p.small_mb,
              p.large_mb);
  std::printf("            forward passes busy %.0f%% (summed over passes running at once): %lld passes, %.1f rows each, "
              "%.2f ms of forward time per request; %lld batches cut to the turn quantum\n",
              100 * p.model_busy, static_cast<long long>(p.passes), p.rows_per_pass, p.forward_ms_per_request,
              static_cast<long long>(p.shortened));
  std::printf("            loader busy %.0f%%; loads %lld (%.0f ms each), evictions %lld (%.0f/min); redelivered %lld\n",
              100 * p.loader_busy, static_cast<long long>(p.loads),
              p.loads > 0 ? 1000 * p.loader_busy * p.window_s / static_cast<double>(p.loads) : 0.0,
              static_cast<long long>(p.evictions), p.evictions * 60 / p.window_s, static_cast<long long>(p.redelivered));
  std::printf("            CPU cores: this process %.2f (client %.2f), nats-server %.2f, other processes %.2f\n",
              p.proc_cores, p.client_cores, p.nats_cores, p.other_cores);
  const std::vector<double> bounds = LatencyBuckets();
  const size_t one_s = static_cast<size_t>(std::find(bounds.begin(), bounds.end(), 1.0) - bounds.begin());
  for (size_t k = 0; k < p.stage_buckets.size(); ++k) {
    const std::vector<int64_t>& c = p.stage_buckets[k];
    const int64_t n = std::accumulate(c.begin(), c.end(), int64_t{0});
    const int64_t over = std::accumulate(c.begin() + static_cast<std::ptrdiff_t>(one_s) + 1, c.end(), int64_t{0});
    std::printf("            %-26s %7lld observed, p50 %7.1f ms p99 %7.1f ms p99.9 %7.1f ms, over 1 s: %lld\n",
                kStages[k].label, static_cast<long long>(n), 1000 * BucketPercentile(bounds, c, 50),
                1000 * BucketPercentile(bounds, c, 99), 1000 * BucketPercentile(bounds, c, 99.9),
                static_cast<long long>(over));
  }
  if (!p.first_error.empty()) std::printf("            first error: %s\n", p.first_error.c_str());
  std::fflush(stdout);
}

json PhaseJson(const PhaseReport& p) {
  return {{"offered_per_s", p.rate},
          {"window_s", p.window_s},
          {"requests_ok", p.ok},
          {"errors", p.errors},
          {"due", p.due},
          {"dropped", p.dropped},
          {"requests_per_s", p.Rps()},
          {"tokens_per_s", p.Tps()},
          {"large_model_share", p.large_share},
          {"latency_all", PercentilesJson(p.all)},
          {"latency_waited_for_load", PercentilesJson(p.cold)},
          {"latency_no_load", PercentilesJson(p.warm)},
          {"latency_no_load_not_behind_a_load", PercentilesJson(p.clear)},
          {"sent_to_non_resident_model", p.cold_sent},
          {"model_reloaded_while_out", p.reloaded},
          {"requests_to_top_models", p.top_ok},
          {"requests_to_top_models_that_waited_for_load", p.top_waited},
          {"loads", p.loads},
          {"evictions", p.evictions},
          {"evictions_per_min", p.evictions * 60 / p.window_s},
          {"worker_load_waits", p.load_waits},
          {"worker_load_wait_p50_s", p.worker_wait_p50_s},
          {"worker_load_wait_p99_s", p.worker_wait_p99_s},
          {"model_busy_fraction", p.model_busy},
          {"forward_passes", p.passes},
          {"rows_per_forward_pass", p.rows_per_pass},
          {"forward_ms_per_request", p.forward_ms_per_request},
          {"loader_busy_fraction", p.loader_busy},
          {"resident_models_mean", p.resident_mean},
          {"resident_models_min", p.resident_min},
          {"resident_models_max", p.resident_max},
          {"loading_models_mean", p.loading_mean},
          {"resident_small_mib_mean", p.small_mb},
          {"resident_large_mib_mean", p.large_mb},
          {"memory_accounted_mib_mean", p.memory_used_mean_mb},
          {"cpu_cores_process", p.proc_cores},
          {"cpu_cores_client", p.client_cores},
          {"cpu_cores_nats_server", p.nats_cores},
          {"cpu_cores_other_processes", p.other_cores}};
}

// One closed-loop window, or one open-loop window per --rates entry on the
// same stack (each with its own warm-up); `out` gets one JSON object per window.
std::vector<PhaseReport> RunRates(Stack& stack, const Traffic& traffic, const std::vector<std::string>& models,
                                  const std::vector<bool>& large, const std::vector<bool>& top, const Flags& f,
                                  const char* name, json* out) {
  std::vector<PhaseReport> reports;
  *out = json::array();
  const std::vector<double> rates = f.rates.empty() ? std::vector<double>{0} : f.rates;
  for (const double rate : rates) {
    reports.push_back(RunPhase(stack, traffic, models, large, top, f, rate));
    PrintPhase(name, reports.back());
    out->push_back(PhaseJson(reports.back()));
    out->back()["models"] = models.size() <= 4 ? json(models) : json(models.size());
  }
  return reports;
}

// ----- Footprints -------------------------------------------------------------

struct Footprints {
  std::vector<std::pair<std::string, int64_t>> measured;  // in load order
  int64_t small_bytes = 0, large_bytes = 0;                // the second of each size
  std::vector<double> unload_ms;                           // idle models, as an eviction unloads them
};

// Loads two small and two large fleet models on a worker with nothing
// preloaded and reads what the worker measured for each. Then unloads the
// four, idle, timing each: what an eviction costs the loader thread.
Result<Footprints> MeasureFootprints(const Flags& f, const Fleet& fleet, const fs::path& data_dir) {
  const int s1 = fleet.FirstOfSize(false), l1 = fleet.FirstOfSize(true);
  const int s2 = fleet.FirstOfSize(false, 1), l2 = fleet.FirstOfSize(true, 1);
  if (s2 < 0 || l2 < 0) return InvalidArgument("the fleet needs at least two small and two large models");
  const std::vector<std::string> order = {fleet.names[s1], fleet.names[l1], fleet.names[s2], fleet.names[l2]};
  WorkerOptions wo = BaseWorkerOptions(f, fleet);
  wo.models = order;
  wo.preload = {};
  ASSIGN_OR_RETURN(auto stack, Stack::Start(wo, data_dir));
  for (const auto& name : order) RETURN_IF_ERROR(stack->worker().manager().Load(name));
  Footprints fp;
  const auto statuses = stack->worker().manager().Statuses();
  for (const auto& name : order)
    for (const ModelStatus& s : statuses)
      if (s.name == name) fp.measured.emplace_back(name, s.memory_bytes);
  fp.small_bytes = fp.measured[2].second;
  fp.large_bytes = fp.measured[3].second;
  for (const auto& name : order) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(stack->worker().manager().Unload(name));
    fp.unload_ms.push_back(1000 * Seconds(Clock::now() - t0));
  }
  return fp;
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Measures footprints (phase 0), prints them and returns the budget:
// --budget-models x the mean footprint of the fleet's mix.
struct Budget {
  int64_t bytes = 0;
  double mean_model_bytes = 0;
  json footprints;
};

Result<Budget> ChooseBudget(const Flags& f, const Fleet& fleet, const fs::path& dir) {
  std::printf("\n[0] footprints: a worker with nothing preloaded loads two small and two large models\n");
  ASSIGN_OR_RETURN(Footprints fp, MeasureFootprints(f, fleet, dir));
  json measured = json::array();
  for (const auto& [name, bytes] : fp.measured) {
    const auto r = std::find(fleet.names.begin(), fleet.names.end(), name) - fleet.names.begin();
    const bool large = fleet.large[r];
    std::printf("  %s (%s) %8.1f MiB\n", name.c_str(), large ? "large" : "small", MiB(bytes));
    measured.push_back({{"model", name}, {"large", large}, {"bytes", bytes}});
  }
  const int n_large = static_cast<int>(std::count(fleet.large.begin(), fleet.large.end(), true));
  Budget b;
  b.mean_model_bytes =
      (static_cast<double>(n_large) * fp.large_bytes + static_cast<double>(f.models - n_large) * fp.small_bytes) /
      f.models;
  b.bytes = static_cast<int64_t>(f.budget_models * b.mean_model_bytes);
  std::printf("  mean of the mix (%d small x %.1f MiB, %d large x %.1f MiB; second load of each size): %.1f MiB\n",
              f.models - n_large, MiB(fp.small_bytes), n_large, MiB(fp.large_bytes), b.mean_model_bytes / (1 << 20));
  std::printf("  budget = %d x %.1f MiB = %.1f MiB\n", f.budget_models, b.mean_model_bytes / (1 << 20), MiB(b.bytes));
  std::printf("  unloading each of them, idle (ModelManager::Unload):");
  for (double ms : fp.unload_ms) std::printf(" %.0f ms", ms);
  std::printf("\n");
  b.footprints = {{"measured", measured},         {"small_bytes", fp.small_bytes},
                  {"large_bytes", fp.large_bytes}, {"mean_bytes", b.mean_model_bytes},
                  {"budget_bytes", b.bytes},       {"idle_unload_ms", fp.unload_ms}};
  return b;
}

// Phase 1: every draw to the resident model of its size.
Result<std::vector<PhaseReport>> RunReference(const Flags& f, const Fleet& fleet, const std::vector<int>& draws,
                                 const std::vector<std::string>& sentences, const fs::path& dir, json* out) {
  const std::string small = fleet.names[fleet.FirstOfSize(false)];
  const std::string large = fleet.names[fleet.FirstOfSize(true)];
  std::vector<std::string> target(f.models);
  for (int r = 0; r < f.models; ++r) target[r] = fleet.large[r] ? large : small;
  const Traffic traffic = MakeTraffic(draws, target, sentences);
  std::printf("\n[1] reference: every draw to %s (small) or %s (large), both resident, no budget; %.0f s (+%.0f s)\n",
              small.c_str(), large.c_str(), f.duration_s, f.warmup_s);
  WorkerOptions wo = BaseWorkerOptions(f, fleet);
  wo.models = {small, large};
  ASSIGN_OR_RETURN(auto stack, Stack::Start(wo, dir));
  RETURN_IF_ERROR(WaitReady(stack->port(), traffic.requests[0]));
  return RunRates(*stack, traffic, wo.models, {false, true}, {}, f, "reference", out);
}

// Phase 2: every draw to its own model, within the budget.
Result<std::vector<PhaseReport>> RunFleet(const Flags& f, const Fleet& fleet, const std::vector<int>& draws,
                             const std::vector<std::string>& sentences, int64_t budget, const fs::path& dir,
                             json* out) {
  const Traffic traffic = MakeTraffic(draws, fleet.names, sentences);
  std::printf("\n[2] fleet: every draw to its own model, budget %.1f MiB, preload %s; %.0f s (+%.0f s)\n", MiB(budget),
              f.preload.c_str(), f.duration_s, f.warmup_s);
  WorkerOptions wo = BaseWorkerOptions(f, fleet);
  wo.memory_budget_bytes = budget;
  // Names are in popularity order: the most popular first, as many as fit
  // without evicting.
  wo.preload = f.preload == "top" ? fleet.names : std::vector<std::string>{};
  ASSIGN_OR_RETURN(auto stack, Stack::Start(wo, dir));
  std::printf("  at start: %zu models resident\n", stack->worker().LoadedModels().size());
  RETURN_IF_ERROR(WaitReady(stack->port(), traffic.requests[0]));
  std::vector<bool> top(f.models, false);
  std::fill_n(top.begin(), std::min(f.budget_models, f.models), true);
  return RunRates(*stack, traffic, fleet.names, fleet.large, top, f, "fleet", out);
}

double Share(int64_t part, int64_t whole) { return whole > 0 ? 100.0 * static_cast<double>(part) / whole : 0.0; }

void PrintSummary(const PhaseReport& ref, const PhaseReport& fl, int budget_top) {
  const double ratio = ref.Rps() > 0 ? fl.Rps() / ref.Rps() : 0;
  std::printf("\nsummary\n");
  std::printf("  fleet / reference throughput: %.3f (req/s %.1f / %.1f; tokens/s ratio %.3f)  goal >= 0.8: %s\n", ratio,
              fl.Rps(), ref.Rps(), ref.Tps() > 0 ? fl.Tps() / ref.Tps() : 0, ratio >= 0.8 ? "met" : "NOT met");
  std::printf("  evictions: %.1f per minute; loads: %lld (%.1f per minute), loader busy %.0f%% of the window\n",
              fl.evictions * 60 / fl.window_s, static_cast<long long>(fl.loads), fl.loads * 60 / fl.window_s,
              100 * fl.loader_busy);
  std::printf("  requests that waited for a load (model not resident when sent: %lld; reloaded while out: %lld) = "
              "%.1f%% of answered\n",
              static_cast<long long>(fl.cold_sent), static_cast<long long>(fl.reloaded), Share(fl.cold.n, fl.ok));
  std::printf("    client latency  p50 %.1f ms  p99 %.1f ms  max %.1f ms\n", fl.cold.p50_ms, fl.cold.p99_ms,
              fl.cold.max_ms);
  std::printf("    of the answered requests to the %d most popular models, %lld of %lld (%.1f%%) waited for a load\n",
              budget_top, static_cast<long long>(fl.top_waited), static_cast<long long>(fl.top_ok),
              Share(fl.top_waited, fl.top_ok));
  std::printf("    worker queued->loaded (shoal_worker_load_wait_seconds, %lld requests, bucketed): p50 %.0f ms  p99 "
              "%.0f ms\n",
              static_cast<long long>(fl.load_waits), 1000 * fl.worker_wait_p50_s, 1000 * fl.worker_wait_p99_s);
  std::printf("  other requests: p50 %.1f ms  p99 %.1f ms; all requests: p50 %.1f ms  p99 %.1f ms\n", fl.warm.p50_ms,
              fl.warm.p99_ms, fl.all.p50_ms, fl.all.p99_ms);
}

// Open loop: the highest offered rate each side kept up with (KeptUp), and
// one line per rate.
json PrintRateSummary(const std::vector<PhaseReport>& ref, const std::vector<PhaseReport>& fl, const Flags& f) {
  constexpr double kShare = 0.99;
  std::printf("\nsummary (open loop; kept up = >= %.0f%% of the due requests answered 200 and p99 of the requests "
              "that did not wait for a load <= %.0f ms; no-load99: every request whose model was resident when sent, "
              "clear99: those of them not queued behind work that waited for a load)\n",
              100 * kShare, f.slo_ms);
  std::printf("  %8s | %9s %9s %5s | %9s %9s %9s %5s | %6s | %8s %8s %8s | %7s %9s\n", "offered", "ref ok/s",
              "ref p99", "kept", "fleet/s", "no-load99", "clear99", "kept", "ratio", "waited", "w-p50", "w-p99",
              "loads/m", "evict/m");
  // A side's capacity: the highest rate that it kept up with, and with
  // every lower rate tried (the rates run in ascending order).
  double ref_cap = 0, fleet_cap = 0, ref_cap_strict = 0, fleet_cap_strict = 0;
  bool ref_ok = true, fleet_ok = true, ref_ok_strict = true, fleet_ok_strict = true;
  auto step = [](bool kept, double rate, bool* ok, double* cap) {
    *ok = *ok && kept;
    if (*ok) *cap = rate;
  };
  json rows = json::array();
  for (size_t i = 0; i < ref.size() && i < fl.size(); ++i) {
    const PhaseReport &r = ref[i], &q = fl[i];
    const bool rk = r.KeptUp(kShare, f.slo_ms), qk = q.KeptUp(kShare, f.slo_ms);
    step(rk, r.rate, &ref_ok, &ref_cap);
    step(qk, q.rate, &fleet_ok, &fleet_cap);
    step(r.KeptUp(kShare, f.slo_ms, true), r.rate, &ref_ok_strict, &ref_cap_strict);
    step(q.KeptUp(kShare, f.slo_ms, true), q.rate, &fleet_ok_strict, &fleet_cap_strict);
    const double ratio = r.Rps() > 0 ? q.Rps() / r.Rps() : 0;
    std::printf("  %8.0f | %9.1f %9.1f %5s | %9.1f %9.1f %9.1f %5s | %6.3f | %7.1f%% %8.0f %8.0f | %7.0f %9.0f\n",
                r.rate, r.Rps(), r.clear.p99_ms, rk ? "yes" : "no", q.Rps(), q.warm.p99_ms, q.clear.p99_ms,
                qk ? "yes" : "no", ratio,
                Share(q.cold.n, q.ok), q.cold.p50_ms, q.cold.p99_ms, q.loads * 60 / q.window_s,
                q.evictions * 60 / q.window_s);
    rows.push_back({{"offered_per_s", r.rate}, {"reference_kept_up", rk}, {"fleet_kept_up", qk},
                    {"fleet_over_reference", ratio}});
  }
  const double cap_ratio = ref_cap > 0 ? fleet_cap / ref_cap : 0;
  std::printf("  highest rate kept up (and every lower one): reference %.0f/s, fleet %.0f/s: fleet / reference %.3f  goal >= 0.8: %s\n",
              ref_cap, fleet_cap, cap_ratio, cap_ratio >= 0.8 ? "met" : "NOT met");
  const double strict_ratio = ref_cap_strict > 0 ? fleet_cap_strict / ref_cap_strict : 0;
  std::printf("  counting requests queued behind a load's backlog as not waiting for a load: reference %.0f/s, fleet "
              "%.0f/s: %.3f\n",
              ref_cap_strict, fleet_cap_strict, strict_ratio);
  return {{"rates", rows},
          {"reference_capacity_per_s", ref_cap},
          {"fleet_capacity_per_s", fleet_cap},
          {"fleet_over_reference_capacity", cap_ratio},
          {"fleet_over_reference_capacity_counting_backlog", strict_ratio}};
}

json SettingsJson(const Flags& f) {
  return {{"models", f.models},
          {"large_every", f.large_every},
          {"budget_models", f.budget_models},
          {"zipf_s", f.zipf_s},
          {"requests", f.requests},
          {"clients", f.clients},
          {"rates", f.rates},
          {"slo_ms", f.slo_ms},
          {"duration_s", f.duration_s},
          {"warmup_s", f.warmup_s},
          {"threads", f.threads},
          {"demand_poll_ms", f.demand_poll_ms},
          {"fetch_poll_ms", f.fetch_poll_ms},
          {"load_nice", f.load_nice},
          {"device_slots", f.device_slots},
          {"turn_quantum_ms", f.turn_quantum_ms},
          {"huge_pages", f.huge_pages},
          {"keep_freed_memory", f.keep_freed_memory},
          {"eviction", f.eviction},
          {"preload", f.preload},
          {"seed", f.seed},
          {"small_model", f.small_model},
          {"large_model", f.large_model}};
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Shoal fleet benchmark: many models in one memory budget vs the same traffic on resident models"};
  app.add_option("--models-dir", f.models_dir, "Directory holding the source models")->capture_default_str();
  app.add_option("--small-model", f.small_model, "Source of the small models")->capture_default_str();
  app.add_option("--large-model", f.large_model, "Source of the large models")->capture_default_str();
  app.add_option("--models", f.models, "Models in the fleet")->check(CLI::Range(4, 1000))->capture_default_str();
  app.add_option("--large-every", f.large_every, "One model in this many is large")->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--budget-models", f.budget_models, "The budget holds this many models of the fleet's mix")
      ->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--zipf-s", f.zipf_s, "Zipf exponent of model popularity")->capture_default_str();
  app.add_option("--requests", f.requests, "Pre-built requests (seeded draws), sent in turn")
      ->check(CLI::Range(1, 10'000'000))->capture_default_str();
  app.add_option("--clients", f.clients, "Closed-loop HTTP clients")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--rates", f.rates,
                 "Open loop instead: Poisson arrivals at each of these rates (requests/s), one window each, "
                 "lowest first")
      ->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--slo-ms", f.slo_ms, "Open loop: p99 bound of requests that did not wait for a load")
      ->capture_default_str();
  app.add_option("--duration-s", f.duration_s, "Measured seconds of each phase")->capture_default_str();
  app.add_option("--warmup-s", f.warmup_s, "Unmeasured seconds before each phase")->capture_default_str();
  app.add_option("--threads", f.threads, "Intra-op threads per model (0: all cores)")->capture_default_str();
  app.add_option("--demand-poll-ms", f.demand_poll_ms, "Worker's backlog poll interval")->capture_default_str();
  app.add_option("--fetch-poll-ms", f.fetch_poll_ms, "Worker's fetch long-poll per model")->capture_default_str();
  app.add_option("--eviction", f.eviction, "Worker's eviction policy")
      ->check(CLI::IsMember({"lru", "gdsf"}))->capture_default_str();
  app.add_option("--device-slots", f.device_slots, "Worker's forward passes at once (0: auto, as shoal serve)")
      ->check(CLI::Range(0, 64))->capture_default_str();
  app.add_option("--turn-quantum-ms", f.turn_quantum_ms,
                 "Worker's turn quantum while other models wait for the device (0: full batches)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--load-nice", f.load_nice, "Worker's nice value of model loads (0: serving's priority)")
      ->check(CLI::Range(0, 19))->capture_default_str();
  app.add_option("--huge-pages", f.huge_pages, "Worker's huge pages for large tensors (true or false)")
      ->capture_default_str();
  app.add_option("--keep-freed-memory", f.keep_freed_memory,
                 "Worker keeps memory freed by passes for the next pass (true or false)")
      ->capture_default_str();
  app.add_option("--preload", f.preload, "Fleet phase: top (most popular that fit) or none")
      ->check(CLI::IsMember({"top", "none"}))->capture_default_str();
  app.add_option("--seed", f.seed, "Seed of the draws and of the size assignment")->capture_default_str();
  app.add_option("--json-out", f.json_out, "Also write the results as JSON to this file");
  app.add_option("--log-level", f.log_level, "debug | info | warn | error")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  {
    WorkerOptions process;  // before any thread starts, as shoal serve does
    process.huge_pages = f.huge_pages;
    process.keep_freed_memory = f.keep_freed_memory;
    Worker::PrepareProcess(process);
  }
  std::sort(f.rates.begin(), f.rates.end());  // capacities read them in ascending order

  LogLevel level;
  if (!ParseLogLevel(f.log_level, &level)) {
    std::fprintf(stderr, "bad --log-level\n");
    return 2;
  }
  SetLogLevel(level);
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "shoal_bench_fleet: %s\n", s.ToString().c_str());
    return 1;
  };
  const auto t_start = Clock::now();
  json results;
  results["machine"] = {{"nproc", std::thread::hardware_concurrency()}, {"loadavg_at_start", LoadAverage()}};
  results["settings"] = SettingsJson(f);
  std::printf("shoal_bench_fleet: %d models (1 in %d large), Zipf(%.2f), budget of %d models, %s\n", f.models,
              f.large_every, f.zipf_s, f.budget_models,
              f.rates.empty() ? (std::to_string(f.clients) + " closed-loop clients").c_str() : "open loop");
  std::printf("  %u cores, load average at start %s\n", std::thread::hardware_concurrency(), LoadAverage().c_str());

  char tmpl[] = "/tmp/shoal-bench-fleet-XXXXXX";
  if (!mkdtemp(tmpl)) return fail(Internal("mkdtemp failed"));
  const fs::path tmp = tmpl;
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{tmp};
  auto fleet = MakeFleet(f, tmp);
  if (!fleet.ok()) return fail(fleet.status());

  // The same draws for both phases.
  const auto weights = ZipfWeights(f.models, f.zipf_s);
  const auto draws = ZipfDraws(weights, f.requests, f.seed);
  const auto sentences = MakeSentences(1024, f.seed);
  const int budget_top = std::min(f.budget_models, f.models);
  const double top_mass = std::accumulate(weights.begin(), weights.begin() + budget_top, 0.0);
  double large_mass = 0;
  std::string large_ranks;
  for (int r = 0; r < f.models; ++r) {
    if (!fleet->large[r]) continue;
    large_mass += weights[r];
    large_ranks += (large_ranks.empty() ? "" : ",") + std::to_string(r);
  }
  std::printf("  top %d models hold %.1f%% of the Zipf mass (top 1: %.1f%%); large models (ranks %s) get %.1f%%\n",
              budget_top, 100 * top_mass, 100 * weights[0], large_ranks.c_str(), 100 * large_mass);
  results["zipf"] = {{"top_budget_models_mass", top_mass}, {"top1_mass", weights[0]}, {"large_models_mass", large_mass}};

  auto budget = ChooseBudget(f, *fleet, tmp / "footprints");
  if (!budget.ok()) return fail(budget.status());
  results["footprints"] = budget->footprints;
  auto ref = RunReference(f, *fleet, draws, sentences, tmp / "reference", &results["reference"]);
  if (!ref.ok()) return fail(ref.status());
  auto fl = RunFleet(f, *fleet, draws, sentences, budget->bytes, tmp / "fleet", &results["fleet"]);
  if (!fl.ok()) return fail(fl.status());
  if (f.rates.empty()) {
    const PhaseReport &r = ref->front(), &q = fl->front();
    PrintSummary(r, q, budget_top);
    results["fleet_over_reference"] = r.Rps() > 0 ? q.Rps() / r.Rps() : 0;
    results["fleet_over_reference_tokens"] = r.Tps() > 0 ? q.Tps() / r.Tps() : 0;
  } else {
    results["summary"] = PrintRateSummary(*ref, *fl, f);
  }
  const double total_s = Seconds(Clock::now() - t_start);
  std::printf("\ndone in %.0f s; load average %s\n", total_s, LoadAverage().c_str());
  results["machine"]["loadavg_at_end"] = LoadAverage();
  results["total_s"] = total_s;
  if (!f.json_out.empty()) {
    std::ofstream out(f.json_out);
    out << results.dump(2) << "\n";
    if (!out) return fail(Internal("cannot write " + f.json_out));
  }
  return 0;
}

}  // namespace
}  // namespace shoal::bench

int main(int argc, char** argv) { return shoal::bench::Main(argc, argv); }
