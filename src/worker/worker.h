// Worker: the sidecar on one device that pulls work from JetStream and runs
// a fleet of models. Its ModelManager keeps the models it has loaded within
// a memory budget (pinned ones always; others loaded on demand and evicted
// least recently used first). Each loaded model gets a ModelServer (one
// durable pull consumer, a fetcher and an executor thread); forward passes
// take turns on the device through a DeviceScheduler.
//
// Placement without a router: the worker watches the work stream's backlog
// per model. A model with waiting work that no live worker has loaded (or
// whose backlog per replica is over scale_out_backlog) is loaded here only
// after this worker wins the placement claim in SHOAL_PLACEMENT, so one cold
// request never makes two workers evict. A model that fails to load gets
// its waiting work answered with the load error, once. Heartbeats go to
// SHOAL_WORKERS (every catalog model's state, memory, backlog); the catalog
// to SHOAL_MODELS; operators act on it through shoal.ctl.<worker-id>.
//
// Push dispatch (the baseline `shoal gateway --dispatch=push`): the worker
// also takes work sent straight to it on shoal.push.<worker-id>.<model>
// (core NATS) into the same batcher and device scheduler as pulled work,
// and publishes a load report on shoal.load.<worker-id> every
// load_report_interval_ms for gateways to choose by.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "blob/blob_offload.h"
#include "common/byte_budget.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/status.h"
#include "queue/nats_client.h"
#include "runtime/runtime.h"
#include "worker/cancelled_requests.h"

namespace shoal {

// CPUs this process may run on: its affinity mask (taskset, a cpuset), else
// the machine's hardware threads, and no more than its cgroup CPU quota
// rounded up (a container's CPU limit, CgroupCpuLimit); at least 1. What
// device_slots 0 and intra_op_threads 0 resolve to.
int UsableCpus();

struct WorkerOptions {
  std::string worker_id;             // empty: hostname-pid-random
  std::string model_repository;      // directory of model directories
  std::vector<std::string> models;   // the catalog: names to serve; empty: all in the repository
  int intra_op_threads = 0;          // 0: model config, else hardware threads
  std::string runtime_override;      // non-empty: this runtime for every embed/score/classify model ("null")
  // Batching overrides for every model; 0 / -1: keep each model's config.
  int64_t max_batch_tokens = 0;
  int max_batch_size = 0;
  int64_t max_wait_us = -1;

  // The fleet on this device.
  // Where TorchScript models run: "cpu" or "cuda[:N]" (a libtorch with
  // CUDA). Other runtimes compute where they always do. The memory budget
  // is this device's.
  std::string device = "cpu";
  int64_t memory_budget_bytes = 0;   // 0: unlimited
  // A GPU worker: the budget of models whose runtime computes on the host
  // (every runtime but TorchScript), apart from the GPU's. 0: unlimited.
  // Not for a CPU worker, whose models all share memory_budget_bytes.
  int64_t host_memory_budget_bytes = 0;
  int max_models = 0;                // resident models; 0: unlimited
  std::string eviction = "lru";      // which idle model goes first: "lru" or "gdsf" (see EvictionPolicy)
  std::vector<std::string> pinned;   // loaded at start, never evicted
  // Loaded at start, in order, while they fit without evicting; evictable.
  // {"all"}: every catalog model (the default); empty: none.
  std::vector<std::string> preload = {"all"};
  // Whether `preload` is {"all"}: every model of the catalog.
  bool PreloadsAll() const { return preload.size() == 1 && preload.front() == "all"; }
  // Forward passes at once on this device, each on the model's threads.
  // 0 (auto): one slot per core; a TorchScript pass runs on every core when
  // it has the device to itself and on one core beside other models' passes.
  int device_slots = 0;
  // While other models wait for the device, a model's batch is cut to what
  // its measured cost says runs in about this long on the slots it got, so
  // a model draining a backlog (a freshly loaded large one: a 64-row
  // MiniLM-L6 pass takes about 0.4 s on one core) hands the device on after
  // each quantum instead of holding it for a full batch. A model alone on
  // the device always cuts full batches. 0: off.
  int64_t turn_quantum_ms = 100;
  int64_t demand_poll_ms = 250;      // how often the stream's backlog per model is read
  int64_t claim_ttl_ms = 15000;      // life of a placement claim
  // Add a replica when a loaded model's backlog per replica exceeds this
  // many messages and this worker has room without evicting; 0: never.
  int64_t scale_out_backlog = 0;
  // A model that failed to load is tried again on demand after this long.
  int64_t retry_failed_after_ms = 30000;
  // Nice value (0..19) of the thread that loads a TorchScript model (and of
  // the threads it starts, which end with the load): a load uses only CPU
  // that serving leaves idle, so resident models keep their latency while
  // another one loads. Other runtimes load at serving's priority (their
  // loads start threads or processes that go on serving). 0: off.
  int load_nice = 10;
  // While a TorchScript model loads, put its tensors of 32 MiB and more on
  // transparent huge pages (runtime/torch/huge_pages.h): MiniLM-L6 loads in
  // less than half the time. Process-wide, and on for the rest of the
  // process once a worker has turned it on (PrepareProcess). Nothing
  // changes where the kernel's THP mode is "never".
  bool huge_pages = true;
  // Keep memory that forward passes free for the next pass (glibc malloc:
  // blocks under 32 MiB from the heap, trimmed only past 64 MiB free per
  // arena; common/process_memory.h) instead of faulting it in again on
  // every pass. An unloaded model's tensors under 32 MiB stay in malloc's
  // heap for the next load. Process-wide. false: glibc's defaults.
  bool keep_freed_memory = true;

