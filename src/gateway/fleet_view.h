// FleetView: the gateway's cached picture of the cluster, refreshed in the
// background from NATS: is the connection up, does the work stream exist,
// how deep is the queue, which workers are alive (SHOAL_WORKERS heartbeats)
// and which models exist (SHOAL_MODELS catalog). Readers never block on NATS.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "queue/nats_client.h"

namespace shoal {

struct CatalogModel {
  std::string name;
  std::string task;
  int dim = 0;
  int max_seq_len = 0;
  bool normalize = true;
  std::string config_json;  // as registered
  std::vector<std::string> labels;  // classify: output column names
  std::string runtime = "torchscript";
};

// One model as one worker's heartbeat reports it.
struct WorkerModel {
  std::string state;  // loaded | loading | failed | not_loaded
  bool pinned = false;
  int64_t memory_bytes = 0;
  int64_t measured_bytes = 0;  // at its last load there, kept after an unload
  int64_t last_used_unix_ms = 0;
  std::string error;
  uint64_t backlog = 0;
};

// A live worker, from its heartbeat.
struct WorkerInfo {
  std::string id;
  int64_t memory_used_bytes = 0;
  int64_t memory_budget_bytes = 0;  // 0: unlimited
  // A GPU worker's models in host memory (runtimes other than TorchScript).
  int64_t host_memory_used_bytes = 0;
  int64_t host_memory_budget_bytes = 0;  // 0: unlimited
  int max_models = 0;
  std::string host;
  int device_slots = 1;
  std::string device = "cpu";  // where its TorchScript models run ("cpu", "cuda:N")
  // Cumulative seconds its device slots spent running forward passes, as
  // of its last heartbeat (monotonically increasing while it lives).
  double busy_seconds = 0;
  int64_t heartbeat_unix_ms = 0;
  int64_t started_unix_ms = 0;
  std::map<std::string, WorkerModel> models;  // its whole catalog, by name
  // Whether some live worker has `model` in this state.
  bool Has(const std::string& model, const std::string& state) const {
    auto it = models.find(model);
    return it != models.end() && it->second.state == state;
  }
};

struct FleetSnapshot {
  bool nats_connected = false;
  bool stream_ok = false;
  uint64_t queue_depth = 0;
  std::vector<std::string> worker_json;  // heartbeat documents of live workers
  std::vector<WorkerInfo> workers;       // the same, parsed
  std::map<std::string, CatalogModel> models;
  int64_t refreshed_unix_ms = 0;
  // Whether any live worker reports `model` in `state`.
  bool AnyWorker(const std::string& model, const std::string& state) const {
    for (const auto& w : workers)
      if (w.Has(model, state)) return true;
    return false;
  }
};

// Parses one heartbeat document; false when it is unreadable.
bool ParseWorkerHeartbeat(const std::string& json_text, WorkerInfo* out);

struct FleetViewOptions {
  int64_t refresh_interval_ms = 1000;
  std::string stream = "SHOAL_WORK";
};

class FleetView {
 public:
  static Result<std::unique_ptr<FleetView>> Create(const FleetViewOptions& options, NatsClient* client,
                                                   MetricsRegistry* metrics);
  ~FleetView();
  std::shared_ptr<const FleetSnapshot> Snapshot() const;
  // Refreshes now (blocking on NATS); the background thread calls it too.
  void Refresh();
  void Stop();

 private:
  FleetView() = default;
  void Loop();

  FleetViewOptions options_;
  NatsClient* client_ = nullptr;
  std::unique_ptr<KvBucket> workers_kv_;
  std::unique_ptr<KvBucket> models_kv_;
  mutable std::mutex mu_;  // guards snapshot_, stop_
  std::shared_ptr<const FleetSnapshot> snapshot_;
  bool stop_ = false;
  std::condition_variable cv_;
  std::thread thread_;
  std::mutex refresh_mu_;  // one refresh at a time
  // What the metrics registry's refresher reaches this view by: the
  // registry may outlive the view (shoal serve's worker shares it, a failed
  // gateway start drops the view), so the destructor clears `view`.
  struct MetricsHook {
    std::mutex mu;
    FleetView* view = nullptr;  // guarded by mu
  };
  std::shared_ptr<MetricsHook> hook_ = std::make_shared<MetricsHook>();
};

}  // namespace shoal
