#include "gateway/fleet_view.h"

#include <algorithm>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "common/json_text.h"
#include "common/log.h"
#include "wire/work_message.h"

namespace shoal {
namespace {

// `j[key]` as a T; `fallback` when it is absent, null, of another type or,
// for a whole number, not one or out of T's range (an entry written by
// another version of Shoal is read as far as it can be, not dropped whole;
// a negative backlog is not read as 2^64 - 1).
template <typename T>
T Field(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.is_object()) return fallback;
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return IntegerAs<T>(*it).value_or(fallback);
  } else {
    try {
      return it->get<T>();
    } catch (const nlohmann::json::exception&) {
      return fallback;
    }
  }
}

// A model state as workers write it; anything else (absent, another type,
// an unknown word) is "not_loaded", never taken as "loaded".
std::string ModelStateField(const nlohmann::json& m) {
  std::string s = Field<std::string>(m, "state", "");
  return s == "loaded" || s == "loading" || s == "failed" ? s : "not_loaded";
}

}  // namespace

bool ParseWorkerHeartbeat(const std::string& json_text, WorkerInfo* out) {
  try {
    auto j = nlohmann::json::parse(json_text);
    out->id = Field<std::string>(j, "id", "");
    out->memory_used_bytes = Field<int64_t>(j, "memory_used_bytes", 0);
    out->memory_budget_bytes = Field<int64_t>(j, "memory_budget_bytes", 0);
    out->host_memory_used_bytes = Field<int64_t>(j, "host_memory_used_bytes", 0);
    out->host_memory_budget_bytes = Field<int64_t>(j, "host_memory_budget_bytes", 0);
    out->max_models = Field<int>(j, "max_models", 0);
    out->host = Field<std::string>(j, "host", "");
    out->device_slots = std::max(1, Field<int>(j, "device_slots", 1));
    out->device = Field<std::string>(j, "device", "cpu");
    out->busy_seconds = Field<double>(j, "busy_seconds", 0.0);
    out->heartbeat_unix_ms = Field<int64_t>(j, "heartbeat_unix_ms", 0);
    out->started_unix_ms = Field<int64_t>(j, "started_unix_ms", 0);
    for (const auto& m : Field<nlohmann::json>(j, "models", nlohmann::json::array())) {
      const std::string name = Field<std::string>(m, "name", "");
      if (name.empty()) continue;
      WorkerModel wm;
      wm.state = ModelStateField(m);
      wm.pinned = Field<bool>(m, "pinned", false);
      wm.memory_bytes = Field<int64_t>(m, "memory_bytes", 0);
      wm.measured_bytes = Field<int64_t>(m, "measured_bytes", 0);
      wm.last_used_unix_ms = Field<int64_t>(m, "last_used_unix_ms", 0);
      wm.error = Field<std::string>(m, "error", "");
      wm.backlog = Field<uint64_t>(m, "backlog", 0);
      out->models[name] = std::move(wm);
    }
    return !out->id.empty();
  } catch (const std::exception&) {
    return false;
  }
}

Result<std::unique_ptr<FleetView>> FleetView::Create(const FleetViewOptions& options, NatsClient* client,
                                                     MetricsRegistry* metrics) {
  auto f = std::unique_ptr<FleetView>(new FleetView());
  f->options_ = options;
  f->client_ = client;
  f->snapshot_ = std::make_shared<FleetSnapshot>();
  f->Refresh();
  auto* depth = metrics->GetGauge("shoal_queue_depth", "Messages waiting in the work stream.");
  auto* workers = metrics->GetGauge("shoal_workers_alive", "Workers with a live heartbeat.");
  f->hook_->view = f.get();
  metrics->AddRefresher([hook = f->hook_, depth, workers] {
    std::lock_guard<std::mutex> lock(hook->mu);
    if (hook->view == nullptr) return;  // the gauges keep their last values
    auto s = hook->view->Snapshot();
    depth->Set(static_cast<double>(s->queue_depth));
    workers->Set(static_cast<double>(s->worker_json.size()));
  });
  f->thread_ = std::thread([p = f.get()] { p->Loop(); });
  return f;
}

