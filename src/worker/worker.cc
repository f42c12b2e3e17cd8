#include "worker/worker.h"

#include <nats/nats.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/cpu_quota.h"
#include "common/device.h"
#include "common/json_text.h"
#include "common/log.h"
#include "common/process_memory.h"
#include "runtime/runtime.h"
#include "runtime/torch/huge_pages.h"
#include "tokenize/wordpiece_tokenizer.h"
#include "wire/work_message.h"
#include "worker/consumer_park.h"
#include "worker/device_scheduler.h"
#include "worker/model_manager.h"
#include "worker/model_server.h"

namespace shoal {

int UsableCpus() {
  int n = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int quota = CgroupCpuLimit();
  return quota > 0 ? std::min(n, quota) : n;
}

Status WorkerOptions::Validate() const {
  if (model_repository.empty()) return InvalidArgument("worker: model repository is required");
  if (intra_op_threads < 0) return InvalidArgument("worker: intra_op_threads must be >= 0");
  if (max_batch_tokens < 0) return InvalidArgument("worker: max_batch_tokens must be >= 0 (0: each model's own)");
  if (max_batch_size < 0) return InvalidArgument("worker: max_batch_size must be >= 0 (0: each model's own)");
  if (max_wait_us < -1) return InvalidArgument("worker: max_wait_us must be >= 0, or -1 for each model's own");
  if (fetch_poll_ms < 1) return InvalidArgument("worker: fetch_poll_ms must be >= 1");
  if (heartbeat_interval_ms < 100) return InvalidArgument("worker: heartbeat_interval_ms must be >= 100");
  if (heartbeat_ttl_ms <= heartbeat_interval_ms)
    return InvalidArgument("worker: heartbeat_ttl_ms must exceed heartbeat_interval_ms");
  if (auto d = ParseDevice(device); !d.ok()) return InvalidArgument("worker: " + d.status().message(), "invalid_device");
  if (memory_budget_bytes < 0) return InvalidArgument("worker: memory_budget_bytes must be >= 0");
  if (host_memory_budget_bytes < 0) return InvalidArgument("worker: host_memory_budget_bytes must be >= 0");
  if (host_memory_budget_bytes > 0 && !ParseDevice(device)->cuda)
    return InvalidArgument("worker: a host memory budget is for GPU workers; on the CPU every model counts against "
                           "the memory budget");
  if (max_models < 0) return InvalidArgument("worker: max_models must be >= 0");
  if (device_slots < 0) return InvalidArgument("worker: device_slots must be >= 0");
  if (turn_quantum_ms < 0 || turn_quantum_ms > 3600000)
    return InvalidArgument("worker: turn_quantum_ms must be in 0..3600000");
  if (demand_poll_ms < 10) return InvalidArgument("worker: demand_poll_ms must be >= 10");
  if (claim_ttl_ms < 1000) return InvalidArgument("worker: claim_ttl_ms must be >= 1000");
  if (scale_out_backlog < 0) return InvalidArgument("worker: scale_out_backlog must be >= 0");
  if (retry_failed_after_ms < 0) return InvalidArgument("worker: retry_failed_after_ms must be >= 0");
  if (max_held_rows < 0) return InvalidArgument("worker: max_held_rows must be >= 0");
  if (pull_ahead < 0) return InvalidArgument("worker: pull_ahead must be >= 0");
  if (pull_idle_poll_ms < 1) return InvalidArgument("worker: pull_idle_poll_ms must be >= 1");
  if (load_nice < 0 || load_nice > 19) return InvalidArgument("worker: load_nice must be in 0..19");
  if (auto e = ParseEvictionPolicy(eviction); !e.ok()) return InvalidArgument("worker: " + e.status().message());
  if (load_report_interval_ms != 0 && load_report_interval_ms < 5)
    return InvalidArgument("worker: load_report_interval_ms must be 0 (off) or >= 5");
  RETURN_IF_ERROR(consumer.Validate());
  return stream.Validate();
}

namespace {

using nlohmann::json;

std::string HostName() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

std::string DefaultWorkerId(const std::string& host) {
  std::random_device rd;
  char suffix[8];
  std::snprintf(suffix, sizeof suffix, "%04x", rd() & 0xffff);
  std::string id = host + "-" + std::to_string(::getpid()) + "-" + suffix;
  // KV keys and subject tokens: keep to [-_a-zA-Z0-9].
  for (char& c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '-';
  return id;
}


json ErrorJson(const Status& s) {
  return {{"message", s.message()},
          {"code", std::string(s.ReasonOrDefault())},
          {"kind", std::string(StatusCodeName(s.code()))},
          {"status", HttpStatusFor(s.code())}};
}

}  // namespace

// One live process per worker id: two would share one registry entry (each
// overwriting the other's heartbeat) and one control subject (both acting
// on every command). The id is taken by writing a first entry only if there
// is none: a KV create is atomic, so of two processes started at once with
// one id, one gets it. An entry left by this host's earlier process, now
// gone (or by this very pid: a restarted container), is free to take.
namespace {

// Worker ids held by live Worker objects of this process.
std::mutex& HeldIdsMu() {
  static std::mutex mu;
  return mu;
}
std::set<std::string>& HeldIds() {
  static std::set<std::string> ids;
  return ids;
}

}  // namespace

Status Worker::ReserveId() {
  {
    std::lock_guard<std::mutex> lock(HeldIdsMu());
    if (HeldIds().count(id_))
      return InvalidArgument("worker id '" + id_ + "' is in use by another worker of this process",
                             "worker_id_in_use");
    HeldIds().insert(id_);
    holds_id_ = true;
  }
  const std::string entry = DumpJson(json{{"id", id_},
                                      {"host", host_},
                                      {"pid", ::getpid()},
                                      {"started_unix_ms", started_unix_ms_},
                                      {"heartbeat_unix_ms", SystemClock::Get()->NowUnixMs()},
                                      {"starting", true},
                                      {"models", json::array()}});
  // A few rounds: an entry can expire (or be deleted) between the reads
  // and the conditional writes below, which then only need another try.
  nlohmann::json j;
  std::string host;
  int64_t pid = 0;
  bool live = false;  // a live process's entry holds the id
  for (int round = 0; round < 3 && !live; ++round) {
    auto created = workers_kv_->Create(id_, entry);
    if (!created.ok()) return Status::Ok();  // unreadable: the first heartbeat will say
    if (*created) {
      registered_ = true;  // ours: a start that fails after this deletes it
      return Status::Ok();
    }
    auto v = workers_kv_->GetRevision(id_);
    if (!v.ok() && v.status().code() == StatusCode::kNotFound) continue;  // expired meanwhile
    if (!v.ok()) return Status::Ok();  // unreadable: the first heartbeat will say
    j = nlohmann::json::parse(v->first, nullptr, /*allow_exceptions=*/false);
    host = j.is_object() ? j.value("host", "") : "";
    pid = j.is_object() ? j.value("pid", int64_t{0}) : 0;
    const bool gone = !j.is_object() || (host == host_ && pid > 0 &&
                                         (pid == ::getpid() || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)));
    if (!gone) {
      live = true;
      continue;
    }
    // Only over the entry read: of two processes taking the same gone
    // entry at once, one gets it.
    ASSIGN_OR_RETURN(const bool taken, workers_kv_->Update(id_, entry, v->second));
    if (taken) {
      registered_ = true;
      return Status::Ok();
    }
  }
  if (!live)
    return InvalidArgument("worker id '" + id_ + "' was taken by another process just now", "worker_id_in_use");
  const int64_t age_ms = SystemClock::Get()->NowUnixMs() - j.value("heartbeat_unix_ms", int64_t{0});
  return InvalidArgument("worker id '" + id_ + "' is in use: process " + std::to_string(pid) + " on host '" + host +
                             "' sent a heartbeat " + std::to_string(std::max<int64_t>(0, age_ms)) +
                             " ms ago. Give this worker another --worker-id (or none: a unique one is made), or "
                             "wait until that entry expires (--heartbeat-ttl-ms after its last heartbeat)",
                         "worker_id_in_use");
}

Status Worker::StillHoldsId() const {
  auto v = workers_kv_->Get(id_);
  if (!v.ok()) return Status::Ok();  // expired (or unreadable): nobody else has it either
  return StillHoldsId(*v);
}

Status Worker::StillHoldsId(const std::string& entry) const {
  const json j = json::parse(entry, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Ok();
  if (j.value("host", "") == host_ && j.value("pid", int64_t{0}) == ::getpid() &&
      j.value("started_unix_ms", int64_t{0}) == started_unix_ms_)
    return Status::Ok();
  return InvalidArgument("worker id '" + id_ + "' was taken by process " + std::to_string(j.value("pid", int64_t{0})) +
                             " on host '" + j.value("host", "") +
                             "' while this worker was starting (its first entry expired after --heartbeat-ttl-ms)",
                         "worker_id_in_use");
}

void Worker::PrepareProcess(const WorkerOptions& options) {
  static std::once_flag keep_once, huge_once;
  if (options.keep_freed_memory) {
    std::call_once(keep_once, [] {
      if (!KeepFreedMemory(kKeptBlockBytes, kKeptFreeBytes))
        LOG_WARN("worker", "malloc refused to keep freed memory (M_MMAP_THRESHOLD / M_TRIM_THRESHOLD)");
    });
  }
  if (options.huge_pages) {
    std::call_once(huge_once, [] {
      if (!UseHugePagesForLargeTensors())
        LOG_INFO("worker", "no transparent huge pages for model loads (kernel THP mode: '"
                               << TransparentHugePageMode() << "')");
    });
  }
}

Result<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options, NatsClient* client,
                                               MetricsRegistry* metrics, const Clock* clock) {
  RETURN_IF_ERROR(options.Validate());
  // A GPU this build cannot use fails the start, not every model's load.
  RETURN_IF_ERROR(CheckComputeDevice(options.device));
  if (clock == nullptr) clock = SystemClock::Get();
  auto w = std::unique_ptr<Worker>(new Worker());
  w->options_ = options;
  const Device device = ParseDevice(options.device).value();
  w->options_.device = device.ToString();
  w->on_gpu_ = device.cuda;
  w->host_ = HostName();
  w->id_ = options.worker_id.empty() ? DefaultWorkerId(w->host_) : options.worker_id;
  w->client_ = client;
  w->metrics_ = metrics;
  w->clock_ = clock;
  w->started_unix_ms_ = clock->NowUnixMs();

  RETURN_IF_ERROR(EnsureWorkStream(*client, options.stream));
  ASSIGN_OR_RETURN(w->workers_kv_, KvBucket::Open(*client, wire::kWorkersBucket, options.heartbeat_ttl_ms));
  if (w->workers_kv_->ttl_ms() <= options.heartbeat_interval_ms) {
    return InvalidArgument("the registry bucket " + std::string(wire::kWorkersBucket) + " keeps an entry for " +
                           std::to_string(w->workers_kv_->ttl_ms()) + " ms, no longer than this worker's " +
                           std::to_string(options.heartbeat_interval_ms) +
                           " ms between heartbeats: it would vanish from the registry between them. Use a "
                           "--heartbeat-ms below that, or delete the bucket to let it be made again",
                       "kv_bucket_mismatch");
  }
  RETURN_IF_ERROR(w->ReserveId());
  if (!options.blob.store_url.empty()) {
    BlobOffloadOptions bo = options.blob;
    bo.sweep_interval_ms = 0;  // gateways sweep
    ASSIGN_OR_RETURN(w->blob_, BlobOffload::Create(bo, client, metrics, clock));
    w->fetched_payloads_ = std::make_unique<ByteBudget>(
        bo.max_fetched_bytes,
        metrics->GetGauge("shoal_worker_blob_fetched_bytes",
                          "Offloaded payload bytes this worker holds, fetched from the blob store and not yet answered."));
  }
  ASSIGN_OR_RETURN(w->models_kv_, KvBucket::Open(*client, wire::kModelsBucket, 0));
  ASSIGN_OR_RETURN(w->placement_kv_, KvBucket::Open(*client, wire::kPlacementBucket, options.claim_ttl_ms));

  PrepareProcess(options);
  ASSIGN_OR_RETURN(std::vector<ModelConfig> selected, SelectModels(options));
  const int cpus = UsableCpus();
  for (ModelConfig& config : selected) {
    if (config.runtime == "torchscript") config.device = w->options_.device;
    if (config.intra_op_threads == 0)
      config.intra_op_threads = cpus;
    Backlog& b = w->backlog_[config.name];
    b.msgs_gauge = metrics->GetGauge("shoal_worker_model_backlog",
                                     "Messages held in the work stream for a model (waiting or in flight).",
                                     {{"model", config.name}});
    b.age_gauge = metrics->GetGauge("shoal_worker_model_oldest_wait_seconds",
                                    "Age of the oldest message held in the work stream for a model.",
                                    {{"model", config.name}});
  }
  w->catalog_ = selected;
  for (const ModelConfig& c : selected)
    if (c.runtime != "torchscript") w->host_memory_models_.insert(c.name);
  w->claims_won_ = metrics->GetCounter("shoal_worker_placement_claims_total",
                                       "Placement claims for cold models, by result.", {{"result", "won"}});
  w->claims_lost_ = metrics->GetCounter("shoal_worker_placement_claims_total",
                                        "Placement claims for cold models, by result.", {{"result", "lost"}});
  w->device_faults_ = metrics->GetCounter("shoal_worker_device_faults_total",
                                          "Times this worker's device failed for the rest of the process "
                                          "(the worker then stops; at most 1).");
  w->drained_ = metrics->GetCounter("shoal_worker_load_failed_answers_total",
                                    "Waiting work answered with a model's load error.");

  DeviceSchedulerOptions so;
  // 0: one slot per core, and a pass takes as many as it finds free (see
  // ModelServerDeps::slots_are_cores).
  w->slots_are_cores_ = options.device_slots == 0;
  so.slots = w->slots_are_cores_ ? cpus : options.device_slots;
  RETURN_IF_ERROR(so.Validate());
  w->scheduler_ = std::make_unique<DeviceScheduler>(so, clock);
  w->held_rows_ = std::make_unique<HeldRows>(options.max_held_rows);
  w->pull_gate_ = std::make_unique<PullGate>(options.pull_ahead);
  ConsumerParkOptions po;
  po.client = client;
  po.metrics = metrics;
  po.worker_id = w->id_;
  po.max_deliver = options.consumer.max_deliver;
  w->park_ = std::make_unique<ConsumerPark>(po);
  // Three notes per AckWait: one lost note does not cost the message.
  w->progress_ = std::make_unique<ProgressKeeper>(client, std::max<int64_t>(1, options.consumer.ack_wait_ms / 3));

  ModelManagerOptions mo;
  mo.memory_budget_bytes = options.memory_budget_bytes;
  if (w->on_gpu_) {
    // Only TorchScript models are given the GPU (above); the rest keep
    // their memory on the host.
    mo.in_host_memory = [gpu = w->options_.device](const ModelConfig& c) { return c.device != gpu; };
    mo.host_memory_budget_bytes = options.host_memory_budget_bytes;
  }
  mo.pinned = options.pinned;
  mo.max_models = options.max_models;
  ASSIGN_OR_RETURN(mo.eviction, ParseEvictionPolicy(options.eviction));
  mo.retry_failed_after_us = options.retry_failed_after_ms * 1000;
  Worker* self = w.get();
  w->manager_ = std::make_unique<ModelManager>(
      mo, selected, [self](const ModelConfig& c) { return self->LoadModel(c); }, clock, metrics);
  w->manager_raw_ = w->manager_.get();
  // Peers see a load as soon as it starts, one begun after waiting for
  // room (an operator's) too, and leave the model to this worker.
  w->manager_->SetOnLoadStart([self](const std::string&) { self->WakeHeartbeat(/*demand=*/false); });
  // A load finished: the next cold model may start at once.
  w->manager_->SetOnChange([self] { self->WakeHeartbeat(/*demand=*/true); });
  // Heartbeats from now on: peers see the pinned and preloaded models
  // loading below (they would load them too), and a long start does not
  // let the entry expire.
  w->heartbeat_ = std::thread([self] { self->HeartbeatLoop(); });

  for (const ModelConfig& c : w->catalog_) {
    RETURN_IF_ERROR(w->models_kv_->Put(wire::ModelKvKey(c.name), ModelConfigToJson(c)));
  }
  RETURN_IF_ERROR(w->manager_->Start());
  std::vector<std::string> preload = options.preload;
  if (options.PreloadsAll()) {
    preload.clear();
    for (const ModelConfig& c : w->catalog_) preload.push_back(c.name);
  }
  for (const std::string& name : preload) {
    if (std::find(options.pinned.begin(), options.pinned.end(), name) != options.pinned.end()) continue;
    Status s = w->manager_->Preload(name);  // a name not in the catalog was refused by SelectModels
    if (s.reason() == "no_room_for_model") {
      LOG_INFO("worker", "not preloading " << name << ": " << s.message());
    } else if (!s.ok()) {
      LOG_WARN("worker", "preloading " << name << ": " << s.ToString());
    }
  }

  // The entry ReserveId wrote may have expired during a long start (model
  // loads), and another process taken the id meanwhile: then this one
  // gives it up rather than overwrite the other's entry.
  {
    // Under the heartbeats' lock: one under way lands first, and none is
    // written unconditionally unless this entry is written here. A start
    // refused here leaves starting_ set, so the heartbeats left before the
    // worker stops write nothing over the other process's entry.
    std::lock_guard<std::mutex> lock(w->publish_mu_);
    if (Status lost = w->StillHoldsId(); !lost.ok()) {
      w->registered_ = false;
      return lost;
    }
    RETURN_IF_ERROR(w->workers_kv_->Put(w->id_, w->HeartbeatJson()));
    w->starting_ = false;
    w->registered_ = true;
  }
  // Only now: an operator action (which publishes a heartbeat) or pushed
  // work addressed to this id during the start could be another process's
  // once the id had been taken. Until here they get NATS's "no responders".
  ASSIGN_OR_RETURN(w->control_sub_, client->Subscribe(wire::ControlSubject(w->id_), &Worker::OnControl, self));
  ASSIGN_OR_RETURN(w->push_sub_,
                   client->Subscribe(wire::kPushSubjectPrefix + w->id_ + ".>", &Worker::OnPush, self));
  ASSIGN_OR_RETURN(w->cancel_sub_, client->Subscribe(wire::kCancelSubject, &Worker::OnCancel, self));
  // The server has them before Create returns: an action sent next finds
  // this worker (a failed flush leaves them to the client's next write).
  (void)client->Flush(2000);
  w->demand_ = std::thread([self] { self->DemandLoop(); });
  if (options.load_report_interval_ms > 0) w->load_report_ = std::thread([self] { self->LoadReportLoop(); });
  LOG_INFO("worker", "worker " << w->id_ << ": " << w->LoadedModels().size() << " of " << w->catalog_.size()
                               << " model(s) loaded");
  return w;
}

Result<std::vector<ModelConfig>> Worker::SelectModels(const WorkerOptions& options) {
  ASSIGN_OR_RETURN(auto configs, LoadModelRepository(options.model_repository));
  std::vector<ModelConfig> selected;
  for (const auto& name : options.models) {
    auto it = std::find_if(configs.begin(), configs.end(), [&](const ModelConfig& c) { return c.name == name; });
    if (it == configs.end())
      return NotFound("model '" + name + "' is not in repository " + options.model_repository, "model_not_found");
    selected.push_back(*it);
  }
  if (options.models.empty()) selected = configs;
  if (selected.empty()) return NotFound("no models in repository " + options.model_repository);
  // The worker's flags over each model's shoal.json, checked again: a flag
  // can make a valid config invalid (--max-batch-tokens below max_seq_len).
  // --runtime replaces the runtime of text models only; OCR and generate
  // models keep theirs (null and sim compute vectors from tokens).
  std::string flags;
  const auto flag = [&flags](const std::string& name, const std::string& value) { flags += " " + name + " " + value; };
  if (!options.runtime_override.empty()) flag("--runtime", options.runtime_override);
  if (options.intra_op_threads > 0) flag("--threads", std::to_string(options.intra_op_threads));
  if (options.max_batch_tokens > 0) flag("--max-batch-tokens", std::to_string(options.max_batch_tokens));
  if (options.max_batch_size > 0) flag("--max-batch-size", std::to_string(options.max_batch_size));
  if (options.max_wait_us >= 0) flag("--max-wait-us", std::to_string(options.max_wait_us));
  for (ModelConfig& config : selected) {
    if (!options.runtime_override.empty() && !config.ItemTask()) config.runtime = options.runtime_override;
    if (options.intra_op_threads > 0) config.intra_op_threads = options.intra_op_threads;
    if (options.max_batch_tokens > 0) config.batching.max_batch_tokens = options.max_batch_tokens;
    if (options.max_batch_size > 0) config.batching.max_batch_size = options.max_batch_size;
    if (options.max_wait_us >= 0) config.batching.max_wait_us = options.max_wait_us;
    if (Status s = config.Validate(); !s.ok()) {
      if (flags.empty()) return s;
      return Status(s.code(), s.message() + " (with this worker's flags:" + flags + ")", s.reason());
    }
  }
  const auto served = [&](const std::string& name) {
    return std::any_of(selected.begin(), selected.end(), [&](const ModelConfig& c) { return c.name == name; });
  };
  for (const std::string& name : options.pinned)
    if (!served(name)) return NotFound("--pin: model '" + name + "' is not in this worker's catalog", "model_not_found");
  const bool all = options.PreloadsAll();
  for (const std::string& name : options.preload)
    if (!all && !served(name))
      return NotFound("--preload: model '" + name + "' is not in this worker's catalog", "model_not_found");
  return selected;
}

Worker::~Worker() { Stop(); }

void Worker::Stop() {
  {
    std::lock_guard<std::mutex> lock(hb_mu_);
    if (stop_.exchange(true)) return;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (demand_.joinable()) demand_.join();
  if (load_report_.joinable()) load_report_.join();
  ReleaseAllClaims();
  control_sub_.reset();
  cancel_sub_.reset();
  push_sub_.reset();  // no pushed work arrives after this; what was pushed is answered below
  {
    std::lock_guard<std::mutex> lock(push_mu_);  // a push in progress finishes first
    push_closed_ = true;
  }
  { std::lock_guard<std::mutex> wait_for_control(control_mu_); }  // one in progress finishes first
  if (scheduler_) scheduler_->Shutdown();
  if (pull_gate_) pull_gate_->Shutdown();
  manager_.reset();  // stops every model's threads, then unloads
  if (park_) {
    for (auto& [model, consumer] : drain_consumers_) park_->Park(model, std::move(consumer));
    park_->CloseAll();  // waits for the last pulls to expire (at most --fetch-poll-ms)
  }
  drain_consumers_.clear();
  // Only an entry this worker wrote: a start refused for an id in use must
  // not delete the entry of the live worker that holds it.
  if (workers_kv_ && registered_) (void)workers_kv_->Delete(id_);
  (void)client_->Flush(1000);
  if (holds_id_) {
    std::lock_guard<std::mutex> lock(HeldIdsMu());
    HeldIds().erase(id_);
    holds_id_ = false;
  }
}

std::vector<std::string> Worker::ModelNames() const {
  std::vector<std::string> out;
  for (const auto& c : catalog_) out.push_back(c.name);
  return out;
}

std::vector<std::string> Worker::LoadedModels() const {
  std::vector<std::string> out;
  for (const ModelStatus& s : manager_->Statuses())
    if (s.state == ModelState::kLoaded) out.push_back(s.name);
  return out;
}

Result<std::unique_ptr<PullConsumer>> Worker::CreateConsumer(const std::string& model) {
  // A JetStream API call that times out or finds NATS away (a restart, a
  // leader election) says nothing about the model: failing its load would
  // keep it failed for retry_failed_after_ms. Real time, not clock_: a fake
  // clock in a test would never end the wait.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(kConsumerRetryMs);
  int64_t delay_ms = 100;
  while (true) {
    auto consumer = PullConsumer::Create(*client_, options_.stream.name, wire::WorkSubject(model),
                                         wire::ConsumerName(model), options_.consumer);
    if (consumer.ok()) return consumer;
    const Status& s = consumer.status();
    const bool transient = (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) &&
                           s.reason() != "jetstream_unavailable";
    if (!transient || stop_ || std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms) >= give_up)
      return s;
    LOG_WARN("worker", "creating the consumer of " << model << ": " << s.ToString() << "; trying again in "
                                                     << delay_ms << " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    delay_ms = std::min<int64_t>(delay_ms * 2, 2000);
  }
}

Result<std::unique_ptr<LoadedModel>> Worker::LoadModel(const ModelConfig& config) {
  ASSIGN_OR_RETURN(auto runtime, options_.runtime_factory ? options_.runtime_factory(config)
                                                          : CreateRuntime(config.runtime));
  const int64_t t0 = clock_->NowMonoUs();
  const int64_t rss_before = ResidentBytes();
  // Load on a thread that ends with the load: libtorch's warm-up passes
  // would otherwise leave an idle OpenMP team on the loader thread for the
  // life of the process, and two teams on the same cores throttle each
  // other (docs/BENCHMARKS.md, "What limits the ratio").
  Status loaded;
  std::thread([&] {
    // Linux: a nice value is per thread and inherited by the threads this one
    // starts (libtorch's OpenMP team for the warm-up passes, which ends with
    // this thread). Only for TorchScript: other runtimes start threads or
    // processes here that serve for as long as the model is resident (the
    // process runtime's supervisor and its child), and an unprivileged
    // process cannot give them their priority back.
    if (options_.load_nice > 0 && config.runtime == "torchscript" &&
        setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), options_.load_nice) != 0) {
      LOG_WARN("worker", "cannot lower the priority of the loader thread: " << std::strerror(errno));
    }
    try {
      loaded = runtime->Load(config);
    } catch (const std::exception& e) {  // an exception here would end the process
      loaded = Internal(std::string("runtime threw: ") + e.what());
    } catch (...) {
      loaded = Internal("runtime threw");
    }
  }).join();
  if (!loaded.ok())
    return Status(loaded.code(), "loading model '" + config.name + "': " + loaded.message(), loaded.reason());
  const int64_t t_runtime = clock_->NowMonoUs();
  // The real footprint: what the load added to the process, but never less
  // than the runtime's own count (memory reused from an evicted model does
  // not show in the resident set). On a GPU, the runtime's count alone: the
  // budget is GPU memory, and the host memory a GPU load touches (the CUDA
  // context, the file read before its copy to the device) is not the GPU's.
  const int64_t measured = runtime->FootprintIsHostMemory()
                               ? std::max<int64_t>(ResidentBytes() - rss_before, runtime->MemoryBytes())
                               : runtime->MemoryBytes();

