#include "cli/bench_command.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "cli/internal/env_option.h"
#include "cli/internal/split.h"
#include "loadgen/http_load.h"
#include "loadgen/report.h"
#include "loadgen/utilisation.h"
#include "loadgen/workload.h"

namespace shoal {
namespace {

using cli::HttpClient;
using cli::SplitList;
using Clock = std::chrono::steady_clock;
namespace lg = loadgen;

constexpr const char* kUsage =
    "Load levels (choose one; default --closed 8):\n"
    "  --closed 8          8 concurrent clients, each sends its next request when its answer arrives\n"
    "  --closed 1,4,16     one measured phase per client count\n"
    "  --rate 200          open loop: Poisson arrivals at 200 requests/s (latency from the scheduled arrival)\n"
    "  --rates 50,100,200  one phase per rate\n"
    "  --sweep 50:500:10   10 evenly spaced rates from 50 to 500\n"
    "Workload: --models a,b,c (default: the embedding models GET /v1/models lists), --popularity uniform | zipf:1.1,\n"
    "  --input-words fixed:N | uniform:A:B | lognormal:MEAN:SIGMA, --batch N inputs per request.\n"
    "Plain http:// only (no TLS). Writes results.json, throughput.svg, latency.svg and, when the target\n"
    "answers GET /v1/workers (Shoal), utilisation.svg into --out.\n";

struct Phase {
  std::string mode;  // open | closed
  double rate = 0;
  int clients = 0;
  std::string Label() const {
    std::ostringstream o;
    if (mode == "open") {
      o << "rate " << rate << "/s";
    } else {
      o << clients << " client" << (clients == 1 ? "" : "s");
    }
    return o.str();
  }
};

std::optional<double> Number(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// Past this an arrival gap rounds to no time at all (one client process
// cannot offer it anyway).
constexpr double kMaxRate = 1e6;

bool IsRate(std::optional<double> v) { return v && *v > 0 && *v <= kMaxRate; }

Result<std::vector<double>> Rates(const std::string& list, const std::string& flag) {
  std::vector<double> out;
  for (const auto& item : SplitList(list, ',')) {
    auto v = Number(item);
    if (!IsRate(v))
      return InvalidArgument(flag + ": '" + item + "' is not a rate in (0, 1000000] requests/s");
    out.push_back(*v);
  }
  if (out.empty()) return InvalidArgument(flag + ": no rate given");
  return out;
}

Result<std::vector<Phase>> ParsePhases(const BenchCommandFlags& f) {
  const int given = !f.closed.empty() + !f.rate.empty() + !f.rates.empty() + !f.sweep.empty();
  if (given > 1) return InvalidArgument("choose one of --closed, --rate, --rates and --sweep");
  std::vector<Phase> out;
  if (!f.rate.empty() || !f.rates.empty()) {
    const bool single = !f.rate.empty();
    ASSIGN_OR_RETURN(auto rates, Rates(single ? f.rate : f.rates, single ? "--rate" : "--rates"));
    if (single && rates.size() != 1) return InvalidArgument("--rate takes one rate; use --rates for several");
    for (double r : rates) out.push_back({"open", r, 0});
    return out;
  }
  if (!f.sweep.empty()) {
    const auto parts = SplitList(f.sweep, ':');
    const std::string usage =
        "--sweep '" + f.sweep + "': use START:STOP:STEPS, rates in (0, 1000000], STEPS in [1, 1000] (e.g. 50:500:10)";
    if (parts.size() != 3) return InvalidArgument(usage);
    auto a = Number(parts[0]), b = Number(parts[1]), n = Number(parts[2]);
    if (!IsRate(a) || !IsRate(b) || !n || *n < 1 || *n != std::floor(*n) || *n > 1000) {
      return InvalidArgument(usage);
    }
    const int steps = static_cast<int>(*n);
    for (int i = 0; i < steps; ++i) {
      const double r = steps == 1 ? *a : *a + (*b - *a) * i / (steps - 1);
      out.push_back({"open", r, 0});
    }
    return out;
  }
  const std::string closed = f.closed.empty() ? "8" : f.closed;
  for (const auto& item : SplitList(closed, ',')) {
    auto v = Number(item);
    if (!v || *v < 1 || *v != std::floor(*v) || *v > 100000) {
      return InvalidArgument("--closed: '" + item + "' is not a client count (a whole number >= 1)");
    }
    out.push_back({"closed", 0, static_cast<int>(*v)});
  }
  return out;
}

int Usage(std::ostream& err, const std::string& problem) {
  err << "error: " << problem << "\n" << kUsage;
  return 2;
}

// Model ids from GET /v1/models (OpenAI shape: {"data":[{"id":..}]}).
Result<std::vector<std::string>> FetchModels(const HttpClient& client) {
  auto reply = client.Get("/v1/models");
  if (!reply.ok()) return reply.status();
  if (reply->status != 200) {
    return Unavailable("GET /v1/models answered HTTP " + std::to_string(reply->status) +
                       "; name the models with --models");
  }
  auto j = nlohmann::json::parse(reply->body, nullptr, false);
  std::vector<std::string> out;
  if (j.is_object() && j.contains("data") && j["data"].is_array()) {
    for (const auto& m : j["data"]) {
      if (!m.is_object() || !m.contains("id") || !m["id"].is_string() || m["id"].get<std::string>().empty())
        continue;
      // The requests are embeddings: a Shoal gateway says which models
      // are for something else (rerankers, classifiers, OCR, generators).
      if (m.contains("task") && m["task"].is_string() && m["task"] != "embed") continue;
      out.push_back(m["id"].get<std::string>());
    }
  }
  if (out.empty()) return Unavailable("GET /v1/models listed no embedding models; name them with --models");
  return out;
}

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Samples GET /v1/workers about once a second on its own thread while it
// lives, when the target answered it with a usable list at start.
class WorkerSampler {
 public:
  // Probes once; returns nullptr when the target has no such endpoint.
  static std::unique_ptr<WorkerSampler> Start(const HttpClient& client, std::string path, Clock::time_point t0) {
    if (path.empty() || path == "off") return nullptr;
    auto first = Sample(client, path);
    if (!first) return nullptr;
    std::unique_ptr<WorkerSampler> s(new WorkerSampler(client, std::move(path), t0));
    s->tracker_.Add(SecondsSince(t0), std::move(*first));
    s->thread_ = std::thread([p = s.get()] { p->Loop(); });
    return s;
  }
  ~WorkerSampler() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // Takes a last sample and stops; the tracker is then safe to read.
  const lg::UtilisationTracker& Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (auto s = Sample(client_, path_)) tracker_.Add(SecondsSince(t0_), std::move(*s));
    return tracker_;
  }

 private:
  WorkerSampler(const HttpClient& client, std::string path, Clock::time_point t0)
      : client_(client), path_(std::move(path)), t0_(t0) {}

  static std::optional<std::vector<lg::WorkerBusy>> Sample(const HttpClient& client, const std::string& path) {
    auto reply = client.Get(path);
    if (!reply.ok() || reply->status != 200) return std::nullopt;
    auto workers = lg::ParseWorkers(reply->body);
    if (!workers.ok()) return std::nullopt;
    return std::move(workers).value();
  }

  void Loop() {
    auto next = Clock::now();
    for (;;) {
      next += std::chrono::seconds(1);
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_until(lock, next, [this] { return stop_; })) return;
      }
      // A missed sample only widens the next interval.
      if (auto s = Sample(client_, path_)) tracker_.Add(SecondsSince(t0_), std::move(*s));
    }
  }

