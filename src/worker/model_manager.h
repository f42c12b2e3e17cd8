// ModelManager: decides which of a worker's catalog models are resident on
// its device. Loads lazily on first use, keeps pinned models resident, fits
// the rest into a memory budget (and an optional model count) by evicting the
// least recently used idle model, and hands out leases that keep a model
// resident while a batch runs. Thread-safe.
//
// Policies:
// - Footprint. Every decision uses a model's measured footprint once it has
//   loaded (LoadedModel::memory_bytes, else Runtime::MemoryBytes()). Before
//   its first load a model is estimated at model file size x
//   file_size_factor (0 when the file cannot be read); after an unload its
//   last measured footprint is the estimate. A loading model reserves its
//   estimate. If the measured footprint turns out larger than the estimate
//   and the total exceeds the budget, idle unpinned models are evicted
//   (in eviction order) until it fits again, or none is left.
// - Pools. With ModelManagerOptions::in_host_memory set (a GPU worker),
//   models in host memory and models in the device's have a budget each:
//   a load counts and evicts memory only within its own. The model count
//   is one for both: when it is what is short, the next model in eviction
//   order goes, whichever its pool.
// - Eviction takes only loaded, unpinned models with no live lease whose
//   attachment holds no work (ModelAttachment::HoldsWork), in the order of
//   the eviction policy (least recently used first by default), and only
//   as many as the new model needs. If that
//   cannot make room, the request fails with ResourceExhausted
//   "no_room_for_model" without evicting anything; it never blocks on a
//   lease. It waits only for memory that an eviction already in progress is
//   about to free.
// - Loads run on the manager's own loader threads, never on a caller's and
//   never under the lock, so a caller's deadline holds however long a load
//   takes. All callers asking for the same cold model share one load. The
//   models evicted for a load are unloaded before it starts.
// - A failed load puts the model in kFailed. Every caller that was waiting on
//   that load gets the same kBadGateway "model_load_failed" error, once; later
//   Acquire()/StartLoad() calls fail fast with it (no new load) until Load(),
//   Pin() or StartLoad(retry_failed) asks again explicitly, Unload() clears
//   the failure, or retry_failed_after_us passes.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/status.h"
#include "runtime/runtime.h"

namespace shoal {

// Which idle models go first when a load needs room.
enum class EvictionPolicy {
  // Least recently used first.
  kLru,
  // Greedy-Dual-Size-Frequency: lowest priority first, where a model's
  // priority, set at each use, is L + uses x load_seconds / footprint_bytes
  // (uses: touches since it was loaded, i.e. batches run, leases taken and
  // returned, and demand polls that found its work waiting, so a model that
  // batches many requests into one pass counts as fewer uses;
  // load_seconds: its last load, at least 1 ms;
  // L: the priority of the last model this policy evicted, so models not
  // used for a while age out). Keeps models that are used often, cheap in
  // memory or slow to load; a large model no longer evicts many small busy
  // ones at once just because they were used less recently.
  kGdsf,
};
std::string_view EvictionPolicyName(EvictionPolicy p);  // "lru", "gdsf"
// "lru" or "gdsf"; InvalidArgument otherwise.
Result<EvictionPolicy> ParseEvictionPolicy(std::string_view name);

struct ModelManagerOptions {
  int64_t memory_budget_bytes = 0;  // the device's memory for models; 0: unlimited
  // A GPU worker's models whose memory is not the device's (runtimes that
  // compute on the host) count against a budget of their own, the host
  // memory budget, and are evicted only to make room among themselves.
  // Unset: every model counts against memory_budget_bytes.
  std::function<bool(const ModelConfig&)> in_host_memory;
  int64_t host_memory_budget_bytes = 0;  // with in_host_memory; 0: unlimited
  EvictionPolicy eviction = EvictionPolicy::kLru;
  std::vector<std::string> pinned;  // loaded by Start(), never evicted
  int max_models = 0;               // resident (or loading) models; 0: unlimited
  // Estimate for a model that has never loaded: model file size x this.
  double file_size_factor = 1.3;
  // A failed model may be loaded again by Acquire() after this long;
  // 0: only an explicit Load()/Pin()/Unload() clears the failure.
  int64_t retry_failed_after_us = 0;
  int load_threads = 1;             // loads (and evictions) run on these

