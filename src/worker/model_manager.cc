#include "worker/model_manager.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <filesystem>
#include <limits>
#include <set>
#include <system_error>
#include <utility>

#include "common/log.h"

namespace shoal {
namespace {

// Waiters re-read the injected clock at least this often, so a deadline on a
// clock that is not wall time (FakeClock) is still noticed.
constexpr int64_t kWaitSliceUs = 20'000;

Status NoRoom(const std::string& msg) { return ResourceExhausted(msg, "no_room_for_model"); }

}  // namespace

std::string_view ModelStateName(ModelState state) {
  switch (state) {
    case ModelState::kNotLoaded: return "not_loaded";
    case ModelState::kLoading: return "loading";
    case ModelState::kLoaded: return "loaded";
    case ModelState::kFailed: return "failed";
  }
  return "unknown";
}

std::string_view EvictionPolicyName(EvictionPolicy p) { return p == EvictionPolicy::kGdsf ? "gdsf" : "lru"; }

Result<EvictionPolicy> ParseEvictionPolicy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "gdsf") return EvictionPolicy::kGdsf;
  return InvalidArgument("eviction policy must be 'lru' or 'gdsf', not '" + std::string(name) + "'");
}

Status ModelManagerOptions::Validate() const {
  if (memory_budget_bytes < 0) return InvalidArgument("memory_budget_bytes must be >= 0");
  if (host_memory_budget_bytes < 0) return InvalidArgument("host_memory_budget_bytes must be >= 0");
  if (host_memory_budget_bytes > 0 && !in_host_memory)
    return InvalidArgument("a host memory budget needs in_host_memory (a GPU worker's models in host memory)");
  if (max_models < 0) return InvalidArgument("max_models must be >= 0");
  if (!(file_size_factor > 0)) return InvalidArgument("file_size_factor must be > 0");
  if (retry_failed_after_us < 0) return InvalidArgument("retry_failed_after_us must be >= 0");
  if (load_threads < 1) return InvalidArgument("load_threads must be >= 1");
  std::set<std::string> seen;
  for (const std::string& name : pinned) {
    if (name.empty()) return InvalidArgument("pinned model name is empty");
    if (!seen.insert(name).second) return InvalidArgument("model '" + name + "' is pinned twice");
  }
  if (max_models > 0 && static_cast<int>(pinned.size()) > max_models) {
    return InvalidArgument("more pinned models (" + std::to_string(pinned.size()) +
                           ") than max_models (" + std::to_string(max_models) + ")");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------

struct ModelManager::LoadAttempt {
  bool done = false;  // guarded by mu_
  Status status;      // guarded by mu_
};

struct ModelManager::Entry {
  ModelConfig config;
  int64_t file_estimate_bytes = 0;  // model file size x factor, fixed
  int pool = 0;                     // kDevicePool or kHostPool, fixed
  ModelState state = ModelState::kNotLoaded;
  bool pinned = false;  // never evicted: pin_kept, or a Pin waiting
  bool pin_kept = false;  // pinned at Start, or by a Pin that succeeded and no Unpin since
  int pins_waiting = 0;   // Pin calls waiting for the load
  std::unique_ptr<LoadedModel> model;  // set iff kLoaded
  int64_t measured_bytes = 0;          // last measured footprint; 0: never loaded
  int64_t reserved_bytes = 0;          // while kLoading
  uint64_t last_use_seq = 0;
  int64_t last_used_unix_ms = 0;
  // EvictionPolicy::kGdsf: uses since the last load, that load's seconds,
  // and the priority set at the last use.
  double uses = 0;
  double load_seconds_last = 0;
  double gdsf_priority = 0;
  int leases = 0;
  Status error;                        // while kFailed
  int64_t failed_mono_us = 0;
  std::shared_ptr<LoadAttempt> attempt;  // the current or last load
  bool preloading = false;               // Preload() waits on this load

  Counter* loads_ok = nullptr;
  Counter* loads_failed = nullptr;
  Histogram* load_seconds = nullptr;
  Counter* evictions = nullptr;
  Gauge* memory = nullptr;
  Counter* load_waits = nullptr;
  Histogram* load_wait_seconds = nullptr;
};

struct ModelManager::Job {
  Entry* entry = nullptr;
  std::shared_ptr<LoadAttempt> attempt;
  std::vector<std::unique_ptr<LoadedModel>> victims;  // unloaded before the load
  // What the victims hold beyond the new model's reservation, accounted as
  // unloading until they are gone.
  PoolBytes excess_bytes{};
  int excess_count = 0;
};

// ---------------------------------------------------------------------------

ModelLease::ModelLease(ModelLease&& other) noexcept
    : manager_(std::exchange(other.manager_, nullptr)),
      entry_(std::exchange(other.entry_, nullptr)),
      model_(std::exchange(other.model_, nullptr)) {}

ModelLease& ModelLease::operator=(ModelLease&& other) noexcept {
  if (this != &other) {
    Release();
    manager_ = std::exchange(other.manager_, nullptr);
    entry_ = std::exchange(other.entry_, nullptr);
    model_ = std::exchange(other.model_, nullptr);
  }
  return *this;
}

void ModelLease::Release() {
  if (manager_ != nullptr) manager_->ReleaseLease(entry_);
  manager_ = nullptr;
  entry_ = nullptr;
  model_ = nullptr;
}

// ---------------------------------------------------------------------------

ModelManager::ModelManager(ModelManagerOptions options, std::vector<ModelConfig> catalog,
                           ModelLoader loader, const Clock* clock, MetricsRegistry* metrics)
    : options_(std::move(options)),
      loader_(std::move(loader)),
      clock_(clock != nullptr ? clock : SystemClock::Get()) {
  if (metrics == nullptr) {
    own_metrics_ = std::make_unique<MetricsRegistry>();
    metrics = own_metrics_.get();
  }
  metrics_ = metrics;
  models_loaded_ = metrics_->GetGauge("shoal_worker_models_loaded", "Models resident on this worker.");
  for (ModelConfig& config : catalog) {
    if (entries_.count(config.name) != 0) {
      duplicate_names_.push_back(config.name);
      continue;
    }
    auto e = std::make_unique<Entry>();
    std::error_code ec;
    const auto file_bytes = std::filesystem::file_size(config.ModelPath(), ec);
    if (!ec) {
      e->file_estimate_bytes =
          static_cast<int64_t>(static_cast<double>(file_bytes) * options_.file_size_factor);
    }
    e->pool = options_.in_host_memory && options_.in_host_memory(config) ? kHostPool : kDevicePool;
    const Labels l = {{"model", config.name}};
    e->loads_ok = metrics_->GetCounter("shoal_worker_model_loads_total", "Model loads, by result.",
                                       {{"model", config.name}, {"result", "ok"}});
    e->loads_failed = metrics_->GetCounter("shoal_worker_model_loads_total",
                                           "Model loads, by result.",
                                           {{"model", config.name}, {"result", "error"}});
    e->load_seconds = metrics_->GetHistogram("shoal_worker_model_load_seconds",
                                             "Time to load a model.", l, LatencyBuckets());
    e->evictions = metrics_->GetCounter("shoal_worker_model_evictions_total",
                                        "Models unloaded to make room for another.", l);
    e->memory = metrics_->GetGauge("shoal_worker_model_memory_bytes",
                                   "Measured footprint of a resident model.", l);
    e->load_wait_seconds = metrics_->GetHistogram("shoal_worker_load_wait_seconds",
                                                  "How long requests waited for a model to load.", l,
                                                  LatencyBuckets());
    e->load_waits = metrics_->GetCounter("shoal_worker_load_waits_total",
                                         "Requests that waited for a model to load.", l);
    e->config = std::move(config);
    std::string name = e->config.name;
    entries_.emplace(std::move(name), std::move(e));
  }
  const int threads = std::max(1, options_.load_threads);
  for (int i = 0; i < threads; ++i) loader_threads_.emplace_back([this] { LoaderLoop(); });
}

ModelManager::~ModelManager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : loader_threads_) t.join();

  std::vector<std::unique_ptr<LoadedModel>> victims;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] {
      for (const auto& [name, e] : entries_) {
        if (e->leases > 0) return false;
      }
      return true;
    });
    for (auto& [name, e] : entries_) {
      if (e->state == ModelState::kLoaded) EvictLocked(*e, &victims, /*automatic=*/false);
    }
  }
  UnloadVictims(std::move(victims), {}, 0);
}