  HttpClient client_;
  std::string path_;
  Clock::time_point t0_;
  lg::UtilisationTracker tracker_;  // touched by the sampling thread until Finish()
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

// Prints one progress line a second while it lives.
class ProgressPrinter {
 public:
  ProgressPrinter(std::ostream& err, bool tty, std::string label, const lg::LoadProgress* progress, double warmup_s)
      : err_(err), tty_(tty), label_(std::move(label)), progress_(progress), warmup_s_(warmup_s),
        start_(Clock::now()), thread_([this] { Loop(); }) {}
  ~ProgressPrinter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (tty_ && printed_) err_ << "\n";
    err_.flush();
  }

 private:
  void Loop() {
    auto next = start_;
    lg::LoadProgress::Snapshot last;
    for (int second = 1;; ++second) {
      next += std::chrono::seconds(1);
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_until(lock, next, [this] { return stop_; })) return;
      }
      const auto s = progress_->Take();
      const double elapsed = SecondsSince(start_);
      char line[256];
      std::snprintf(line, sizeof line,
                    "[%s] %5.1fs %-8s sent %lld  done %lld  errors %lld  %.1f req/s  p50 %.1f ms  p99 %.1f ms",
                    // The line covers the second before it: named by that
                    // second's middle (the tick itself lands just after a
                    // warm-up that ends on a whole second).
                    label_.c_str(), elapsed, second - 0.5 < warmup_s_ ? "warm-up" : "measure",
                    static_cast<long long>(s.sent), static_cast<long long>(s.completed),
                    static_cast<long long>(s.errors), static_cast<double>(s.completed - last.completed), s.p50_ms,
                    s.p99_ms);
      err_ << (tty_ ? "\r\033[K" : "") << line << (tty_ ? "" : "\n");
      err_.flush();
      printed_ = true;
      last = s;
    }
  }

  std::ostream& err_;
  const bool tty_;
  const std::string label_;
  const lg::LoadProgress* progress_;
  const double warmup_s_;
  const Clock::time_point start_;
  bool printed_ = false;  // written by the thread, read after join
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string Join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