  ModelConfig c = config;
  if (c.dim == 0) {
    c.dim = runtime->Dim();
    (void)models_kv_->Put(wire::ModelKvKey(c.name), ModelConfigToJson(c));
  }
  // Runtimes that take whole inputs (OCR, remote backends) need no vocab.
  std::unique_ptr<WordPieceTokenizer> tokenizer;
  if (!runtime->TakesItems()) {
    WordPieceOptions to;
    to.lowercase = c.tokenizer.lowercase;
    to.strip_accents = c.tokenizer.strip_accents;
    to.tokenize_chinese_chars = c.tokenizer.tokenize_chinese_chars;
    ASSIGN_OR_RETURN(tokenizer, WordPieceTokenizer::FromFile(c.VocabPath(), to));
  }
  const int64_t t_tokenizer = clock_->NowMonoUs();
  // The subscription it had when it last stopped here, if still open: what
  // the server delivered to it since is this load's first work.
  std::unique_ptr<PullConsumer> consumer = park_->Take(c.name);
  if (!consumer) {
    ASSIGN_OR_RETURN(consumer, CreateConsumer(c.name));
  }
  const int64_t t_consumer = clock_->NowMonoUs();
  auto m = std::make_unique<LoadedModel>();
  m->config = c;
  m->memory_bytes = measured;
  m->runtime = std::move(runtime);