Status ModelManager::Start() {
  RETURN_IF_ERROR(options_.Validate());
  if (!duplicate_names_.empty()) {
    return InvalidArgument("model '" + duplicate_names_.front() + "' is in the catalog twice");
  }
  for (const std::string& name : options_.pinned) {
    if (Find(name) == nullptr) {
      return NotFound("pinned model '" + name + "' is not in the catalog", "model_not_found");
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (const std::string& name : options_.pinned) Find(name)->pinned = Find(name)->pin_kept = true;
  for (const std::string& name : options_.pinned) {
    Entry& e = *Find(name);
    Status s = WaitLoadedLocked(lock, e, kNoDeadline, /*retry_failed=*/true, /*count_wait=*/false);
    if (!s.ok()) {
      // Estimated footprints (file size, before a first load) that do not
      // fit are the same misconfiguration as measured ones that do not.
      const std::string reason = s.reason() == "no_room_for_model" ? "pinned_models_exceed_budget" : s.reason();
      return Status(s.code(), "pinned model '" + name + "': " + s.message(), reason);
    }
    TouchLocked(e);
  }
  for (const int pool : {kDevicePool, kHostPool}) {
    const int64_t used = UsedLocked(pool);
    if (Budget(pool) > 0 && used > Budget(pool)) {
      return ResourceExhausted("pinned models use " + std::to_string(used) + " bytes, over the " +
                                   BudgetName(pool) + " of " + std::to_string(Budget(pool)),
                               "pinned_models_exceed_budget");
    }
  }
  return Status::Ok();
}

Result<ModelLease> ModelManager::Acquire(const std::string& name, int64_t deadline_mono_us) {
  std::unique_lock<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
  RETURN_IF_ERROR(WaitLoadedLocked(lock, *e, deadline_mono_us, /*retry_failed=*/false,
                                   /*count_wait=*/true));
  ++e->leases;
  TouchLocked(*e);
  return ModelLease(this, e, e->model.get());
}

Result<ModelLease> ModelManager::TryAcquire(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr || e->state != ModelState::kLoaded || stopping_)
    return Unavailable("model '" + name + "' is not loaded here", "model_not_loaded_here");
  ++e->leases;
  TouchLocked(*e);
  return ModelLease(this, e, e->model.get());
}

bool ModelManager::IsLoaded(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry* e = Find(name);
  return e != nullptr && e->state == ModelState::kLoaded;
}

bool ModelManager::LoadedOrLoading(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry* e = Find(name);
  return e != nullptr && (e->state == ModelState::kLoaded || e->state == ModelState::kLoading);
}

void ModelManager::Touch(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e != nullptr && e->state == ModelState::kLoaded) TouchLocked(*e);
}