FleetView::~FleetView() {
  {
    std::lock_guard<std::mutex> lock(hook_->mu);
    hook_->view = nullptr;
  }
  Stop();
}

void FleetView::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<const FleetSnapshot> FleetView::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_;
}

void FleetView::Refresh() {
  std::lock_guard<std::mutex> guard(refresh_mu_);
  const std::shared_ptr<const FleetSnapshot> last = Snapshot();
  auto s = std::make_shared<FleetSnapshot>();
  bool catalog_read = false;
  bool workers_read = false;
  s->nats_connected = client_->IsConnected();
  // Unread (disconnected, a JetStream timeout), the depth stays the last one
  // read: a drop to 0 would look like a drained queue in an outage.
  s->queue_depth = last->queue_depth;
  if (s->nats_connected) {
    auto st = GetStreamState(*client_, options_.stream);
    s->stream_ok = st.ok();
    if (st.ok()) s->queue_depth = st->msgs;
    // Buckets appear when the first worker starts; bind lazily.
    if (!workers_kv_) {
      auto kv = KvBucket::Bind(*client_, wire::kWorkersBucket);
      if (kv.ok()) workers_kv_ = std::move(kv).value();
    }
    if (!models_kv_) {
      auto kv = KvBucket::Bind(*client_, wire::kModelsBucket);
      if (kv.ok()) models_kv_ = std::move(kv).value();
    }
    if (workers_kv_) {
      auto entries = workers_kv_->Entries();
      workers_read = entries.ok();
      if (entries.ok())
        for (auto& [k, v] : *entries) {
          WorkerInfo info;
          if (ParseWorkerHeartbeat(v, &info)) {
            s->workers.push_back(std::move(info));
            s->worker_json.push_back(std::move(v));
          } else {
            LOG_WARN("gateway", "unreadable heartbeat " << k);
          }
        }
    }
    if (models_kv_) {
      // All or nothing: unreadable for now (a timeout, the connection
      // lost), the last catalog stands.
      auto entries = models_kv_->Entries();
      catalog_read = entries.ok();
      if (entries.ok())
        for (auto& [k, v] : *entries) {
          try {
            auto j = nlohmann::json::parse(v);
            CatalogModel m;
            m.name = Field<std::string>(j, "name", "");
            m.task = Field<std::string>(j, "task", "embed");
            m.dim = Field<int>(j, "dim", 0);
            m.max_seq_len = Field<int>(j, "max_seq_len", 0);
            m.normalize = Field<bool>(j, "normalize", true);
            m.labels = Field<std::vector<std::string>>(j, "labels", {});
            m.runtime = Field<std::string>(j, "runtime", "torchscript");
            m.config_json = v;
            if (!m.name.empty()) s->models[m.name] = std::move(m);
          } catch (const std::exception& e) {
            LOG_WARN("gateway", "bad catalog entry " << k << ": " << e.what());
          }
        }
    }
  }
  // The catalog changes only when a model is added; while it cannot be read
  // (NATS down or slow), the last one read stands, so requests fail as the
  // queue's unavailability (503), not as models that do not exist (404).
  if (!catalog_read) s->models = last->models;
  // Likewise the workers, while connected: a registry read that failed
  // (a JetStream timeout) would otherwise hide live workers and their
  // models for a refresh (an unload planned on that view reaches nobody).
  if (s->nats_connected && workers_kv_ && !workers_read) {
    s->workers = last->workers;
    s->worker_json = last->worker_json;
  }
  s->refreshed_unix_ms = SystemClock::Get()->NowUnixMs();
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_ = std::move(s);
}

void FleetView::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(options_.refresh_interval_ms));
    if (stop_) break;
    lock.unlock();
    Refresh();
    lock.lock();
  }
}

}  // namespace shoal