  ModelServerDeps deps;
  deps.config = c;
  deps.runtime = m->runtime.get();
  deps.tokenizer = std::move(tokenizer);
  deps.consumer = std::move(consumer);
  ConsumerPark* park = park_.get();
  deps.park = [park, name = c.name](std::unique_ptr<PullConsumer> parked) { park->Park(name, std::move(parked)); };
  deps.client = client_;
  deps.metrics = metrics_;
  deps.clock = clock_;
  deps.worker_id = id_;
  deps.fetch_poll_ms = options_.fetch_poll_ms;
  deps.ack_wait_ms = options_.consumer.ack_wait_ms;
  deps.max_deliver = options_.consumer.max_deliver;
  deps.scheduler = scheduler_.get();
  deps.slots_are_cores = slots_are_cores_;
  deps.blob = blob_.get();
  deps.fetched_payloads = fetched_payloads_.get();
  const std::string name = c.name;
  // The manager itself, not manager_: Stop() resets manager_ (null) while
  // the manager's destructor still stops this server.
  ModelManager* manager = manager_raw_;
  deps.on_batch = [manager, name] { manager->Touch(name); };
  deps.backlog = [this, name] {
    std::lock_guard<std::mutex> lock(backlog_mu_);
    return static_cast<int64_t>(backlog_[name].msgs);
  };
  deps.loaded_unix_ms = clock_->NowUnixMs();
  deps.busy_us = &busy_us_;
  deps.held_rows = held_rows_.get();
  // The bound counts passes waiting for this worker's device: a model whose
  // upstream computes (openai) does not wait for it, nor hold it back.
  deps.pull_gate = m->runtime->UsesDevice() ? pull_gate_.get() : nullptr;
  deps.progress = progress_.get();
  deps.cancelled = &cancelled_;
  deps.idle_poll_ms = options_.pull_idle_poll_ms;
  deps.turn_quantum_us = options_.turn_quantum_ms * 1000;
  // Started by the manager once it keeps the model (ModelAttachment::Start):
  // a model that measures over the budget is unloaded again having pulled
  // nothing.
  m->attachment = std::make_unique<ModelServer>(std::move(deps));
  const int64_t t_end = clock_->NowMonoUs();
  LOG_INFO("worker", "loaded " << c.name << " (" << c.runtime << ", dim " << c.dim << ", " << measured / (1 << 20)
                               << " MiB measured) in " << (t_end - t0) / 1000 << " ms (runtime "
                               << (t_runtime - t0) / 1000 << ", tokenizer " << (t_tokenizer - t_runtime) / 1000
                               << ", consumer " << (t_consumer - t_tokenizer) / 1000 << ", server "
                               << (t_end - t_consumer) / 1000 << ")");
  return m;
}