bool ModelManager::FitsWithoutEviction(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry* e = Find(name);
  return e != nullptr && FitsWithoutEvictionLocked(*e);
}

bool ModelManager::LargerThanBudget(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry* e = Find(name);
  if (e == nullptr) return false;
  const int64_t budget = Budget(e->pool);
  return budget > 0 && EstimateLocked(*e) > budget;
}

int64_t ModelManager::FootprintBytes(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry* e = Find(name);
  return e == nullptr ? 0 : EstimateLocked(*e);
}

bool ModelManager::FitsWithoutEvictionLocked(const Entry& e) const {
  const int64_t need = EstimateLocked(e);
  const int64_t budget = Budget(e.pool);
  return (budget == 0 || UsedLocked(e.pool) + need <= budget) &&
         (options_.max_models == 0 || CountLocked() < options_.max_models);
}

Status ModelManager::Preload(const std::string& name) {
  std::unique_lock<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
  if (e->state == ModelState::kLoaded) return Status::Ok();
  // Memory still being freed (a preload just given back) is room soon.
  cv_.wait(lock, [this] { return unloading_count_ == 0 || stopping_; });
  if (e->state == ModelState::kLoaded) return Status::Ok();  // loaded by another caller meanwhile
  // A load under way is someone else's: joined, it keeps its own rules (a
  // preload's, that it must fit without evicting, would unload it instead).
  const bool joins = e->state == ModelState::kLoading;
  if (!joins && !FitsWithoutEvictionLocked(*e))
    return NoRoom("model '" + name + "' would not fit without evicting");
  if (!joins) e->preloading = true;
  Status s = WaitLoadedLocked(lock, *e, kNoDeadline, /*retry_failed=*/false, /*count_wait=*/false);
  if (!joins) e->preloading = false;
  if (s.ok()) TouchLocked(*e);
  return s;
}

Status ModelManager::StartLoad(const std::string& name, bool retry_failed) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
  if (e->state == ModelState::kLoaded || e->state == ModelState::kLoading) return Status::Ok();
  if (stopping_) return Unavailable("the model manager is shutting down", "shutting_down");
  const bool retry_due = options_.retry_failed_after_us > 0 &&
                         clock_->NowMonoUs() - e->failed_mono_us >= options_.retry_failed_after_us;
  if (e->state == ModelState::kFailed && !retry_due && !retry_failed) return e->error;
  ASSIGN_OR_RETURN(Step step, BeginLoadLocked(*e));
  if (step == Step::kWait) {
    return Unavailable("model '" + name + "' waits for room: memory still being freed, or another load first",
                       "memory_being_freed");
  }
  return Status::Ok();
}