  // Called once, on the worker's demand thread, when its device fails for
  // the rest of the process (ModelManager::DeviceHealth: a CUDA error that
  // leaves the context unusable). By then the worker has stopped pulling,
  // loading and taking pushed work and has left the registry, so peers
  // take its models on demand; work it held goes back to the queue. The
  // owner should Stop() it and end the process non-zero so that its
  // supervisor starts a fresh one (`shoal worker` and `shoal serve` exit
  // 1); not from inside the callback, which runs on a thread Stop() joins.
  // Empty: only logged.
  std::function<void(const Status& fault)> on_device_fault;
  // Makes the runtime for a model; default CreateRuntime(config.runtime).
  // Tests inject fakes here.
  std::function<Result<std::unique_ptr<Runtime>>(const ModelConfig&)> runtime_factory;
  ConsumerOptions consumer;
  WorkStreamOptions stream;
  int64_t fetch_poll_ms = 500;       // long-poll when idle
  int64_t heartbeat_interval_ms = 2000;
  int64_t heartbeat_ttl_ms = 6000;
  // Fetches work messages that carry a payload reference and offloads
  // large replies (docs/blob-store.md); store_url empty: off.
  BlobOffloadOptions blob;
  // Most rows this worker holds (waiting in its batchers or running, all
  // models) before it stops pulling more; 0: no bound (each model pulls up
  // to its own batch budget).
  int64_t max_held_rows = 0;
  // Most forward passes' worth of work this worker claims ahead of its
  // device, all models together: open pull requests plus pulled work
  // waiting for the device (see PullGate); 0: no bound (each model keeps a
  // pull open whenever its batcher has room). While bounded, a claimed
  // pull stays open at most pull_idle_poll_ms before its claim moves on.
  int pull_ahead = 0;
  int64_t pull_idle_poll_ms = 20;
  // Load reports on shoal.load.<worker-id> (push dispatch); 0: none.
  int64_t load_report_interval_ms = 100;
  Status Validate() const;
};

class ModelManager;
class ConsumerPark;
class DeviceScheduler;
class HeldRows;
class PullGate;
class ProgressKeeper;

class Worker {
 public:
  // The process-wide settings of `options` (huge_pages, keep_freed_memory).
  // Call it before the process starts threads (`shoal serve` and `shoal
  // worker` do): installing libtorch's allocator while other threads
  // allocate races with them. Create() calls it too; later calls do nothing
  // more.
  static void PrepareProcess(const WorkerOptions& options);

  // The models a worker with `options` serves: `models` from its repository
  // (every one when none is named), each `pinned` and `preload` name among
  // them (else NotFound "model_not_found"). Reads the repository; starts
  // nothing. Create() goes through it.
  static Result<std::vector<ModelConfig>> SelectModels(const WorkerOptions& options);
  // Reads the catalog, binds the stream and buckets, loads the pinned and
  // preloaded models (blocking), registers and starts its threads. `client`
  // and `metrics` must outlive the worker.
  static Result<std::unique_ptr<Worker>> Create(const WorkerOptions& options, NatsClient* client,
                                                MetricsRegistry* metrics, const Clock* clock = nullptr);
  ~Worker();
  // Stops pulling, finishes the batches in flight (replies and acks them),
  // leaves pulled-but-unrun messages for redelivery, unloads, deregisters.
  void Stop();
  const std::string& id() const { return id_; }
  // Every catalog model (loaded or not).
  std::vector<std::string> ModelNames() const;
  // Names of the models loaded now.
  std::vector<std::string> LoadedModels() const;
  ModelManager& manager() { return *manager_; }
  // Seconds the device's slots have spent running forward passes since
  // start (summed over slots; monotonically increasing). Thread-safe.
  double busy_seconds() const { return static_cast<double>(busy_us_.load()) / 1e6; }
  // The load report published on shoal.load.<id> (JSON). Thread-safe.
  std::string LoadReportJson() const;