// ----- Registry --------------------------------------------------------------

std::string Worker::ModelStatusJson(const std::string& model) const {
  for (const ModelStatus& s : manager_->Statuses()) {
    if (s.name != model) continue;
    json j = {{"worker", id_},
              {"model", s.name},
              {"state", std::string(ModelStateName(s.state))},
              {"pinned", s.pinned},
              {"memory_bytes", s.memory_bytes},
              {"measured_bytes", s.measured_bytes},
              {"last_used_unix_ms", s.last_used_unix_ms}};
    if (!s.error.empty()) j["error"] = s.error;
    return DumpJson(j);
  }
  return "{}";
}

std::string Worker::HeartbeatJson(bool starting) const {
  json models = json::array();
  {
    std::lock_guard<std::mutex> lock(backlog_mu_);
    for (const ModelStatus& s : manager_->Statuses()) {
      json m = {{"name", s.name},
                {"state", std::string(ModelStateName(s.state))},
                {"pinned", s.pinned},
                {"memory_bytes", s.memory_bytes},
                {"measured_bytes", s.measured_bytes},
                {"last_used_unix_ms", s.last_used_unix_ms}};
      if (!s.error.empty()) m["error"] = s.error;
      auto it = backlog_.find(s.name);
      if (it != backlog_.end() && it->second.msgs > 0) {
        m["backlog"] = it->second.msgs;
        if (it->second.oldest_unix_ms > 0) m["oldest_unix_ms"] = it->second.oldest_unix_ms;
      }
      models.push_back(std::move(m));
    }
  }
  json j = {{"id", id_},
            {"host", host_},
            {"pid", ::getpid()},
            {"started_unix_ms", started_unix_ms_},
            {"heartbeat_unix_ms", SystemClock::Get()->NowUnixMs()},
            {"memory_used_bytes", manager_->memory_used_bytes()},
            {"memory_budget_bytes", options_.memory_budget_bytes},
            {"device", options_.device},
            {"max_models", options_.max_models},
            {"device_slots", scheduler_->slots()},
            {"busy_seconds", busy_seconds()},
            {"models", models}};
  if (on_gpu_) {
    j["host_memory_used_bytes"] = manager_->host_memory_used_bytes();
    j["host_memory_budget_bytes"] = options_.host_memory_budget_bytes;
  }
  if (starting) j["starting"] = true;
  return DumpJson(j);
}