void PrintSummary(std::ostream& out, const lg::BenchReport& r) {
  char line[256];
  std::snprintf(line, sizeof line, "%-14s %10s %10s %9s %8s %8s %9s %9s %9s\n", "load", "req/s", "inputs/s", "sent",
                "errors", "dropped", "p50 ms", "p99 ms", "max ms");
  out << line;
  for (const auto& p : r.phases) {
    std::ostringstream load;
    if (p.mode == "open") {
      load << p.offered_rate << "/s";
    } else {
      load << p.clients << " clients";
    }
    std::snprintf(line, sizeof line, "%-14s %10.1f %10.1f %9lld %8lld %8lld %9.2f %9.2f %9.2f\n",
                  load.str().c_str(), p.requests_per_s, p.inputs_per_s, static_cast<long long>(p.sent),
                  static_cast<long long>(p.errors), static_cast<long long>(p.dropped), p.p50_ms, p.p99_ms, p.max_ms);
    out << line;
    if (!p.errors_by_status.empty()) {
      out << "  errors by status:";
      for (const auto& [status, n] : p.errors_by_status) out << " " << status << "=" << n;
      if (!p.first_error.empty()) out << "  (first: " << p.first_error.substr(0, 120) << ")";
      out << "\n";
    }
  }
}

}  // namespace