Status ModelManager::LoadError(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry* e = Find(name);
  return e != nullptr && e->state == ModelState::kFailed ? e->error : Status::Ok();
}

Status ModelManager::Load(const std::string& name, bool retry_failed, int64_t deadline_mono_us) {
  std::unique_lock<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
  // Already loaded: a no-op, which leaves its place in the eviction order
  // alone (an operator's check is not a use).
  const bool was_loaded = e->state == ModelState::kLoaded;
  RETURN_IF_ERROR(WaitLoadedLocked(lock, *e, deadline_mono_us, retry_failed, /*count_wait=*/false));
  if (!was_loaded) TouchLocked(*e);
  return Status::Ok();
}

Status ModelManager::Unload(const std::string& name) {
  std::vector<std::unique_ptr<LoadedModel>> victims;
  PoolBytes bytes{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry* e = Find(name);
    if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
    if (e->pinned) return InvalidArgument("model '" + name + "' is pinned; unpin it first", "model_pinned");
    if (e->state == ModelState::kLoading) {
      return Unavailable("model '" + name + "' is loading", "model_busy");
    }
    if (e->leases > 0) return Unavailable("model '" + name + "' is in use", "model_busy");
    if (e->state == ModelState::kFailed) {
      e->state = ModelState::kNotLoaded;
      e->error = Status::Ok();
    }
    if (e->state != ModelState::kLoaded) return Status::Ok();
    bytes[e->pool] = EvictLocked(*e, &victims, /*automatic=*/false);
    AddUnloadingLocked(bytes, 1);
  }
  UnloadVictims(std::move(victims), bytes, 1);
  return Status::Ok();
}

std::vector<std::string> ModelManager::FailUnhealthy() {
  std::vector<std::unique_ptr<LoadedModel>> victims;
  std::vector<std::string> failed;
  PoolBytes bytes{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, e] : entries_) {
      if (e->state != ModelState::kLoaded || e->leases > 0 || !e->model || !e->model->runtime) continue;
      const Status health = e->model->runtime->Health();
      if (health.ok()) continue;
      bytes[e->pool] += EvictLocked(*e, &victims, /*automatic=*/false);
      e->state = ModelState::kFailed;
      e->failed_mono_us = clock_->NowMonoUs();
      e->error = Status(StatusCode::kBadGateway, "model '" + name + "' failed: " + health.message(),
                        "model_load_failed");
      e->loads_failed->Inc();  // its runtime's restarts were loads, and they failed
      failed.push_back(name);
    }
    AddUnloadingLocked(bytes, static_cast<int>(victims.size()));
  }
  for (const std::string& name : failed) LOG_ERROR("worker", "unloaded " << name << ": its runtime gave up");
  const int count = static_cast<int>(victims.size());
  UnloadVictims(std::move(victims), bytes, count);
  if (!failed.empty() && on_change_) on_change_();
  return failed;
}

Status ModelManager::DeviceHealth() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!device_fault_.ok()) return device_fault_;
  for (const auto& [name, e] : entries_) {
    if (e->state != ModelState::kLoaded || !e->model || !e->model->runtime) continue;
    Status fault = e->model->runtime->DeviceHealth();
    if (!fault.ok()) return fault;
  }
  return Status::Ok();
}

Status ModelManager::Pin(const std::string& name, bool retry_failed, int64_t deadline_mono_us) {
  std::unique_lock<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
  // Pinned while it loads, so the load is not evicted as soon as it lands;
  // a Pin that gives up unpins it only when no other Pin waits or has
  // succeeded (one that times out beside one that waits on must not lose
  // the second's pin).
  e->pinned = true;
  ++e->pins_waiting;
  Status s = WaitLoadedLocked(lock, *e, deadline_mono_us, retry_failed, /*count_wait=*/false);
  --e->pins_waiting;
  if (!s.ok()) {
    if (e->pins_waiting == 0 && !e->pin_kept) e->pinned = false;
    return s;
  }
  e->pin_kept = e->pinned = true;
  TouchLocked(*e);
  return Status::Ok();
}

Status ModelManager::Unpin(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = Find(name);
  if (e == nullptr) return NotFound("model '" + name + "' is not served here", "model_not_found");
  e->pin_kept = false;
  e->pinned = e->pins_waiting > 0;  // a Pin still waiting pins it when it succeeds
  return Status::Ok();
}