  Status Validate() const;
};

// Something that uses a resident model, such as a worker's pull loop for it.
// The manager destroys it first when the model is unloaded, before the
// runtime unloads, so its destructor must stop all use of the model.
class ModelAttachment {
 public:
  virtual ~ModelAttachment() = default;
  // True while work already taken for this model waits to run (pulled from
  // the queue, not yet on the device). Eviction passes over such a model:
  // unloading it would hand that work back, and work handed back often
  // enough reaches the queue's delivery limit and fails. Called under the
  // manager's lock: must be cheap and must not call the manager.
  virtual bool HoldsWork() const { return false; }
  // Called once, under the manager's lock, when the manager keeps the model
  // (its measured footprint fits): from then on the attachment may take
  // work. A model unloaded again at once (measured over the budget) is
  // never started, so it has taken no work to hand back. Must not call the
  // manager; an exception fails the load.
  virtual void Start() {}
};

// Everything a worker keeps for one resident model (runtime, and whatever
// else a model needs, such as its tokenizer). The loader fills it; the
// manager owns it until the model is unloaded.
struct LoadedModel {
  ModelConfig config;
  std::unique_ptr<Runtime> runtime;  // loaded; Unload() is called on eviction
  // Measured footprint in bytes. 0: the manager takes runtime->MemoryBytes().
  int64_t memory_bytes = 0;
  std::unique_ptr<ModelAttachment> attachment;  // destroyed before the runtime unloads
};

// Loads one model, blocking for as long as it takes. Called on a loader
// thread, never under the manager's lock; may be called concurrently for
// different models when load_threads > 1. An exception counts as a failure.
using ModelLoader = std::function<Result<std::unique_ptr<LoadedModel>>(const ModelConfig&)>;

enum class ModelState { kNotLoaded, kLoading, kLoaded, kFailed };
std::string_view ModelStateName(ModelState state);  // "not_loaded", "loading", ...

struct ModelStatus {
  std::string name;
  ModelState state = ModelState::kNotLoaded;
  bool pinned = false;
  // Loaded: measured footprint. Loading: the reserved estimate. Else 0.
  int64_t memory_bytes = 0;
  // The footprint measured at its last load here, kept after it is
  // unloaded (what placement decisions use); 0: never loaded here.
  int64_t measured_bytes = 0;
  int64_t last_used_unix_ms = 0;  // 0: never used
  int leases = 0;
  std::string error;  // the load error while kFailed
  bool retry_due = false;  // kFailed and retry_failed_after_us has passed
};

class ModelManager;

// Keeps one loaded model resident (not evictable, not unloadable) while it
// lives and marks it used when taken and when released. Movable, not
// copyable. Must not outlive its manager. Accessors need a valid lease.
class ModelLease {
 public:
  ModelLease() = default;
  ModelLease(ModelLease&& other) noexcept;
  ModelLease& operator=(ModelLease&& other) noexcept;
  ModelLease(const ModelLease&) = delete;
  ModelLease& operator=(const ModelLease&) = delete;
  ~ModelLease() { Release(); }

  bool valid() const { return model_ != nullptr; }
  explicit operator bool() const { return valid(); }
  LoadedModel& model() const { return *model_; }
  Runtime& runtime() const { return *model_->runtime; }
  const ModelConfig& config() const { return model_->config; }
  // Gives the model back early; the lease is then empty. Idempotent.
  void Release();

 private:
  friend class ModelManager;
  ModelLease(ModelManager* manager, void* entry, LoadedModel* model)
      : manager_(manager), entry_(entry), model_(model) {}

  ModelManager* manager_ = nullptr;
  void* entry_ = nullptr;  // ModelManager::Entry
  LoadedModel* model_ = nullptr;
};

class ModelManager {
 public:
  static constexpr int64_t kNoDeadline = std::numeric_limits<int64_t>::max();

  // `catalog`: every model this worker may serve (names must be unique).
  // `clock` and `metrics` must outlive the manager; null means the system
  // clock and a private registry. Starts the loader threads.
  ModelManager(ModelManagerOptions options, std::vector<ModelConfig> catalog, ModelLoader loader,
               const Clock* clock, MetricsRegistry* metrics);
  // Call only once no other thread calls into the manager. Fails loads still
  // queued, waits for outstanding leases to be released, then unloads every
  // model.
  ~ModelManager();
  ModelManager(const ModelManager&) = delete;
  ModelManager& operator=(const ModelManager&) = delete;

  // Validates options and catalog, then loads the pinned models one by one.
  // Blocks until they are loaded. Fails if a pinned model is unknown or fails
  // to load, or if the pinned models together exceed the budget
  // (ResourceExhausted "pinned_models_exceed_budget"). Call once, first.
  Status Start();