  // Acts on one model as an operator asked: "load", "unload", "pin",
  // "unpin" or "status". Blocks while a load runs, until
  // `deadline_unix_ms` (0: none; passed already: nothing is done), when it
  // answers kDeadlineExceeded and a load under way goes on. Returns the
  // model's JSON status on this worker.
  Result<std::string> Control(const std::string& action, const std::string& model, int64_t deadline_unix_ms = 0);

 private:
  // Writes this worker's first registry entry, unless another live process
  // has its id there: InvalidArgument "worker_id_in_use" then.
  Status ReserveId();
  // Whether the registry entry for this id is still this worker's (or
  // gone) at the end of its start; InvalidArgument "worker_id_in_use" when
  // another process has written it since.
  Status StillHoldsId() const;
  // The same for an entry already read.
  Status StillHoldsId(const std::string& entry) const;
  struct Backlog {
    uint64_t msgs = 0;
    int64_t oldest_unix_ms = 0;  // 0: unknown or none
    Gauge* msgs_gauge = nullptr;
    Gauge* age_gauge = nullptr;
  };
  // What another live worker reports about one model.
  struct PeerModel {
    std::string worker;
    std::string state;
    int64_t memory_budget_bytes = 0;  // the peer's for this model (GPU or host memory); 0: unlimited
    // By the peer's last heartbeat: whether it could load this model now
    // without evicting (budget left for `FootprintBytes` and a model-count
    // slot) and without waiting for a load of its own (it runs one
    // on-demand load at a time; a peer still starting loads nothing on
    // demand until its start ends, and counts as loading).
    int64_t free_bytes = 0;  // budget left in the model's pool; INT64_MAX: unlimited
    bool count_full = false;
    bool loading = false;
  };

  Worker() = default;
  Result<std::unique_ptr<struct LoadedModel>> LoadModel(const ModelConfig& config);
  // The model's pull consumer; transient NATS errors (timeouts, a lost
  // connection) are retried for up to kConsumerRetryMs.
  Result<std::unique_ptr<PullConsumer>> CreateConsumer(const std::string& model);
  static constexpr int64_t kConsumerRetryMs = 30000;
  void HeartbeatLoop();
  Status PublishHeartbeat();
  // `starting`: marked as a worker still in Create (no demand loop yet).
  std::string HeartbeatJson(bool starting = false) const;
  std::string ModelStatusJson(const std::string& model) const;
  void DemandLoop();
  void PollDemand();
  // Whether the device has failed (see WorkerOptions::on_device_fault).
  // The first time: leaves the registry, frees its placement claims and
  // calls on_device_fault. Demand thread only.
  bool DeviceFaulted();
  // Live peers' model states (every model their heartbeats list, with its
  // state name), by model, excluding this worker. Cached.
  const std::map<std::string, std::vector<PeerModel>>& Peers(bool fresh);
  // Tries to take the placement claim for `model` as replica `replica`.
  bool Claim(const std::string& model, int replica);
  // Gives back claims whose load has finished, once the registry shows the
  // result: a claim must outlive only the window in which the registry does
  // not show the load yet (else a dead claimant would block failover).
  void ReleaseSettledClaims();
  // Deletes this worker's placement claim `key`, at the revision read as
  // its own: true once it is gone or no longer this worker's, false when
  // it could not be read or deleted (tried again later).
  bool GiveBackClaim(const std::string& key);
  // Has the heartbeat thread publish now (and, with `demand`, the demand
  // loop look at cold models now).
  void WakeHeartbeat(bool demand);
  // Claims of loads this worker will not finish: frees them for the others.
  // Demand thread, or after it has ended.
  void ReleaseAllClaims();
  // How many live peers have `model` loaded or loading.
  static int ServingPeers(const std::map<std::string, std::vector<PeerModel>>& peers, const std::string& model);
  // For a model that failed to load here: whether a peer serves it or may
  // still load it, so its waiting work is not answered with this worker's
  // load error yet. True while a live peer holds the placement claim or
  // reports it loaded or loading, and, while a peer reports it not loaded
  // (it has not tried), for a grace of one heartbeat interval plus two
  // backlog reads from the later of the oldest waiting message and the
  // first call for this model since it was last loaded here. Reads the
  // registry. Demand thread.
  bool AnotherMayLoad(const std::string& model, int64_t now_ms);
  // Whether a live peer that has `model` has a memory budget it would fit
  // (by this worker's measurement or estimate of it). Reads the registry.
  bool PeerMayFit(const std::string& model);
  // Whether a live peer in `peers` has `model` in its catalog, not loaded
  // nor failed, and could load it now without evicting (PeerModel).
  bool PeerHasRoom(const std::map<std::string, std::vector<PeerModel>>& peers, const std::string& model) const;
  // Answers the work waiting for a model that failed to load here with
  // its load error (terminal), at most `max` messages.
  void DrainFailed(const std::string& model, const Status& error, int max);
  static constexpr int64_t kDrainPollMs = 50;  // DrainFailed's pull
  // Hands the model's drain subscription, if any, to park_.
  void ParkDrainConsumer(const std::string& model);
  static void OnControl(natsConnection*, natsSubscription*, natsMsg*, void* closure);
  static void OnPush(natsConnection*, natsSubscription*, natsMsg*, void* closure);
  static void OnCancel(natsConnection*, natsSubscription*, natsMsg*, void* closure);
  void LoadReportLoop();