std::vector<ModelStatus> ModelManager::Statuses() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ModelStatus> out;
  out.reserve(entries_.size());
  for (const auto& [name, e] : entries_) {
    ModelStatus s;
    s.name = name;
    s.state = e->state;
    s.pinned = e->pinned;
    if (e->state == ModelState::kLoaded) s.memory_bytes = e->measured_bytes;
    if (e->state == ModelState::kLoading) s.memory_bytes = e->reserved_bytes;
    s.measured_bytes = e->measured_bytes;
    s.last_used_unix_ms = e->last_used_unix_ms;
    s.leases = e->leases;
    if (e->state == ModelState::kFailed) {
      s.error = e->error.message();
      s.retry_due = options_.retry_failed_after_us > 0 &&
                    clock_->NowMonoUs() - e->failed_mono_us >= options_.retry_failed_after_us;
    }
    out.push_back(std::move(s));
  }
  return out;
}

int64_t ModelManager::memory_used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return UsedLocked(kDevicePool);
}

int64_t ModelManager::host_memory_used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return UsedLocked(kHostPool);
}

// ---------------------------------------------------------------------------

ModelManager::Entry* ModelManager::Find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : it->second.get();
}

int64_t ModelManager::EstimateLocked(const Entry& e) const {
  return e.measured_bytes > 0 ? e.measured_bytes : e.file_estimate_bytes;
}

void ModelManager::AddUnloadingLocked(const PoolBytes& bytes, int count) {
  for (const int pool : {kDevicePool, kHostPool}) unloading_bytes_[pool] += bytes[pool];
  unloading_count_ += count;
}

int64_t ModelManager::Budget(int pool) const {
  return pool == kHostPool ? options_.host_memory_budget_bytes : options_.memory_budget_bytes;
}

const char* ModelManager::BudgetName(int pool) {
  return pool == kHostPool ? "host memory budget" : "memory budget";
}

int64_t ModelManager::UsedLocked(int pool) const {
  int64_t used = unloading_bytes_[pool];
  for (const auto& [name, e] : entries_) {
    if (e->pool != pool) continue;
    if (e->state == ModelState::kLoaded) used += e->measured_bytes;
    if (e->state == ModelState::kLoading) used += e->reserved_bytes;
  }
  return used;
}

int ModelManager::CountLocked() const {
  int count = unloading_count_;
  for (const auto& [name, e] : entries_) {
    if (e->state == ModelState::kLoaded || e->state == ModelState::kLoading) ++count;
  }
  return count;
}

