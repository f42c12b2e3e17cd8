// Per-worker utilisation from a Shoal gateway's GET /v1/workers, sampled
// about once a second by `shoal bench`: each worker reports busy_seconds
// (cumulative time its device slots spent running batches) and
// device_slots; utilisation over an interval is
// Δbusy_seconds / (Δt × device_slots). Pure computation, no I/O.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"

namespace shoal::loadgen {

struct WorkerBusy {
  std::string id;
  double busy_seconds = 0;
  int device_slots = 1;
  // When busy_seconds was measured (the worker's heartbeat, which a Shoal
  // gateway passes on every 2 s by default); 0: unknown, the sample's own
  // time stands in.
  int64_t heartbeat_unix_ms = 0;
};

// Parses {"object":"list","data":[{"id":..,"busy_seconds":..,
// "device_slots":..},...]}. Entries without an id or busy_seconds are
// skipped; a missing or non-positive device_slots counts as 1.
// InvalidArgument when the body is not JSON or has no "data" list.
Result<std::vector<WorkerBusy>> ParseWorkers(const std::string& body);

// Utilisation of each worker present in both samples, clamped to [0, 1],
// over the time between its two heartbeats where both samples carry one,
// else `dt_s` (the samples' distance). Workers whose busy_seconds went
// down (restarted) or whose heartbeat did not advance (nothing measured
// anew) are left out, as is everything else when dt_s <= 0.
std::map<std::string, double> Utilisation(const std::vector<WorkerBusy>& before, const std::vector<WorkerBusy>& after,
                                          double dt_s);

// Collects samples into one utilisation time series per worker. Not
// thread-safe: one sampling thread owns it.
class UtilisationTracker {
 public:
  struct Point {
    double t_s = 0;  // middle of the interval, seconds since the run began
    double utilisation = 0;
  };
  // `t_s`: when the sample was taken, seconds since the run began,
  // increasing from call to call. A worker's entry whose heartbeat has not
  // advanced since its last one is skipped: sampled more often than the
  // worker reports, its busy time would read as all or nothing.
  void Add(double t_s, std::vector<WorkerBusy> sample);
  const std::map<std::string, std::vector<Point>>& series() const { return series_; }
  // Mean utilisation per worker from its last entry at or before t0 (else
  // its first after) to its last at or before t1 (busy time over elapsed
  // time, not a mean of points); workers with no two such entries are left
  // out.
  std::map<std::string, double> MeanOver(double t0_s, double t1_s) const;

 private:
  struct Entry {
    double t_s;
    WorkerBusy busy;
  };
  std::map<std::string, std::vector<Entry>> entries_;  // per worker, each a new measurement
  std::map<std::string, std::vector<Point>> series_;
};

}  // namespace shoal::loadgen