CLI::App* AddBenchCommand(CLI::App* app, BenchCommandFlags* f) {
  CLI::App* cmd = app->add_subcommand(
      "bench", "Load-test a Shoal gateway or any OpenAI-compatible /v1/embeddings endpoint; write JSON and SVG plots");
  auto opt = [cmd](const std::string& flag, auto& value, const std::string& env, const std::string& help) {
    return cli::EnvOption(cmd, flag, value, env, help);
  };
  opt("--url", f->url, "SHOAL_BENCH_URL",
      "Target base URL, http://host:port[/prefix] (plain HTTP only); several, comma-separated, spread the "
      "connections over several gateways of one cluster (same prefix; the first lists models and workers)");
  opt("--path", f->path, "SHOAL_BENCH_PATH", "Request path under the base URL");
  opt("--closed", f->closed, "SHOAL_BENCH_CLOSED", "Closed loop: concurrent clients, one phase per value (N or N1,N2,...)");
  opt("--rate", f->rate, "SHOAL_BENCH_RATE", "Open loop: Poisson arrivals at this many requests/s");
  opt("--rates", f->rates, "SHOAL_BENCH_RATES", "Open loop: one phase per rate (R1,R2,...)");
  opt("--sweep", f->sweep, "SHOAL_BENCH_SWEEP", "Open loop: START:STOP:STEPS evenly spaced rates");
  opt("--duration", f->duration_s, "SHOAL_BENCH_DURATION", "Measured seconds per phase");
  opt("--warmup", f->warmup_s, "SHOAL_BENCH_WARMUP", "Unmeasured seconds before each phase's window");
  opt("--models", f->models, "SHOAL_BENCH_MODELS",
      "Comma-separated models, most popular first (default: every embedding model GET /v1/models lists)");
  opt("--popularity", f->popularity, "SHOAL_BENCH_POPULARITY", "Model popularity: uniform or zipf:S (S > 0)");
  opt("--input-words", f->input_words, "SHOAL_BENCH_INPUT_WORDS",
      "Words per input: fixed:N, uniform:A:B or lognormal:MEAN:SIGMA");
  opt("--batch", f->batch, "SHOAL_BENCH_BATCH", "Inputs per request");
  opt("--out", f->out_dir, "SHOAL_BENCH_OUT", "Directory for results.json and the SVG plots");
  cmd->add_option("--api-key", f->api_key, "Bearer token sent as Authorization (default: OPENAI_API_KEY)")
      ->envname("SHOAL_BENCH_API_KEY");
  opt("--max-connections", f->max_connections, "SHOAL_BENCH_MAX_CONNECTIONS",
      "Open loop: most connections; arrivals beyond are counted as dropped");
  opt("--threads", f->threads, "SHOAL_BENCH_THREADS", "Closed loop: client threads");
  opt("--pool", f->pool, "SHOAL_BENCH_POOL", "Distinct requests built ahead of time and sent in turn");
  opt("--seed", f->seed, "SHOAL_BENCH_SEED", "Seed of the workload and of the arrival times");
  opt("--workers-path", f->workers_path, "SHOAL_BENCH_WORKERS_PATH",
      "Per-worker utilisation source, sampled each second when it answers (off: never)");
  cmd->add_flag("--quiet", f->quiet, "No live progress on stderr")->envname("SHOAL_BENCH_QUIET");
  cmd->footer(kUsage);
  return cmd;
}

int RunBenchCommand(const BenchCommandFlags& flags) {
  const int code = RunBenchCommand(flags, std::cout, std::cerr, ::isatty(STDERR_FILENO) == 1);
  std::cout.flush();
  return code;
}

