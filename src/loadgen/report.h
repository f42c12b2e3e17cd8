// Report: the results of a `shoal bench` run as JSON (results.json) and as
// self-contained SVG plots drawn with plain string code: throughput against
// offered load, p50/p99 latency against load, per-worker utilisation over
// time.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "loadgen/http_load.h"
#include "loadgen/utilisation.h"

namespace shoal::loadgen {

// One measured load level.
struct PhaseReport {
  std::string mode;          // "open" (Poisson arrivals) or "closed" (clients)
  double offered_rate = 0;   // open: requests/s asked for
  int clients = 0;           // closed: concurrent clients
  double start_s = 0;        // measured window, seconds since the run began
  double end_s = 0;
  double window_s = 0;
  int64_t sent = 0;          // open: arrivals due in the window; closed: answered + failed
  int64_t completed = 0;     // 200 answers
  int64_t errors = 0;
  int64_t dropped = 0;       // open: arrivals with no free connection
  std::map<std::string, int64_t> errors_by_status;  // "429", "503", "transport"
  double requests_per_s = 0;
  double inputs_per_s = 0;
  double prompt_tokens_per_s = 0;  // from usage.prompt_tokens, 0 when absent
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0, mean_ms = 0;
  struct ModelCounts {
    std::string model;
    int64_t completed = 0;
    int64_t errors = 0;
  };
  std::vector<ModelCounts> per_model;
  std::map<std::string, double> mean_utilisation;  // per worker, over the window
  std::string first_error;

  // The x value of the load plots: offered rate, or clients.
  double Load() const { return mode == "open" ? offered_rate : clients; }
};

// Fills a phase from one RunLoad result. `models` names the tags;
// `inputs_per_request` turns requests into inputs.
PhaseReport SummarizePhase(const std::string& mode, double offered_rate, int clients, const LoadResult& result,
                           const std::vector<std::string>& models, int inputs_per_request);

struct BenchReport {
  std::string target;       // base URL
  std::string path;         // request path
  std::string started_utc;  // ISO 8601
  std::map<std::string, std::string> settings;  // the options, as text (no secrets)
  std::vector<PhaseReport> phases;
  bool utilisation_available = false;  // the target answered GET /v1/workers
  std::map<std::string, std::vector<UtilisationTracker::Point>> utilisation;
};

std::string ReportJson(const BenchReport& report);
std::string ThroughputSvg(const BenchReport& report);
std::string LatencySvg(const BenchReport& report);
// Empty when there is no utilisation data.
std::string UtilisationSvg(const BenchReport& report);

// Creates `dir` and checks that a file can be written into it, so a bad
// --out fails before the load runs rather than after.
Status PrepareReportDir(const std::string& dir);
// Writes results.json, throughput.svg, latency.svg and (when available;
// else an earlier one is removed) utilisation.svg into `dir`, creating it.
// Appends the paths written.
Status WriteReport(const BenchReport& report, const std::string& dir, std::vector<std::string>* written);

}  // namespace shoal::loadgen
