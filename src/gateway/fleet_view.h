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
};

struct FleetSnapshot {
  bool nats_connected = false;
  bool stream_ok = false;
  uint64_t queue_depth = 0;
  std::vector<std::string> worker_json;  // heartbeat documents of live workers
  std::map<std::string, CatalogModel> models;
  int64_t refreshed_unix_ms = 0;
};

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
};

}  // namespace shoal