std::string Worker::LoadReportJson() const {
  json j = {{"id", id_},
            {"unix_ms", SystemClock::Get()->NowUnixMs()},
            {"outstanding_rows", held_rows_->count()},
            {"busy_seconds", busy_seconds()},
            {"device_slots", scheduler_->slots()},
            {"interval_ms", options_.load_report_interval_ms},
            // A failed device takes no pushed work (OnPush refuses it).
            {"models", device_faulted_ ? std::vector<std::string>{} : LoadedModels()}};
  return DumpJson(j);
}

void Worker::LoadReportLoop() {
  const std::string subject = wire::LoadSubject(id_);
  std::unique_lock<std::mutex> lock(hb_mu_);
  while (!stop_) {
    hb_cv_.wait_for(lock, std::chrono::milliseconds(options_.load_report_interval_ms), [this] { return stop_.load(); });
    if (stop_) break;
    lock.unlock();
    (void)client_->Publish(subject, LoadReportJson());
    lock.lock();
  }
}

void Worker::OnPush(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
  auto* self = static_cast<Worker*>(closure);
  Delivery delivery = Delivery::Core(msg);  // owns msg
  const std::string_view subject = natsMsg_GetSubject(msg);
  const std::string prefix = wire::kPushSubjectPrefix + self->id_ + ".";
  auto model = subject.size() > prefix.size() ? wire::TokenToModel(subject.substr(prefix.size()))
                                              : Result<std::string>(InvalidArgument("no model in subject"));
  wire::WorkHeaders headers;
  if (Status st = ParseWorkHeaders(delivery, &headers); !st.ok()) {
    LOG_WARN("worker", "dropping malformed pushed message: " << st.message());
    if (!headers.request_id.empty()) PublishErrorReply(*self->client_, headers, st, self->id_);
    return;
  }
  if (!model.ok()) {
    PublishErrorReply(*self->client_, headers, InvalidArgument("bad push subject"), self->id_);
    return;
  }
  // Only a loaded model takes pushed work (the gateway sends it only where
  // the load reports say it is loaded); never start a load for it here.
  Status refused = Unavailable("model '" + *model + "' is not loaded on worker " + self->id_ + "; retry",
                               "model_not_loaded_here");
  std::lock_guard<std::mutex> lock(self->push_mu_);
  if (self->push_closed_ || self->stop_ || self->device_faulted_) {
    PublishErrorReply(*self->client_, headers, refused, self->id_);
    return;
  }
  auto lease = self->manager_raw_->TryAcquire(*model);
  if (!lease.ok() || lease->model().attachment == nullptr) {
    PublishErrorReply(*self->client_, headers, refused, self->id_);
    return;
  }
  static_cast<ModelServer*>(lease->model().attachment.get())->Push(std::move(delivery));
}

Status Worker::PublishHeartbeat() {
  std::lock_guard<std::mutex> lock(publish_mu_);
  if (device_faulted_) return Status::Ok();  // gone from the registry for good
  if (starting_) {
    // Still in Create (pinned and preloaded models loading): the entry is
    // kept alive, and shows those loads to peers, but only over an entry
    // that is still this process's (Create checks that again at its end).
    const std::string hb = HeartbeatJson(/*starting=*/true);
    auto v = workers_kv_->GetRevision(id_);
    if (!v.ok() && v.status().code() == StatusCode::kNotFound) {
      // Gone (never written, or expired while NATS was away): written again
      // only if nobody has it (atomic), so never over another's entry.
      auto created = workers_kv_->Create(id_, hb);
      if (!created.ok()) LOG_WARN("worker", "starting heartbeat failed: " << created.status().ToString());
      return created.status();
    }
    if (!v.ok()) {
      LOG_WARN("worker", "starting heartbeat failed: " << v.status().ToString());
      return v.status();
    }
    if (StillHoldsId(v->first).code() != StatusCode::kOk) return Status::Ok();  // another's: Create refuses at its end
    return workers_kv_->Update(id_, hb, v->second).status();
  }
  Status s = workers_kv_->Put(id_, HeartbeatJson());
  if (!s.ok()) LOG_WARN("worker", "heartbeat failed: " << s.ToString());
  return s;
}

void Worker::HeartbeatLoop() {
  std::unique_lock<std::mutex> lock(hb_mu_);
  while (!stop_) {
    hb_cv_.wait_for(lock, std::chrono::milliseconds(options_.heartbeat_interval_ms), [this] { return stop_ || hb_now_; });
    if (stop_) break;
    hb_now_ = false;
    lock.unlock();
    (void)PublishHeartbeat();  // logged; the next round tries again
    lock.lock();
  }
}

const std::map<std::string, std::vector<Worker::PeerModel>>& Worker::Peers(bool fresh) {
  const int64_t now = clock_->NowMonoUs();
  if (!fresh && now - peers_read_mono_us_ < options_.heartbeat_interval_ms * 500) return peers_;
  // A read that fails (a timeout) keeps the last view, until the next round:
  // a view without a peer would have this worker load what the peer serves.
  auto entries = workers_kv_->Entries();
  if (!entries.ok()) return peers_;
  // On a GPU peer only TorchScript models live in GPU memory; the others
  // take its host memory budget (as on this worker).
  std::map<std::string, std::vector<PeerModel>> peers;
  for (const auto& [key, value] : *entries) {
    if (key == id_) continue;
    try {
      json j = json::parse(value);
      const int64_t device_budget = j.value("memory_budget_bytes", int64_t{0});
      const int64_t host_budget = j.value("host_memory_budget_bytes", int64_t{0});
      const bool gpu_peer = j.value("device", std::string("cpu")) != "cpu";
      const auto left = [](int64_t budget, int64_t used) {
        return budget > 0 ? budget - used : std::numeric_limits<int64_t>::max();
      };
      const int64_t device_free = left(device_budget, j.value("memory_used_bytes", int64_t{0}));
      const int64_t host_free = left(host_budget, j.value("host_memory_used_bytes", int64_t{0}));
      const json models = j.value("models", json::array());
      int resident = 0;
      bool loading = j.value("starting", false);
      for (const json& m : models) {
        const std::string state = m.value("state", "");
        resident += state == "loaded" || state == "loading";
        loading = loading || state == "loading";
      }
      const int64_t max_models = j.value("max_models", int64_t{0});
      const bool count_full = max_models > 0 && resident >= max_models;
      for (const json& m : models) {
        const std::string name = m.value("name", "");
        const bool in_host = gpu_peer && host_memory_models_.count(name) > 0;
        peers[name].push_back({key, m.value("state", ""), in_host ? host_budget : device_budget,
                               in_host ? host_free : device_free, count_full, loading});
      }
    } catch (const std::exception& e) {
      LOG_WARN("worker", "unreadable heartbeat of " << key << ": " << e.what());
    }
  }
  peers_ = std::move(peers);
  peers_read_mono_us_ = now;
  return peers_;
}