Result<ModelManager::Step> ModelManager::BeginLoadLocked(Entry& e) {
  // Nothing loads on a failed device, and nothing is evicted for a load
  // that would fail at once.
  if (!device_fault_.ok()) return device_fault_;
  const int pool = e.pool;
  const int64_t need = EstimateLocked(e);
  const int64_t budget = Budget(pool);
  const int max_models = options_.max_models;
  if (budget > 0 && need > budget) {
    return NoRoom("model '" + e.config.name + "' needs about " + std::to_string(need) +
                  " bytes, more than the whole " + BudgetName(pool) + " of " + std::to_string(budget));
  }
  auto memory_fits = [&](int64_t used) { return budget == 0 || used + need <= budget; };
  auto count_fits = [&](int count) { return max_models == 0 || count < max_models; };
  auto fits = [&](int64_t used, int count) { return memory_fits(used) && count_fits(count); };
  int64_t used = UsedLocked(pool);
  int count = CountLocked();
  std::vector<Entry*> chosen;
  if (!fits(used, count)) {
    // Unloads under way (an operator's, or the excess of an earlier
    // eviction) will free enough: wait for them rather than evict more,
    // which would leave the budget part empty once they end.
    if (fits(used - unloading_bytes_[pool], count - unloading_count_)) return Step::kWait;
    std::vector<Entry*> evictable = EvictableLocked(&e);
    auto choose = [&](std::vector<Entry*>::iterator it) {
      chosen.push_back(*it);
      if ((*it)->pool == pool) used -= (*it)->measured_bytes;
      --count;
      return evictable.erase(it);
    };
    // Memory: only models of the load's own pool free it. Then, if the
    // model count is still short, any model, in the policy's order.
    for (auto it = evictable.begin(); it != evictable.end() && !memory_fits(used);)
      it = (*it)->pool == pool ? choose(it) : it + 1;
    for (auto it = evictable.begin(); it != evictable.end() && !count_fits(count);) it = choose(it);
    if (!fits(used, count)) {
      // Evictions already under way will free enough: wait for them rather
      // than fail, and evict nothing now.
      if (fits(used - unloading_bytes_[pool], count - unloading_count_)) return Step::kWait;
      const std::string which = options_.in_host_memory ? std::string(" in its ") + BudgetName(pool) : "";
      return NoRoom("no room for model '" + e.config.name + "' (needs about " + std::to_string(need) +
                    " bytes): every resident model" + which + " is pinned, in use or holding work");
    }
    // Victims are chosen only when a loader thread is free to unload them
    // and load this model at once: a load queued behind another would leave
    // its victims serving for that long while shown not loaded (a peer would
    // load a second copy of one), and its choice would be stale by its turn.
    if (running_jobs_ + static_cast<int>(jobs_.size()) >= static_cast<int>(loader_threads_.size()))
      return Step::kWait;
  }
  auto job = std::make_unique<Job>();
  job->entry = &e;
  // The victims' memory becomes the new model's reservation (the loader
  // thread unloads them before it loads); only what exceeds it is
  // accounted as unloading.
  PoolBytes victim_bytes{};
  for (Entry* c : chosen) victim_bytes[c->pool] += EvictLocked(*c, &job->victims, /*automatic=*/true);
  job->excess_bytes = victim_bytes;
  job->excess_bytes[pool] = std::max<int64_t>(0, victim_bytes[pool] - need);
  job->excess_count = std::max(0, static_cast<int>(chosen.size()) - 1);
  AddUnloadingLocked(job->excess_bytes, job->excess_count);
  e.state = ModelState::kLoading;
  e.reserved_bytes = need;
  e.error = Status::Ok();
  e.attempt = std::make_shared<LoadAttempt>();
  job->attempt = e.attempt;
  jobs_.push_back(std::move(job));
  cv_.notify_all();
  return Step::kReady;
}

std::vector<ModelManager::Entry*> ModelManager::EvictableLocked(const Entry* except) const {
  std::vector<Entry*> out;
  for (const auto& [name, c] : entries_) {
    if (c.get() == except || c->state != ModelState::kLoaded || c->pinned || c->leases > 0) continue;
    if (c->model && c->model->attachment && c->model->attachment->HoldsWork()) continue;
    out.push_back(c.get());
  }
  if (options_.eviction == EvictionPolicy::kGdsf) {
    std::sort(out.begin(), out.end(), [](const Entry* a, const Entry* b) {
      if (a->gdsf_priority != b->gdsf_priority) return a->gdsf_priority < b->gdsf_priority;
      return a->last_use_seq < b->last_use_seq;
    });
  } else {
    std::sort(out.begin(), out.end(), [](const Entry* a, const Entry* b) { return a->last_use_seq < b->last_use_seq; });
  }
  return out;
}

int64_t ModelManager::EvictLocked(Entry& e, std::vector<std::unique_ptr<LoadedModel>>* victims,
                                  bool automatic) {
  // A model unloaded after its pass broke the device must not take the
  // only report of the fault with it.
  if (device_fault_.ok() && e.model && e.model->runtime) device_fault_ = e.model->runtime->DeviceHealth();
  victims->push_back(std::move(e.model));
  if (automatic) gdsf_inflation_ = std::max(gdsf_inflation_, e.gdsf_priority);
  e.state = ModelState::kNotLoaded;
  e.memory->Set(0);
  if (automatic) e.evictions->Inc();
  UpdateLoadedGaugeLocked();
  return e.measured_bytes;
}

