// FleetControl: operator actions on the fleet (load, unload, pin, unpin a
// model), sent as control requests to workers (shoal.ctl.<worker-id>) chosen
// from the registry. Requests run on the control's own threads, so HTTP
// threads never wait for a model to load.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "gateway/fleet_view.h"
#include "queue/nats_client.h"

namespace shoal {

// One worker's answer to a control request.
struct ControlResult {
  std::string worker;
  Status status;             // OK or the worker's error
  std::string status_json;   // the model's state on that worker when OK
};

struct ControlOutcome {
  std::string model;
  std::string action;
  std::vector<ControlResult> results;
};

using ControlCallback = std::function<void(Result<ControlOutcome>)>;

// What routes need; faked in route unit tests.
class ModelController {
 public:
  virtual ~ModelController() = default;
  // `action`: load | unload | pin | unpin. `worker`: empty for "wherever
  // the registry says". Completes `done` exactly once, from any thread.
  virtual void Act(const std::string& action, const std::string& model, const std::string& worker,
                   ControlCallback done) = 0;
};

struct FleetControlOptions {
  int threads = 2;
  int64_t load_timeout_ms = 300000;   // load and pin wait for the load
  int64_t timeout_ms = 30000;         // unload, unpin
  Status Validate() const;
};

using SnapshotFn = std::function<std::shared_ptr<const FleetSnapshot>()>;

class FleetControl final : public ModelController {
 public:
  // `client` must outlive it.
  static Result<std::unique_ptr<FleetControl>> Create(const FleetControlOptions& options, NatsClient* client,
                                                      SnapshotFn snapshot);
  ~FleetControl() override;
  void Act(const std::string& action, const std::string& model, const std::string& worker,
           ControlCallback done) override;
  // Answers every request, queued or under way, with 503 shutting_down
  // (those under way within about 100 ms) without waiting for the threads.
  // Idempotent.
  void BeginStop();
  // BeginStop(), then joins the threads. Idempotent.
  void Stop();

  // Which workers a request goes to, and the action each gets. Pure;
  // exposed for tests.
  struct Target {
    std::string worker;
    std::string action;
    // A load or pin that no worker has yet: the targets are alternatives,
    // best first; each is asked only if the one before had no room or did
    // not answer, and only the last one asked is reported.
    bool alternative = false;
  };
  // `busy`: actions this gateway has under way, per worker (a worker runs
  // one at a time): alternatives with fewer come first, so loads asked for
  // together spread over the workers instead of queueing on one.
  static Result<std::vector<Target>> Plan(const FleetSnapshot& snap, const std::string& action,
                                          const std::string& model, const std::string& worker,
                                          const std::map<std::string, int>& busy = {});

 private:
  struct Job {
    std::string action, model, worker;
    ControlCallback done;
    // The action's timeout runs from when it was asked for: time queued
    // behind other actions counts.
    std::chrono::steady_clock::time_point deadline;
  };
  FleetControl() = default;
  void Loop();
  // Answers queued jobs whose time is up (while every thread is busy with
  // a long load, nothing else would until one is free).
  void ExpireLoop();
  Result<ControlOutcome> Run(const Job& job);

  FleetControlOptions options_;
  NatsClient* client_ = nullptr;
  SnapshotFn snapshot_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;  // guarded by mu_
  std::map<std::string, int> busy_;  // guarded by mu_: actions under way per worker
  bool stop_ = false;     // guarded by mu_
  std::atomic<bool> cancel_{false};  // requests under way give up
  std::vector<std::thread> threads_;
  std::condition_variable expire_cv_;
  std::thread expirer_;
};

}  // namespace shoal