bool Worker::Claim(const std::string& model, int replica) {
  const std::string key = wire::ModelKvKey(model) + "." + std::to_string(replica);
  auto created = placement_kv_->Create(key, id_);
  if (!created.ok()) {
    LOG_WARN("worker", "placement claim " << key << ": " << created.status().ToString());
    return false;
  }
  if (!*created) {
    auto holder = placement_kv_->Get(key);
    if (holder.ok() && *holder == id_) {
      // Ours from an earlier round (its delete failed, or this worker took
      // over its id): given back once the load settles, like a new one.
      held_claims_[key] = model;
      return true;
    }
    claims_lost_->Inc();
    return false;
  }
  claims_won_->Inc();
  held_claims_[key] = model;
  return true;
}

void Worker::WakeHeartbeat(bool demand) {
  {
    std::lock_guard<std::mutex> lock(hb_mu_);
    hb_now_ = true;
    if (demand) demand_now_ = true;
  }
  hb_cv_.notify_all();
}

bool Worker::GiveBackClaim(const std::string& key) {
  // Deleted only at the revision read as ours. A claim may have expired
  // and been taken by a peer since (after a delete that timed out, say),
  // and a delete that timed out may still reach the server later (nats.c
  // sends what it buffered once reconnected): neither removes a peer's.
  auto held = placement_kv_->GetRevision(key);
  if (!held.ok()) return held.status().code() == StatusCode::kNotFound;  // gone: given back; else try again
  if (held->first != id_) return true;                                   // a peer's now
  auto deleted = placement_kv_->DeleteAtRevision(key, held->second);
  return deleted.ok();  // deleted, or written since (by a peer): given back either way
}

void Worker::ReleaseAllClaims() {
  for (const auto& [key, model] : held_claims_) (void)GiveBackClaim(key);
  held_claims_.clear();
}

void Worker::ReleaseSettledClaims() {
  if (held_claims_.empty()) return;
  std::map<std::string, ModelState> states;
  for (const ModelStatus& s : manager_->Statuses()) states[s.name] = s.state;
  bool published = false;
  for (auto it = held_claims_.begin(); it != held_claims_.end();) {
    if (states[it->second] == ModelState::kLoading) {
      ++it;
      continue;
    }
    if (!published) {
      // Peers see the outcome before the claim goes; while the registry
      // cannot be written, the claims stay (tried again at the next poll):
      // without them a peer reading the older heartbeat would load the
      // model a second time.
      if (!PublishHeartbeat().ok()) return;
      published = true;
    }
    // Kept on a failed delete (a timeout), and tried again at the next poll.
    it = GiveBackClaim(it->first) ? held_claims_.erase(it) : std::next(it);
  }
}

// ----- Demand: lazy loading and placement -------------------------------------

void Worker::DemandLoop() {
  std::unique_lock<std::mutex> lock(hb_mu_);
  while (!stop_) {
    hb_cv_.wait_for(lock, std::chrono::milliseconds(options_.demand_poll_ms),
                    [this] { return stop_.load() || demand_now_; });
    if (stop_) break;
    demand_now_ = false;
    lock.unlock();
    PollDemand();
    lock.lock();
  }
}

bool Worker::DeviceFaulted() {
  if (device_faulted_) return true;
  const Status fault = manager_->DeviceHealth();
  if (fault.ok()) return false;
  {
    std::lock_guard<std::mutex> lock(publish_mu_);  // a heartbeat being published lands first
    device_faulted_ = true;
  }
  LOG_ERROR("worker", "device " << options_.device << " has failed: " << fault.message()
                                << "; this worker takes no more work and leaves the registry");
  // Peers must not wait for this worker's heartbeat to expire, or for its
  // claims, before they load its models: its work is theirs now.
  ReleaseAllClaims();
  (void)workers_kv_->Delete(id_);
  device_faults_->Inc();
  if (options_.on_device_fault) options_.on_device_fault(fault);
  return true;
}