  // A lease on `name`, loading it first if needed (see the policies above).
  // Blocks until the model is loaded or deadline_mono_us (clock monotonic
  // time) passes: then DeadlineExceeded, while the load carries on for later
  // callers. A loaded model is returned even past the deadline. Errors:
  // NotFound "model_not_found", ResourceExhausted "no_room_for_model",
  // BadGateway "model_load_failed", Unavailable "shutting_down".
  Result<ModelLease> Acquire(const std::string& name, int64_t deadline_mono_us);

  // A lease on `name` only if it is loaded now: never starts a load and
  // never waits. Unavailable "model_not_loaded_here" otherwise.
  Result<ModelLease> TryAcquire(const std::string& name);

  // Whether `name` is loaded right now. Never blocks on a load.
  bool IsLoaded(const std::string& name) const;
  // Whether `name` is loaded or loading right now. Never blocks on a load.
  bool LoadedOrLoading(const std::string& name) const;
  // Marks a loaded model used now (LRU order) without a lease; for users
  // that keep it busy through an attachment. No-op when not loaded.
  void Touch(const std::string& name);
  // Whether `name` could start loading now without evicting anything.
  bool FitsWithoutEviction(const std::string& name) const;
  // Whether `name` is larger (by its last measurement, else its estimate)
  // than the whole budget of its pool: it cannot load here at all.
  bool LargerThanBudget(const std::string& name) const;
  // That size of `name` in bytes; 0 when unknown.
  int64_t FootprintBytes(const std::string& name) const;
  // Loads `name` (blocking) only as far as it fits without evicting: when
  // its estimate fits, and, once its footprint is measured, when that
  // still fits; if not, it is unloaded again and nothing else is. For
  // filling a fresh worker. OK when loaded (already, or now); NotFound
  // "model_not_found"; ResourceExhausted "no_room_for_model"; a load error.
  Status Preload(const std::string& name);
  // Called after every finished load (success or failure) and the
  // evictions that came with it, outside the lock, on a loader thread, and
  // by FailUnhealthy() on its caller's thread when it failed a model. Set
  // before Start().
  void SetOnChange(std::function<void()> on_change) { on_change_ = std::move(on_change); }
  // Called when a loader thread takes a load, before it unloads the load's
  // victims and loads, outside the lock: the model shows as loading from
  // here, also a load that had to wait for room or for the loader and so
  // began in no caller's StartLoad. Set before Start().
  void SetOnLoadStart(std::function<void(const std::string& model)> on_load_start) {
    on_load_start_ = std::move(on_load_start);
  }

  // Starts loading `name` if it is not loaded or loading; never waits for
  // the load. OK when loaded or loading; else the error Acquire() would
  // give, or Unavailable "memory_being_freed" while it needs evictions that
  // must wait (evictions in progress, or the loader busy with another
  // load). For servers that answer 503 instead of waiting. `retry_failed`:
  // a model that failed here is loaded again at once (an operator's load),
  // not only once --retry-failed-after-ms has passed.
  Status StartLoad(const std::string& name, bool retry_failed = false);
  // The load error (502 model_load_failed) while `name` is failed here; OK
  // in any other state. Never starts a load, due retry or not.
  Status LoadError(const std::string& name) const;

  // Loads `name` and blocks until it is loaded, retrying a failed model
  // (`retry_failed` false: a model whose load has just failed, one that
  // StartLoad began, say, gets that failure instead). OK if it is already
  // loaded (then a no-op: its last use stays as it was). Past
  // `deadline_mono_us`: kDeadlineExceeded, and a load under way goes on.
  Status Load(const std::string& name, bool retry_failed = true, int64_t deadline_mono_us = kNoDeadline);

  // Unloads `name` now, blocking while its runtime unloads. OK if it is not
  // loaded (a kFailed model goes back to kNotLoaded). Errors:
  // InvalidArgument "model_pinned", Unavailable "model_busy" (live leases, or
  // a load in progress), NotFound "model_not_found".
  Status Unload(const std::string& name);

  // Unloads every loaded model whose runtime has given up for good
  // (Runtime::Health not OK) and has no live lease, pinned or not, and puts
  // it in kFailed with a kBadGateway "model_load_failed" error that carries
  // the runtime's reason, as a failed load would: callers get that error,
  // retries follow the failed-model rules above. Blocks while their
  // runtimes unload. Returns the names of the models it failed.
  std::vector<std::string> FailUnhealthy();
  // Not OK (reason device_fault) once the device has failed for the rest
  // of the process: a loaded model's runtime says so
  // (Runtime::DeviceHealth), or said so as it was unloaded, or a load
  // failed with that reason (such a model goes back to kNotLoaded, not
  // kFailed: its callers are not given an error that is not the model's).
  // Every load after that fails at once with this status, evicting
  // nothing. Thread-safe.
  Status DeviceHealth() const;

