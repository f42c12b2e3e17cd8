// HttpLoad: a lean asynchronous HTTP/1.1 load generator, used by `shoal
// bench` and the benchmarks in bench/. Closed loop: N keep-alive connections, each sends its next
// request as soon as the previous response arrives. Open loop: Poisson
// arrivals at a fixed rate onto a pool of keep-alive connections that grows
// when every connection is busy, latency measured from the scheduled arrival
// (no coordinated omission). Everything runs on a few Asio threads so the
// client takes as little CPU as possible from the server it measures.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace shoal::loadgen {

// Live counters of a running load, for a progress display. Every request
// counts, warm-up included. Latencies go into a fixed histogram (buckets 1%
// wide from 1 us to ~20 min), so memory and the cost of a snapshot do not
// grow with the run. Thread-safe: client threads record, any thread takes
// snapshots.
class LoadProgress {
 public:
  struct Snapshot {
    int64_t sent = 0;
    int64_t completed = 0;  // 200 answers
    int64_t errors = 0;     // any other answer or a failed connection
    double p50_ms = 0;      // over every completed request so far, within 1%
    double p99_ms = 0;
  };
  LoadProgress();
  void OnSent() { sent_.fetch_add(1, std::memory_order_relaxed); }
  void OnDone(bool ok, double latency_ms);
  Snapshot Take() const;

 private:
  std::atomic<int64_t> sent_{0};
  mutable std::mutex mu_;
  int64_t completed_ = 0;          // guarded by mu_
  int64_t errors_ = 0;             // guarded by mu_
  std::vector<int64_t> buckets_;  // guarded by mu_
};

struct LoadOptions {
  std::string host = "127.0.0.1";  // IP address or name (resolved once)
  int port = 0;
  // More servers of the same kind (host, port), e.g. several gateways:
  // connections are opened on each target in turn.
  std::vector<std::pair<std::string, int>> more_targets;
  // Complete raw HTTP requests (request line, headers, body), sent in turn
  // (each client thread starts at its own offset).
  std::vector<std::string> requests;
  // Optional, one per request: a small non-negative label (e.g. the index of
  // the request's model); results are also counted per tag.
  std::vector<int> request_tags;
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
  // When every request of the window failed, RunLoad returns Unavailable
  // (true) or a result that counts the failures (false).
  bool fail_when_all_failed = true;
  // Optional live counters; must outlive RunLoad.
  LoadProgress* progress = nullptr;
  // Optional per-request observers, called on a client thread (they must
  // not block for long): `on_request_sent` when request `i` (an index into
  // `requests`) is sent, returning any value; `on_request_done` with that
  // value when the request ends: its HTTP status (0: the connection
  // failed), its latency, and whether it counts in the measured window (the
  // rule of `completed`; `errors` also counts failed connects that carried
  // no request, which no observer sees). Every request that was sent ends
  // once, except those still in flight when RunLoad gives up on them (30 s
  // after the window): open-loop ones due in the window end then with
  // status kUnansweredStatus, the others not at all.
  std::function<uint64_t(size_t request)> on_request_sent;
  std::function<void(size_t request, uint64_t sent_value, int status, double latency_ms, bool in_window)>
      on_request_done;
};

// What the requests with one tag got, in the measured window.
struct TagCounts {
  int64_t completed = 0;
  int64_t errors = 0;
};

// The status under which an open-loop request due in the window and still
// unanswered 30 s after it is counted (errors_by_status, on_request_done).
inline constexpr int kUnansweredStatus = -1;

struct LoadResult {
  double window_s = 0;          // measured window length
  // 200 responses: closed loop, those that finished in the window; open
  // loop, those due in it (answered up to 30 s after it).
  int64_t completed = 0;
  // 200 responses that arrived inside the window, whenever due: the
  // throughput (open loop: under overload the server's rate, not the
  // offered one).
  int64_t answered_in_window = 0;
  // Closed loop: HTTP answers (any status) that came after the window, to
  // requests it had sent; counted nowhere else.
  int64_t answered_after_window = 0;
  int64_t errors = 0;           // non-200 responses or failed connections
  int64_t dropped = 0;          // open loop: arrivals with no free connection
  int64_t due = 0;              // open loop: arrivals in the window
  int64_t prompt_tokens = 0;    // sum of usage.prompt_tokens over `answered_in_window`
  int connections_used = 0;     // open loop: pool size reached
  double client_cpu_s = 0;      // CPU of the client threads in the window
  std::string first_error;
  std::vector<double> latencies_ms;  // of `completed`, sorted ascending
  // `errors` by HTTP status; 0 counts failed connections (connect, write or
  // read failed, or the answer was not HTTP), kUnansweredStatus open-loop
  // requests never answered.
  std::map<int, int64_t> errors_by_status;
  // Indexed by tag (size: largest tag + 1) when request_tags was given.
  std::vector<TagCounts> per_tag;

  double RequestsPerS() const { return window_s > 0 ? answered_in_window / window_s : 0; }
  double TokensPerS() const { return window_s > 0 ? prompt_tokens / window_s : 0; }
  // p in [0, 100]; 0 when there are no samples.
  double PercentileMs(double p) const;
};

// Runs one load phase (warm-up plus measured window) and blocks until every
// request in flight has finished (or 30 s after the window). Fails when the
// options are unusable, the host cannot be resolved, or (see
// fail_when_all_failed) every request failed.
Result<LoadResult> RunLoad(const LoadOptions& options);

// Raw HTTP/1.1 keep-alive POST with a JSON body. `extra_headers` are
// complete header lines, each ending in "\r\n" (e.g. "Authorization: Bearer
// KEY\r\n").
std::string JsonPostRequest(const std::string& host, const std::string& path, const std::string& body,
                            const std::string& extra_headers = {});

}  // namespace shoal::loadgen