void Worker::PollDemand() {
  // Nothing loads on a failed device, and no waiting work is answered with
  // an error that is not the model's: other workers serve it.
  if (DeviceFaulted()) return;
  // A model whose runtime gave up for good is failed, not left loaded and
  // idle: its waiting work gets model_load_failed below (unless a worker
  // that has it loaded serves it). The manager's change hook announces it.
  manager_->FailUnhealthy();
  ReleaseSettledClaims();
  auto counts = GetSubjectCounts(*client_, options_.stream.name, wire::kWorkSubjectPrefix + std::string(">"));
  if (!counts.ok()) {
    LOG_DEBUG("worker", "reading the backlog: " << counts.status().ToString());
    return;
  }
  const int64_t now_mono = clock_->NowMonoUs();
  const int64_t now_ms = clock_->NowUnixMs();
  const bool read_oldest = now_mono - oldest_read_mono_us_ >= 1'000'000;
  if (read_oldest) oldest_read_mono_us_ = now_mono;
  std::map<std::string, uint64_t> waiting;  // models with work in the stream
  for (const ModelConfig& c : catalog_) {
    auto it = counts->find(wire::WorkSubject(c.name));
    const uint64_t msgs = it == counts->end() ? 0 : it->second;
    int64_t oldest = 0;
    bool have_oldest = false;
    if (msgs > 0 && read_oldest) {
      auto o = OldestMessageUnixMs(*client_, options_.stream.name, wire::WorkSubject(c.name));
      if (o.ok()) oldest = *o;
      have_oldest = true;
    }
    std::lock_guard<std::mutex> lock(backlog_mu_);
    Backlog& b = backlog_[c.name];
    b.msgs = msgs;
    if (msgs == 0) b.oldest_unix_ms = 0;
    if (have_oldest) b.oldest_unix_ms = oldest;
    if (msgs > 0 && b.oldest_unix_ms == 0) b.oldest_unix_ms = now_ms;  // first seen; read exactly within 1 s
    b.msgs_gauge->Set(static_cast<double>(msgs));
    b.age_gauge->Set(b.oldest_unix_ms > 0 ? static_cast<double>(std::max<int64_t>(0, now_ms - b.oldest_unix_ms)) / 1e3
                                          : 0.0);
    if (msgs > 0) waiting[c.name] = msgs;
  }
  if (waiting.empty()) return;

  std::map<std::string, ModelStatus> here;
  for (ModelStatus& s : manager_->Statuses()) here[s.name] = std::move(s);
  bool changed = false;
  struct Candidate {
    std::string model;
    uint64_t msgs = 0;
    int replica = 0;
    double priority = 0;
    bool failed = false;  // failed to load here or on a peer: goes after the others
    double age_ms = 0;    // of its oldest waiting work (set with the priority)
  };
  std::vector<Candidate> candidates;
  for (const auto& [model, msgs] : waiting) {
    if (stop_) return;
    const ModelStatus& st = here[model];
    static const std::vector<PeerModel> kNobody;
    const auto& peers = Peers(false);
    const auto it = peers.find(model);
    const std::vector<PeerModel>& holders = it == peers.end() ? kNobody : it->second;
    const auto count = [&](const char* state) {
      return std::count_if(holders.begin(), holders.end(), [&](const PeerModel& p) { return p.state == state; });
    };
    const int64_t serving = ServingPeers(peers, model);
    // Loaded or loading here: this worker serves it. Waiting work counts as
    // use, so a model with work in the queue is not the one evicted. (Extra
    // replicas are decided by the workers that do not have it, below.)
    if (st.state == ModelState::kLoaded) manager_->Touch(model);
    if (st.state == ModelState::kLoading || st.state == ModelState::kLoaded) {
      ParkDrainConsumer(model);
      no_room_logged_mono_us_.erase(model);
      gave_up_unix_ms_.erase(model);
      continue;
    }
    if (st.state == ModelState::kFailed) {
      if (serving > 0) continue;  // served elsewhere
      if (st.retry_due) {  // retried under the placement claim, one worker at a time
        candidates.push_back({model, msgs, 0, 0, true});
        continue;
      }
      // Its error, read again: a retry that fell due since goes through the
      // claim at the next poll, never from here (unclaimed, it could run on
      // several workers at once).
      Status s = manager_->LoadError(model);
      if (!s.ok() && !AnotherMayLoad(model, now_ms)) DrainFailed(model, s, 256);
      continue;
    }
    // Not loaded here: a candidate if nobody serves it (a model that failed
    // to load elsewhere may still load here: the failure can be that
    // worker's own, e.g. its memory or its copy of the files), or if its
    // backlog per replica asks for another one and this worker has room.
    const int64_t loaded_elsewhere = count("loaded");
    if (serving == 0) {
      candidates.push_back({model, msgs, 0, 0, count("failed") > 0});
    } else if (options_.scale_out_backlog > 0 && loaded_elsewhere > 0 &&
               static_cast<int64_t>(msgs) / loaded_elsewhere > options_.scale_out_backlog &&
               manager_->FitsWithoutEviction(model)) {
      // The stream's count includes messages the replicas hold (delivered,
      // running or in their batchers, not yet acked): only those still
      // undelivered ask for another replica (one question to the server,
      // and only past the threshold).
      auto undelivered = client_->ConsumerPending(options_.stream.name, wire::ConsumerName(model), 1000);
      if (undelivered.ok() && static_cast<int64_t>(*undelivered) / loaded_elsewhere > options_.scale_out_backlog)
        candidates.push_back({model, msgs, static_cast<int>(serving), 0, false});
    }
  }
  // One on-demand load at a time per worker: loads run one after another
  // anyway, and a load queued behind another would evict for a model that
  // may no longer need it by its turn. Other workers take the other cold
  // models meanwhile. The model with the most waiting work goes first.
  const bool loading_here = std::any_of(here.begin(), here.end(), [](const auto& kv) {
    return kv.second.state == ModelState::kLoading;
  });
  // The oldest waiting work first, weighted by how much waits (as device
  // turns are shared), so no cold model starves behind busier ones. Models
  // that failed to load somewhere go after those that did not: their work
  // is old because it was held back, and they may fail again.
  for (Candidate& c : candidates) {
    int64_t oldest = 0;
    {
      std::lock_guard<std::mutex> lock(backlog_mu_);
      oldest = backlog_[c.model].oldest_unix_ms;
    }
    c.age_ms = oldest > 0 ? static_cast<double>(std::max<int64_t>(1, now_ms - oldest)) : 1.0;
    c.priority = c.age_ms * (1.0 + std::log2(1.0 + static_cast<double>(c.msgs)));
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.failed != b.failed ? !a.failed : a.priority > b.priority;
                   });
  const std::map<std::string, std::vector<PeerModel>>* fresh = nullptr;  // read once, at the first candidate
  for (const Candidate& c : candidates) {
    if (loading_here || stop_) break;
    // The cached view said nobody serves it (or `replica` workers do); make
    // sure before claiming: a replica loaded since, whose claim is gone,
    // would otherwise get one more copy.
    if (fresh == nullptr) fresh = &Peers(true);
    if (ServingPeers(*fresh, c.model) > c.replica) continue;
    // Loading it here would evict, while a peer has room for it: leave it to
    // that peer (its own demand poll sees the same work) for up to one
    // heartbeat interval, so this worker's resident models are not evicted
    // (and soon loaded again) for a model another worker can hold beside
    // its own. Work older than that is taken here after all: the peer's
    // heartbeat may be stale, or the peer stuck.
    if (!c.failed && c.age_ms < static_cast<double>(options_.heartbeat_interval_ms) &&
        !manager_->FitsWithoutEviction(c.model) && PeerHasRoom(*fresh, c.model))
      continue;
    if (!Claim(c.model, c.replica)) continue;
    Status s = manager_->StartLoad(c.model);
    if (s.ok()) {
      LOG_INFO("worker", "loading " << c.model << " on demand (" << c.msgs << " message(s) waiting"
                                    << (c.replica > 0 ? ", another replica" : "") << ")");
      changed = true;
      break;
    }
    if (s.reason() == "model_load_failed") {
      // It failed here since the statuses were read: its retry is not due.
      if (!AnotherMayLoad(c.model, now_ms)) DrainFailed(c.model, s, 256);
    } else if (s.reason() != "memory_being_freed") {
      // No room here (every resident model pinned or busy): let another
      // worker have the claim.
      constexpr int64_t kNoRoomLogEveryUs = 30'000'000;
      const auto logged = no_room_logged_mono_us_.find(c.model);
      if (logged == no_room_logged_mono_us_.end() || now_mono - logged->second >= kNoRoomLogEveryUs) {
        LOG_INFO("worker", "cannot load " << c.model << " on demand: " << s.ToString()
                                          << " (logged at most every 30 s while it lasts)");
        no_room_logged_mono_us_[c.model] = now_mono;
      }
      const std::string key = wire::ModelKvKey(c.model) + "." + std::to_string(c.replica);
      if (GiveBackClaim(key)) held_claims_.erase(key);  // else the next poll gives it back
      // Waiting work gets an answer rather than its deadline when no room
      // can come here: the model is larger than this worker's whole budget
      // (429 no_room_for_model), or it failed here and its retry finds
      // every resident model pinned (the load error it had, as before the
      // retry fell due). While a resident model is only busy, room may
      // come: wait.
      const bool only_pinned = std::none_of(here.begin(), here.end(), [](const auto& kv) {
        return (kv.second.state == ModelState::kLoaded || kv.second.state == ModelState::kLoading) &&
               !kv.second.pinned;
      });
      Status answer;
      if (manager_->LargerThanBudget(c.model) && !PeerMayFit(c.model)) {
        answer = s;
      } else if (Status failed = manager_->LoadError(c.model); !failed.ok() && only_pinned) {
        answer = failed;
      }
      if (!answer.ok() && !AnotherMayLoad(c.model, now_ms)) DrainFailed(c.model, answer, 256);
    }
  }
  if (changed) (void)PublishHeartbeat();  // peers see "loading" at once
}

int Worker::ServingPeers(const std::map<std::string, std::vector<PeerModel>>& peers, const std::string& model) {
  const auto it = peers.find(model);
  if (it == peers.end()) return 0;
  return static_cast<int>(std::count_if(it->second.begin(), it->second.end(), [](const PeerModel& p) {
    return p.state == "loaded" || p.state == "loading";
  }));
}

bool Worker::PeerMayFit(const std::string& model) {
  const int64_t need = manager_->FootprintBytes(model);
  const auto& peers = Peers(true);
  const auto it = peers.find(model);
  return it != peers.end() && std::any_of(it->second.begin(), it->second.end(), [&](const PeerModel& p) {
           return p.memory_budget_bytes == 0 || p.memory_budget_bytes >= need;
         });
}

bool Worker::PeerHasRoom(const std::map<std::string, std::vector<PeerModel>>& peers,
                         const std::string& model) const {
  const auto it = peers.find(model);
  if (it == peers.end()) return false;
  const int64_t need = manager_->FootprintBytes(model);
  return std::any_of(it->second.begin(), it->second.end(), [&](const PeerModel& p) {
    return p.state == "not_loaded" && !p.loading && !p.count_full && p.free_bytes >= need;
  });
}