  // Pins `name`, loading it (blocking) if needed; on a load failure, or past
  // the deadline, the model is left unpinned and the error returned.
  // `retry_failed` and the deadline as for Load. Idempotent.
  Status Pin(const std::string& name, bool retry_failed = true, int64_t deadline_mono_us = kNoDeadline);
  // Makes `name` evictable again; does not unload it. Idempotent.
  Status Unpin(const std::string& name);

  // One entry per catalog model, by name.
  std::vector<ModelStatus> Statuses() const;
  // Loaded footprints + loading reservations (which cover the models evicted
  // for them until they are gone) + other unloads still in progress.
  // The device's budget (on a GPU worker: models in GPU memory).
  int64_t memory_used_bytes() const;
  int64_t memory_budget_bytes() const { return options_.memory_budget_bytes; }
  // With in_host_memory set: the same for the models in host memory.
  int64_t host_memory_used_bytes() const;
  int64_t host_memory_budget_bytes() const { return options_.host_memory_budget_bytes; }

 private:
  friend class ModelLease;
  struct Entry;
  struct LoadAttempt;
  struct Job;

  enum class Step { kReady, kWait };
  // Bytes per memory pool: [kDevicePool] and [kHostPool] (see the policies).
  static constexpr int kDevicePool = 0;
  static constexpr int kHostPool = 1;
  using PoolBytes = std::array<int64_t, 2>;

  Entry* Find(const std::string& name) const;
  int64_t EstimateLocked(const Entry& e) const;
  int64_t UsedLocked(int pool) const;
  // Accounts evicted models' memory and count as unloading (negative: done).
  void AddUnloadingLocked(const PoolBytes& bytes, int count);
  bool FitsWithoutEvictionLocked(const Entry& e) const;
  int64_t Budget(int pool) const;
  // "memory budget" or "host memory budget", for messages.
  static const char* BudgetName(int pool);
  int CountLocked() const;
  // Makes sure `e` is loaded or loading. kWait: an eviction in progress must
  // finish first.
  Result<Step> BeginLoadLocked(Entry& e);
  // Moves the model out of `e` onto `victims`; returns its footprint. The
  // caller accounts it (unloading_bytes_ of its pool, or a reservation).
  int64_t EvictLocked(Entry& e, std::vector<std::unique_ptr<LoadedModel>>* victims, bool automatic);
  // Models automatic eviction may take (see the class comment), in the
  // order of options_.eviction; never `except`.
  std::vector<Entry*> EvictableLocked(const Entry* except) const;
  // Loops until `e` is loaded (OK, lock held), its load failed, or the
  // deadline passes. `retry_failed`: a kFailed model is loaded again.
  Status WaitLoadedLocked(std::unique_lock<std::mutex>& lock, Entry& e, int64_t deadline_mono_us,
                          bool retry_failed, bool count_wait);
  void TouchLocked(Entry& e);
  void ReleaseLease(void* entry);
  void LoaderLoop();
  // Unloads victims outside the lock, then takes the accounted amounts off
  // unloading_bytes_/unloading_count_.
  void UnloadVictims(std::vector<std::unique_ptr<LoadedModel>> victims, PoolBytes accounted_bytes,
                     int accounted_count);
  void UpdateLoadedGaugeLocked();

  const ModelManagerOptions options_;
  const ModelLoader loader_;
  std::function<void()> on_change_;
  std::function<void(const std::string&)> on_load_start_;
  const Clock* clock_;
  std::unique_ptr<MetricsRegistry> own_metrics_;
  MetricsRegistry* metrics_;
  Gauge* models_loaded_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // any state change; loader threads wait on it too
  std::map<std::string, std::unique_ptr<Entry>> entries_;  // guarded by mu_ (map itself is fixed)
  std::vector<std::string> duplicate_names_;               // reported by Start()
  std::deque<std::unique_ptr<Job>> jobs_;                  // guarded by mu_
  int running_jobs_ = 0;                                   // guarded by mu_; jobs a loader thread has taken
  PoolBytes unloading_bytes_{};                            // guarded by mu_
  int unloading_count_ = 0;                                // guarded by mu_
  uint64_t use_seq_ = 0;                                   // guarded by mu_; LRU order
  double gdsf_inflation_ = 0;                              // guarded by mu_; L of EvictionPolicy::kGdsf
  bool stopping_ = false;                                  // guarded by mu_
  Status device_fault_;                                    // guarded by mu_; see DeviceHealth()
  std::vector<std::thread> loader_threads_;
};

}  // namespace shoal
