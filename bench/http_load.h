// HttpLoad: a lean asynchronous HTTP/1.1 load generator for the serving
// benchmark. Closed loop: N keep-alive connections, each sends its next
// request as soon as the previous response arrives. Open loop: Poisson
// arrivals at a fixed rate onto a pool of keep-alive connections that grows
// when every connection is busy, latency measured from the scheduled arrival
// (no coordinated omission). Everything runs on a few Asio threads so the
// client takes as little CPU as possible from the server it measures.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace shoal::bench {

struct LoadOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  // Complete raw HTTP requests (request line, headers, body), sent in turn.
  std::vector<std::string> requests;
  int connections = 64;        // closed loop: clients; open loop: initial pool
  int max_connections = 1024;  // open loop: arrivals beyond this are dropped
  double rate_per_s = 0;       // 0: closed loop; > 0: open loop at this rate
  double warmup_s = 2;         // not measured
  double duration_s = 10;      // measured window
  int threads = 1;             // closed loop only; open loop uses one
  uint64_t seed = 1;           // arrival times of the open loop
  // Called on a client thread when the measured window starts and ends
  // (e.g. to sample server-side counters). Must not block for long.
  std::function<void()> on_window_start;
  std::function<void()> on_window_end;
};

struct LoadResult {
  double window_s = 0;          // measured window length
  int64_t completed = 0;        // 200 responses that finished in the window
  int64_t errors = 0;           // non-200 responses or failed connections
  int64_t dropped = 0;          // open loop: arrivals with no free connection
  int64_t due = 0;              // open loop: arrivals in the window
  int64_t prompt_tokens = 0;    // sum of usage.prompt_tokens over `completed`
  int connections_used = 0;     // open loop: pool size reached
  double client_cpu_s = 0;      // CPU of the client threads in the window
  std::string first_error;
  std::vector<double> latencies_ms;  // of `completed`, sorted ascending

  double RequestsPerS() const { return window_s > 0 ? completed / window_s : 0; }
  double TokensPerS() const { return window_s > 0 ? prompt_tokens / window_s : 0; }
  // p in [0, 100]; 0 when there are no samples.
  double PercentileMs(double p) const;
};

// Runs one load phase (warm-up plus measured window) and blocks until every
// request in flight has finished (or 30 s after the window). Fails only when
// the options are unusable or no connection can be made.
Result<LoadResult> RunLoad(const LoadOptions& options);

// Raw HTTP/1.1 keep-alive POST with a JSON body.
std::string JsonPostRequest(const std::string& host, const std::string& path, const std::string& body);

}  // namespace shoal::bench