bool Worker::AnotherMayLoad(const std::string& model, int64_t now_ms) {
  // A live peer that has started a load holds the placement claim from
  // before its heartbeat says "loading" until after it shows the outcome.
  auto holder = placement_kv_->Get(wire::ModelKvKey(model) + ".0");
  const auto listed = [&](const std::map<std::string, std::vector<PeerModel>>& peers, const std::string& worker) {
    const auto it = peers.find(model);
    return it != peers.end() && std::any_of(it->second.begin(), it->second.end(),
                                            [&](const PeerModel& p) { return p.worker == worker; });
  };
  if (holder.ok() && *holder != id_ && listed(Peers(false), *holder)) return true;
  // Read after the claim, so a load that ended since shows as "loaded".
  const auto& peers = Peers(true);
  if (ServingPeers(peers, model) > 0) return true;
  const auto it = peers.find(model);
  const bool untried = it != peers.end() && std::any_of(it->second.begin(), it->second.end(), [](const PeerModel& p) {
                         return p.state == "not_loaded";
                       });
  if (!untried) return false;
  // A peer that has not tried it gets about one heartbeat and two backlog
  // reads to claim it; past that the waiting work is answered here (a peer
  // with no room, or busy loading another model, may never claim it). The
  // grace runs from the later of the oldest waiting message and the first
  // time this worker gave up on the model: work that waited through a slow
  // failed load has not given peers their chance yet.
  int64_t oldest = 0;
  {
    std::lock_guard<std::mutex> lock(backlog_mu_);
    oldest = backlog_[model].oldest_unix_ms;
  }
  if (oldest <= 0) return false;  // nothing waits
  const int64_t gave_up = gave_up_unix_ms_.emplace(model, now_ms).first->second;
  const int64_t grace_ms = options_.heartbeat_interval_ms + 2 * options_.demand_poll_ms;
  return now_ms - std::max(oldest, gave_up) < grace_ms;
}

void Worker::ParkDrainConsumer(const std::string& model) {
  auto it = drain_consumers_.find(model);
  if (it == drain_consumers_.end()) return;
  park_->Park(model, std::move(it->second));  // its last pull may still be listed
  drain_consumers_.erase(it);
}

void Worker::DrainFailed(const std::string& model, const Status& error, int max) {
  auto it = drain_consumers_.find(model);
  if (it == drain_consumers_.end()) {
    std::unique_ptr<PullConsumer> parked = park_->Take(model);  // the model's own, if it stopped lately
    if (!parked) {
      auto consumer = PullConsumer::Create(*client_, options_.stream.name, wire::WorkSubject(model),
                                           wire::ConsumerName(model), options_.consumer);
      if (!consumer.ok()) {
        LOG_WARN("worker", "cannot answer waiting work for " << model << ": " << consumer.status().ToString());
        return;
      }
      parked = std::move(consumer).value();
    }
    it = drain_consumers_.emplace(model, std::move(parked)).first;
  }
  auto fetched = it->second->Fetch(max, kDrainPollMs);
  if (!fetched.ok()) return;
  // The error was read before the fetch: a load started since (an
  // operator's retry) will serve this work, which goes back to the queue;
  // work on its last delivery, which would not come back, hears to retry.
  const bool loading_again = manager_->LoadedOrLoading(model);
  const Status answer =
      loading_again ? Unavailable("model '" + model + "' is loading again after a failed load; retry", "model_loading")
                    : error;
  for (Delivery& d : *fetched) {
    if (!d.Header(wire::kHdrLoadHint).empty()) {
      (void)d.Ack();
      continue;
    }
    if (loading_again && static_cast<int64_t>(d.NumDelivered()) < options_.consumer.max_deliver) {
      (void)d.Nak();
      continue;
    }
    wire::WorkHeaders headers;
    (void)ParseWorkHeaders(d, &headers);  // malformed: its caller still hears, when it can be reached
    if (!headers.request_id.empty()) {
      PublishErrorReply(*client_, headers, answer, id_);
    }
    (void)d.Term();  // terminal: the caller has its answer, never retried
    if (!loading_again) drained_->Inc();
  }
}

// ----- Control -----------------------------------------------------------------

Result<std::string> Worker::Control(const std::string& action, const std::string& model, int64_t deadline_unix_ms) {
  int64_t deadline_mono_us = ModelManager::kNoDeadline;
  if (deadline_unix_ms > 0) {
    const int64_t left_ms = deadline_unix_ms - clock_->NowUnixMs();
    // Queued here behind another action until its caller stopped waiting:
    // done now, it would surprise whoever acted since.
    if (left_ms <= 0) {
      return DeadlineExceeded("the caller stopped waiting before this worker could start the action",
                              "deadline_exceeded");
    }
    constexpr int64_t kDayMs = 86'400'000;  // bounds a mistyped or hostile value
    deadline_mono_us = clock_->NowMonoUs() + std::min(left_ms, kDayMs) * 1000;
  }
  Status s;
  if (action == "load" || action == "pin") {
    // Peers see "loading" before the load runs (not one heartbeat after
    // it), so their demand loops leave the model to this worker instead of
    // loading, and evicting for, a second copy. A load started here is the
    // one waited for: if it fails at once, that failure is the answer, not
    // a second try. A model that failed here is tried again (the operator
    // asks for it), and shows as loading too.
    const bool started = manager_->StartLoad(model, /*retry_failed=*/true).ok();
    if (started) (void)PublishHeartbeat();
    s = action == "load" ? manager_->Load(model, /*retry_failed=*/!started, deadline_mono_us)
                         : manager_->Pin(model, /*retry_failed=*/!started, deadline_mono_us);
  } else if (action == "unload") {
    s = manager_->Unload(model);
  } else if (action == "unpin") {
    s = manager_->Unpin(model);
  } else if (action != "status") {
    return InvalidArgument("unknown action '" + action + "'", "invalid_action");
  }
  (void)PublishHeartbeat();  // the registry shows the change before the caller hears of it
  if (!s.ok()) return s;
  return ModelStatusJson(model);
}

void Worker::OnCancel(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
  NatsMsgPtr owned(msg);
  auto* self = static_cast<Worker*>(closure);
  const std::string_view id(natsMsg_GetData(msg), static_cast<size_t>(natsMsg_GetDataLength(msg)));
  // A gateway's request ids are short: anything else is not one.
  if (id.size() <= CancelledRequests::kMaxIdBytes) self->cancelled_.Add(id, self->clock_->NowMonoUs());
}

void Worker::OnControl(natsConnection* nc, natsSubscription*, natsMsg* msg, void* closure) {
  NatsMsgPtr owned(msg);
  auto* self = static_cast<Worker*>(closure);
  const char* reply = natsMsg_GetReply(msg);
  std::lock_guard<std::mutex> lock(self->control_mu_);
  Result<std::string> result = Unavailable("the worker is stopping", "shutting_down");
  if (!self->stop_) {
    try {
      json in = json::parse(std::string(natsMsg_GetData(msg), static_cast<size_t>(natsMsg_GetDataLength(msg))));
      const std::string action = in.value("action", "");
      const std::string model = in.value("model", "");
      const int64_t deadline_unix_ms = in.value("deadline_unix_ms", int64_t{0});
      LOG_INFO("worker", "control: " << action << " " << model);
      result = self->Control(action, model, deadline_unix_ms);
    } catch (const std::exception& e) {
      result = InvalidArgument(std::string("bad control request: ") + e.what(), "invalid_json");
    }
  }
  json out = {{"ok", result.ok()}, {"worker", self->id_}};
  if (result.ok()) {
    out["status"] = json::parse(*result);
  } else {
    out["error"] = ErrorJson(result.status());
  }
  if (reply != nullptr) {
    const std::string body = DumpJson(out);
    natsConnection_Publish(nc, reply, body.data(), static_cast<int>(body.size()));
  }
}

}  // namespace shoal