Status ModelManager::WaitLoadedLocked(std::unique_lock<std::mutex>& lock, Entry& e,
                                      int64_t deadline_mono_us, bool retry_failed,
                                      bool count_wait) {
  std::shared_ptr<LoadAttempt> attempt;  // the load this caller waits on
  bool waited = false;
  int64_t wait_start_us = 0;
  Status result;
  while (true) {
    if (e.state == ModelState::kLoaded) break;
    // Checked before the state: the model may have failed again since, and
    // each caller reports the failure of the load it waited for.
    if (attempt != nullptr && attempt->done && !attempt->status.ok()) {
      result = attempt->status;
      break;
    }
    if (stopping_) {
      result = Unavailable("the model manager is shutting down", "shutting_down");
      break;
    }
    if (e.state == ModelState::kLoading) {
      attempt = e.attempt;
    } else {
      const bool retry_due =
          options_.retry_failed_after_us > 0 &&
          clock_->NowMonoUs() - e.failed_mono_us >= options_.retry_failed_after_us;
      if (e.state == ModelState::kFailed && !retry_failed && !retry_due) {
        result = e.error;
        break;
      }
      Result<Step> step = BeginLoadLocked(e);
      if (!step.ok()) {
        result = step.status();
        break;
      }
      if (*step == Step::kReady) attempt = e.attempt;
    }
    const int64_t now = clock_->NowMonoUs();
    if (!waited) {
      waited = true;
      wait_start_us = now;
      if (count_wait) e.load_waits->Inc();
    }
    if (now >= deadline_mono_us) {
      result = DeadlineExceeded("deadline passed while model '" + e.config.name + "' was loading");
      break;
    }
    cv_.wait_for(lock, std::chrono::microseconds(std::min(deadline_mono_us - now, kWaitSliceUs)));
  }
  if (waited && count_wait) {
    e.load_wait_seconds->Observe(static_cast<double>(clock_->NowMonoUs() - wait_start_us) / 1e6);
  }
  return result;
}

void ModelManager::TouchLocked(Entry& e) {
  e.last_use_seq = ++use_seq_;
  e.last_used_unix_ms = clock_->NowUnixMs();
  if (options_.eviction != EvictionPolicy::kGdsf) return;
  e.uses += 1;
  const double cost = std::max(e.load_seconds_last, 1e-3);
  e.gdsf_priority = gdsf_inflation_ + e.uses * cost / static_cast<double>(std::max<int64_t>(e.measured_bytes, 1));
}

void ModelManager::ReleaseLease(void* entry) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = *static_cast<Entry*>(entry);
  --e.leases;
  TouchLocked(e);
  if (e.leases == 0) cv_.notify_all();
}

void ModelManager::UpdateLoadedGaugeLocked() {
  int loaded = 0;
  for (const auto& [name, e] : entries_) loaded += e->state == ModelState::kLoaded ? 1 : 0;
  models_loaded_->Set(loaded);
}

void ModelManager::UnloadVictims(std::vector<std::unique_ptr<LoadedModel>> victims,
                                 PoolBytes accounted_bytes, int accounted_count) {
  // An exception here (a runtime whose device failed) must neither end
  // the loader thread nor leave the bytes below accounted as unloading.
  const auto guarded = [](const LoadedModel& v, auto&& step) {
    try {
      step();
    } catch (const std::exception& ex) {
      LOG_ERROR("worker", "unloading " << v.config.name << ": " << ex.what());
    } catch (...) {
      LOG_ERROR("worker", "unloading " << v.config.name << ": unknown exception");
    }
  };
  // Every use of every victim stops first, then the runtimes unload: a
  // victim still attached while an earlier one's runtime unloads (a GPU's
  // can take a second) would go on pulling work only to hand it back.
  for (auto& v : victims) guarded(*v, [&] { v->attachment.reset(); });
  for (auto& v : victims) {
    guarded(*v, [&] {
      if (v->runtime != nullptr) v->runtime->Unload();
    });
    v.reset();
  }
  if (accounted_bytes == PoolBytes{} && accounted_count == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    AddUnloadingLocked({-accounted_bytes[kDevicePool], -accounted_bytes[kHostPool]}, -accounted_count);
  }
  cv_.notify_all();
}