int RunBenchCommand(const BenchCommandFlags& flags, std::ostream& out, std::ostream& err, bool err_is_tty) {
  // --- usage ----------------------------------------------------------------
  auto phases = ParsePhases(flags);
  if (!phases.ok()) return Usage(err, phases.status().message());
  auto popularity = lg::ParsePopularity(flags.popularity);
  if (!popularity.ok()) return Usage(err, "--popularity: " + popularity.status().message());
  auto lengths = lg::ParseLengthDistribution(flags.input_words);
  if (!lengths.ok()) return Usage(err, "--input-words: " + lengths.status().message());
  constexpr double kDayS = 86400;
  if (!(flags.duration_s > 0 && flags.duration_s <= kDayS))
    return Usage(err, "--duration must be > 0 and at most 86400 seconds");
  if (!(flags.warmup_s >= 0 && flags.warmup_s <= kDayS))
    return Usage(err, "--warmup must be >= 0 and at most 86400 seconds");
  if (flags.batch < 1) return Usage(err, "--batch must be >= 1");
  if (flags.pool < 1) return Usage(err, "--pool must be >= 1");
  // The pool is built before the first request: a size that cannot fit is
  // refused here, not found out by running out of memory.
  constexpr double kMaxPoolBytes = double{1} * (1 << 30);
  const double pool_bytes = static_cast<double>(flags.pool) * flags.batch *
                            (std::min<double>(lengths->Mean(), lg::LengthDistribution::kMaxWords) * 7 + 4);
  if (pool_bytes > kMaxPoolBytes) {
    return Usage(err, "--pool x --batch x --input-words would build about " +
                          std::to_string(static_cast<int64_t>(pool_bytes / (1 << 20))) +
                          " MiB of requests ahead of time (at most 1024); lower --pool");
  }
  constexpr int kMaxThreads = 256;
  if (flags.threads < 1 || flags.threads > kMaxThreads) return Usage(err, "--threads must be in [1, 256]");
  if (flags.max_connections < 1) return Usage(err, "--max-connections must be >= 1");
  if (flags.path.empty() || flags.path.front() != '/') return Usage(err, "--path must start with '/'");
  const std::vector<std::string> urls = SplitList(flags.url, ',');
  if (urls.empty() || urls.front().empty()) return Usage(err, "--url is required");
  auto client = HttpClient::Create(urls.front(), std::chrono::milliseconds(10000));
  if (!client.ok()) return Usage(err, "--url: " + client.status().message());
  std::vector<std::pair<std::string, int>> more_targets;
  for (size_t i = 1; i < urls.size(); ++i) {
    auto u = cli::ParseHttpUrl(urls[i]);
    if (!u.ok()) return Usage(err, "--url: " + u.status().message());
    if (u->prefix != client->url().prefix) return Usage(err, "--url: every URL must have the same path prefix");
    more_targets.emplace_back(u->host, u->port);
  }
  std::string api_key = flags.api_key;
  if (api_key.empty()) {
    if (const char* k = std::getenv("OPENAI_API_KEY"); k && *k) api_key = k;
  }
  if (api_key.find_first_of("\r\n") != std::string::npos) return Usage(err, "--api-key contains a line break");
  if (!api_key.empty()) client->SetHeader("Authorization", "Bearer " + api_key);
  std::vector<std::string> models = cli::SplitNonEmpty(flags.models, ',');

  if (Status s = lg::PrepareReportDir(flags.out_dir); !s.ok()) {
    err << "error: " << s.message() << "\n";
    return 1;
  }

  // --- target -----------------------------------------------------------------
  const cli::HttpUrl& url = client->url();
  if (models.empty()) {
    auto fetched = FetchModels(*client);
    if (!fetched.ok()) {
      err << "error: cannot list the models of " << url.ToString() << ": " << fetched.status().message() << "\n";
      return 1;
    }
    models = std::move(fetched).value();
  }
  lg::WorkloadOptions wo;
  wo.models = models;
  wo.popularity = *popularity;
  wo.lengths = *lengths;
  wo.inputs_per_request = flags.batch;
  const std::string host = url.host.find(':') != std::string::npos ? "[" + url.host + "]" : url.host;
  wo.host_header = host + ":" + std::to_string(url.port);
  wo.path = url.prefix + flags.path;
  wo.api_key = api_key;
  wo.pool_size = flags.pool;
  wo.seed = flags.seed;
  auto workload = lg::BuildWorkload(wo);
  if (!workload.ok()) return Usage(err, workload.status().message());

  lg::BenchReport report;
  report.target = urls.size() > 1 ? flags.url : url.ToString();
  report.path = flags.path;
  report.started_utc = UtcNow();
  report.settings = {
      {"models", Join(models)},
      {"popularity", popularity->ToString()},
      {"input_words", lengths->ToString()},
      {"batch", std::to_string(flags.batch)},
      {"duration_s", std::to_string(flags.duration_s)},
      {"warmup_s", std::to_string(flags.warmup_s)},
      {"pool", std::to_string(flags.pool)},
      {"seed", std::to_string(flags.seed)},
      {"authorization", api_key.empty() ? "none" : "bearer (redacted)"},
  };

  const Clock::time_point t0 = Clock::now();
  auto sampler = WorkerSampler::Start(*client, flags.workers_path, t0);
  err << "shoal bench: " << report.target << flags.path << ", " << models.size() << " model(s), "
      << popularity->ToString() << ", " << lengths->ToString() << " words x " << flags.batch << " per request, "
      << phases->size() << " phase(s) of " << flags.warmup_s << " s warm-up + " << flags.duration_s << " s"
      << (sampler ? "; sampling per-worker utilisation" : "; no per-worker utilisation (no " + flags.workers_path + ")")
      << "\n";

  // --- phases -------------------------------------------------------------------
  bool any_answer = false;
  bool any_ok = false;  // some request was answered 200
  bool any_late_answer = false;  // closed loop: answered, but after the window
  bool failed = false;           // a phase could not run
  for (const Phase& phase : *phases) {
    lg::LoadOptions lo;
    lo.host = url.host;
    lo.port = url.port;
    lo.more_targets = more_targets;
    lo.requests = workload->requests;
    lo.request_tags = workload->tags;
    lo.warmup_s = flags.warmup_s;
    lo.duration_s = flags.duration_s;
    lo.max_connections = flags.max_connections;
    lo.seed = flags.seed;
    lo.fail_when_all_failed = false;
    if (phase.mode == "open") {
      lo.rate_per_s = phase.rate;
      lo.connections = std::min(flags.max_connections, std::max(1, static_cast<int>(std::ceil(phase.rate / 50))));
    } else {
      lo.connections = phase.clients;
      lo.threads = flags.threads;
    }
    lg::LoadProgress progress;
    lo.progress = &progress;
    const double phase_start = SecondsSince(t0);
    Result<lg::LoadResult> result = InvalidArgument("not run");
    {
      std::optional<ProgressPrinter> printer;
      if (!flags.quiet) printer.emplace(err, err_is_tty, phase.Label(), &progress, flags.warmup_s);
      try {
        result = lg::RunLoad(lo);
      } catch (const std::exception& e) {  // out of threads or descriptors for this many clients
        result = Unavailable(std::string("cannot run the phase: ") + e.what());
      }
    }
    if (!result.ok()) {
      // The phases done so far are still written.
      err << "error: " << phase.Label() << ": " << result.status().message() << "\n";
      failed = true;
      break;
    }
    if (result->answered_after_window > 0) any_late_answer = true;
    lg::PhaseReport p = lg::SummarizePhase(phase.mode, phase.rate, phase.clients, *result, models, flags.batch);
    p.start_s = phase_start + flags.warmup_s;
    p.end_s = p.start_s + flags.duration_s;
    // An HTTP answer of any status; failed connections and open-loop
    // requests never answered are none.
    if (p.completed > 0 ||
        p.errors_by_status.size() > p.errors_by_status.count("transport") + p.errors_by_status.count("unanswered"))
      any_answer = true;
    if (p.completed > 0) any_ok = true;
    report.phases.push_back(std::move(p));
  }

  if (sampler) {
    const lg::UtilisationTracker& tracker = sampler->Finish();
    report.utilisation_available = true;
    report.utilisation = tracker.series();
    for (auto& p : report.phases) p.mean_utilisation = tracker.MeanOver(p.start_s, p.end_s);
  }

  PrintSummary(out, report);
  std::vector<std::string> written;
  if (Status s = lg::WriteReport(report, flags.out_dir, &written); !s.ok()) {
    err << "error: " << s.message() << "\n";
    return 1;
  }
  out << "wrote";
  for (const auto& w : written) out << " " << w;
  out << "\n";
  if (failed) return 1;
  if (!any_answer && any_late_answer) {
    err << "error: no answer from " << report.target
        << " came inside a measured window; answers came after it (lengthen --duration)\n";
    return 1;
  }
  if (!any_answer) {
    err << "error: no request got an HTTP answer from " << report.target << " (is it running?)\n";
    return 1;
  }
  if (!any_ok) {
    // Nothing was measured but errors (a wrong model name, a wrong route).
    err << "error: every request to " << report.target << " failed (see the errors by status above)\n";
    return 1;
  }
  return 0;
}

}  // namespace shoal