  WorkerOptions options_;
  std::string id_;
  NatsClient* client_ = nullptr;
  MetricsRegistry* metrics_ = nullptr;
  const Clock* clock_ = nullptr;
  std::vector<ModelConfig> catalog_;
  // Catalog models that keep their memory on the host on a GPU worker (all
  // but TorchScript ones): a GPU peer holds them in its host budget.
  std::set<std::string> host_memory_models_;
  std::unique_ptr<KvBucket> workers_kv_;
  std::unique_ptr<KvBucket> models_kv_;
  std::unique_ptr<KvBucket> placement_kv_;
  // Before the manager: the model servers using it stop first.
  std::unique_ptr<BlobOffload> blob_;
  std::unique_ptr<ByteBudget> fetched_payloads_;  // with blob_: --blob-max-fetched
  // Used by the model servers: declared before manager_, so they outlive it.
  std::atomic<int64_t> busy_us_{0};           // see busy_seconds()
  std::unique_ptr<HeldRows> held_rows_;       // rows in batchers or running
  std::unique_ptr<PullGate> pull_gate_;       // passes claimed ahead of the device
  std::unique_ptr<ProgressKeeper> progress_;  // keeps long batches ours past AckWait
  CancelledRequests cancelled_;               // requests whose callers went away (OnCancel)
  std::unique_ptr<DeviceScheduler> scheduler_;
  // Subscriptions of models that stopped here, open until their last pull
  // expires; a load takes its model's back.
  std::unique_ptr<ConsumerPark> park_;
  bool slots_are_cores_ = false;  // device_slots was 0 (auto)
  std::unique_ptr<ModelManager> manager_;
  ModelManager* manager_raw_ = nullptr;  // the same, for threads that outlive manager_'s reset
  SubscriptionPtr control_sub_;
  SubscriptionPtr push_sub_;
  SubscriptionPtr cancel_sub_;
  // Held by OnPush for its whole run (one subscription: runs are serial
  // anyway); Stop() takes it after unsubscribing, so no push runs later.
  std::mutex push_mu_;
  bool push_closed_ = false;  // guarded by push_mu_
  std::mutex control_mu_;  // held by a control request for its whole run
  int64_t started_unix_ms_ = 0;
  std::string host_;
  bool on_gpu_ = false;  // options_.device is a GPU

  mutable std::mutex backlog_mu_;
  std::map<std::string, Backlog> backlog_;  // guarded by backlog_mu_; by model, fixed keys

  // Demand thread only.
  // Subscriptions that answer a failed model's waiting work with its load
  // error; parked once the model loads here (the durable consumer stays).
  std::map<std::string, std::unique_ptr<PullConsumer>> drain_consumers_;
  // model -> when "cannot load ... on demand" was last logged, so a model
  // that finds no room logs once per 30 s, not on every demand poll.
  std::map<std::string, int64_t> no_room_logged_mono_us_;
  // model -> when AnotherMayLoad first ran its grace for it (Unix ms);
  // forgotten once the model is loading or loaded here.
  std::map<std::string, int64_t> gave_up_unix_ms_;
  std::map<std::string, std::vector<PeerModel>> peers_;
  std::map<std::string, std::string> held_claims_;  // claim key -> model
  int64_t peers_read_mono_us_ = 0;
  int64_t oldest_read_mono_us_ = 0;

  std::atomic<bool> stop_{false};
  bool registered_ = false;  // this worker wrote its registry entry (set by ReserveId)
  bool holds_id_ = false;    // its id is among this process's held ids (see ReserveId)
  std::mutex publish_mu_;  // held while a heartbeat is published
  std::atomic<bool> device_faulted_{false};  // set under publish_mu_; no more heartbeats, loads or drains
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_now_ = false;      // guarded by hb_mu_: publish a heartbeat at once
  // In Create until the entry is written as registered: heartbeats update
  // the "starting" entry only while it is still this process's.
  std::atomic<bool> starting_{true};
  bool demand_now_ = false;  // guarded by hb_mu_: read the backlog at once
  std::thread heartbeat_;
  std::thread demand_;
  std::thread load_report_;
  Counter* claims_won_ = nullptr;
  Counter* claims_lost_ = nullptr;
  Counter* device_faults_ = nullptr;
  Counter* drained_ = nullptr;
};

}  // namespace shoal