void ModelManager::LoaderLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and nothing left to fail
    std::unique_ptr<Job> job = std::move(jobs_.front());
    jobs_.pop_front();
    ++running_jobs_;
    Entry& e = *job->entry;
    lock.unlock();

    if (on_load_start_) on_load_start_(e.config.name);  // config is fixed after construction
    UnloadVictims(std::move(job->victims), job->excess_bytes, job->excess_count);
    lock.lock();
    const bool stop = stopping_;
    lock.unlock();

    const int64_t start_us = clock_->NowMonoUs();
    Result<std::unique_ptr<LoadedModel>> loaded =
        Unavailable("the model manager is shutting down", "shutting_down");
    if (!stop) {
      try {
        loaded = loader_(e.config);  // config is fixed after construction
      } catch (const std::exception& ex) {
        loaded = Internal(std::string("loader threw: ") + ex.what());
      } catch (...) {
        loaded = Internal("loader threw");
      }
      if (loaded.ok() && loaded.value() == nullptr) loaded = Internal("loader returned no model");
    }
    const double seconds = static_cast<double>(clock_->NowMonoUs() - start_us) / 1e6;

    lock.lock();
    e.reserved_bytes = 0;
    std::vector<std::unique_ptr<LoadedModel>> over_budget;
    PoolBytes over_budget_bytes{};
    if (loaded.ok()) {
      std::unique_ptr<LoadedModel> m = std::move(loaded).value();
      if (m->memory_bytes <= 0) m->memory_bytes = m->runtime ? m->runtime->MemoryBytes() : 0;
      e.measured_bytes = m->memory_bytes;
      e.model = std::move(m);
      e.state = ModelState::kLoaded;
      e.error = Status::Ok();
      e.uses = 0;
      e.load_seconds_last = seconds;
      TouchLocked(e);
      e.memory->Set(static_cast<double>(e.measured_bytes));
      e.loads_ok->Inc();
      e.load_seconds->Observe(seconds);
      job->attempt->status = Status::Ok();
      const int64_t budget = Budget(e.pool);
      if (budget > 0 && (e.measured_bytes > budget || (e.preloading && UsedLocked(e.pool) > budget))) {
        // Larger than the whole budget, or a preload that does not fit
        // after all: this model goes again, and nothing else does.
        const bool whole = e.measured_bytes > budget;
        over_budget_bytes[e.pool] = EvictLocked(e, &over_budget, /*automatic=*/false);
        AddUnloadingLocked(over_budget_bytes, 1);
        job->attempt->status =
            NoRoom("model '" + e.config.name + "' measured " + std::to_string(e.measured_bytes) + " bytes once loaded, " +
                   (whole ? std::string("more than the whole ") + BudgetName(e.pool) + " of " + std::to_string(budget)
                          : std::string("more than the ") + BudgetName(e.pool) + " has left without evicting"));
        LOG_WARN("worker", job->attempt->status.message() << "; unloaded it again");
      } else if (budget > 0 && UsedLocked(e.pool) > budget) {
        // The estimate was low: give back the excess from idle models.
        int64_t used = UsedLocked(e.pool);
        for (Entry* c : EvictableLocked(&e)) {
          if (used <= budget) break;
          if (c->pool != e.pool) continue;
          const int64_t bytes = EvictLocked(*c, &over_budget, /*automatic=*/true);
          used -= bytes;
          over_budget_bytes[e.pool] += bytes;
        }
        AddUnloadingLocked(over_budget_bytes, static_cast<int>(over_budget.size()));
      }
      if (e.model != nullptr && e.model->attachment != nullptr) {
        // Kept: only now does it take work (see ModelAttachment::Start).
        try {
          e.model->attachment->Start();
        } catch (const std::exception& ex) {
          PoolBytes freed{};
          freed[e.pool] = EvictLocked(e, &over_budget, /*automatic=*/false);
          over_budget_bytes[e.pool] += freed[e.pool];
          AddUnloadingLocked(freed, 1);
          job->attempt->status = Internal("model '" + e.config.name + "' loaded but could not start serving: " + ex.what());
          LOG_WARN("worker", job->attempt->status.message() << "; unloaded it again");
        }
      }
    } else if (stop) {
      e.state = ModelState::kNotLoaded;
      job->attempt->status = loaded.status();
    } else if (loaded.status().reason() == "device_fault") {
      // Not the model's failure: the device's, for the rest of the process.
      // Its work stays queued for other workers (see DeviceHealth).
      e.state = ModelState::kNotLoaded;
      if (device_fault_.ok()) device_fault_ = loaded.status();
      job->attempt->status = loaded.status();
    } else {
      e.state = ModelState::kFailed;
      e.failed_mono_us = clock_->NowMonoUs();
      e.error = Status(StatusCode::kBadGateway,
                       "model '" + e.config.name + "' failed to load: " + loaded.status().message(),
                       "model_load_failed");
      e.loads_failed->Inc();
      e.load_seconds->Observe(seconds);
      job->attempt->status = e.error;
    }
    job->attempt->done = true;
    UpdateLoadedGaugeLocked();
    // The loader is free once the job's evictions are done too, and before
    // the change is announced (demand starts the next load on it); with no
    // evictions left, in the same step as the outcome, so whoever sees the
    // outcome finds the loader free.
    if (over_budget.empty()) --running_jobs_;
    cv_.notify_all();
    lock.unlock();
    if (!over_budget.empty()) {
      const int count = static_cast<int>(over_budget.size());
      UnloadVictims(std::move(over_budget), over_budget_bytes, count);
      lock.lock();
      --running_jobs_;
      cv_.notify_all();
      lock.unlock();
    }
    if (on_change_) on_change_();
    lock.lock();
  }
}

}  // namespace shoal
