#include "worker/worker.h"

#include <unistd.h>

#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "runtime/runtime.h"
#include "tokenize/wordpiece_tokenizer.h"
#include "wire/work_message.h"
#include "worker/model_server.h"

namespace shoal {

Status WorkerOptions::Validate() const {
  if (model_repository.empty()) return InvalidArgument("worker: model repository is required");
  if (intra_op_threads < 0) return InvalidArgument("worker: intra_op_threads must be >= 0");
  if (fetch_poll_ms < 1) return InvalidArgument("worker: fetch_poll_ms must be >= 1");
  if (heartbeat_interval_ms < 100) return InvalidArgument("worker: heartbeat_interval_ms must be >= 100");
  if (heartbeat_ttl_ms <= heartbeat_interval_ms)
    return InvalidArgument("worker: heartbeat_ttl_ms must exceed heartbeat_interval_ms");
  RETURN_IF_ERROR(consumer.Validate());
  return stream.Validate();
}

namespace {

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
  // KV keys allow [-/_=.a-zA-Z0-9]; keep it simple.
  for (char& c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '-';
  return id;
}

}  // namespace

Result<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options, NatsClient* client,
                                               MetricsRegistry* metrics, const Clock* clock) {
  RETURN_IF_ERROR(options.Validate());
  if (clock == nullptr) clock = SystemClock::Get();
  auto w = std::unique_ptr<Worker>(new Worker());
  w->options_ = options;
  w->host_ = HostName();
  w->id_ = options.worker_id.empty() ? DefaultWorkerId(w->host_) : options.worker_id;
  w->client_ = client;
  w->metrics_ = metrics;
  w->started_unix_ms_ = clock->NowUnixMs();

  RETURN_IF_ERROR(EnsureWorkStream(*client, options.stream));
  ASSIGN_OR_RETURN(w->workers_kv_, KvBucket::Open(*client, wire::kWorkersBucket, options.heartbeat_ttl_ms));
  ASSIGN_OR_RETURN(w->models_kv_, KvBucket::Open(*client, wire::kModelsBucket, 0));

  ASSIGN_OR_RETURN(auto configs, LoadModelRepository(options.model_repository));
  std::vector<ModelConfig> selected;
  for (const auto& name : options.models) {
    auto it = std::find_if(configs.begin(), configs.end(), [&](const ModelConfig& c) { return c.name == name; });
    if (it == configs.end())
      return NotFound("model '" + name + "' is not in repository " + options.model_repository);
    selected.push_back(*it);
  }
  if (options.models.empty()) selected = configs;
  if (selected.empty()) return NotFound("no models in repository " + options.model_repository);

  for (ModelConfig config : selected) {
    if (!options.runtime_override.empty()) config.runtime = options.runtime_override;
    if (options.intra_op_threads > 0) config.intra_op_threads = options.intra_op_threads;
    if (options.max_batch_tokens > 0) config.batching.max_batch_tokens = options.max_batch_tokens;
    if (options.max_batch_size > 0) config.batching.max_batch_size = options.max_batch_size;
    if (options.max_wait_us >= 0) config.batching.max_wait_us = options.max_wait_us;
    RETURN_IF_ERROR(config.Validate());
    if (config.intra_op_threads == 0)
      config.intra_op_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    ASSIGN_OR_RETURN(auto runtime, options.runtime_factory ? options.runtime_factory(config)
                                                           : CreateRuntime(config.runtime));
    const int64_t t0 = clock->NowMonoUs();
    // Load on a thread that ends with the load: libtorch's warm-up passes
    // would otherwise leave an idle OpenMP team on the caller's thread for
    // the life of the process, and two teams on the same cores throttle
    // each other (docs/BENCHMARKS.md, "What limits the ratio").
    Status loaded;
    std::thread([&] { loaded = runtime->Load(config); }).join();
    if (!loaded.ok()) return Status(loaded.code(), "loading model '" + config.name + "': " + loaded.message());
    if (config.dim == 0) config.dim = runtime->Dim();
    LOG_INFO("worker", "loaded " << config.name << " (" << config.runtime << ", dim " << config.dim << ", "
                                 << runtime->MemoryBytes() / (1 << 20) << " MiB) in "
                                 << (clock->NowMonoUs() - t0) / 1000 << " ms");
    WordPieceOptions to;
    to.lowercase = config.tokenizer.lowercase;
    to.strip_accents = config.tokenizer.strip_accents;
    to.tokenize_chinese_chars = config.tokenizer.tokenize_chinese_chars;
    ASSIGN_OR_RETURN(auto tokenizer, WordPieceTokenizer::FromFile(config.VocabPath(), to));
    ASSIGN_OR_RETURN(auto consumer,
                     PullConsumer::Create(*client, options.stream.name, wire::WorkSubject(config.name),
                                          wire::ConsumerName(config.name), options.consumer));
    ModelServerDeps deps;
    deps.config = config;
    deps.runtime = std::move(runtime);
    deps.tokenizer = std::move(tokenizer);
    deps.consumer = std::move(consumer);
    deps.client = client;
    deps.metrics = metrics;
    deps.clock = clock;
    deps.worker_id = w->id_;
    deps.fetch_poll_ms = options.fetch_poll_ms;
    deps.ack_wait_ms = options.consumer.ack_wait_ms;
    deps.max_deliver = options.consumer.max_deliver;
    w->servers_.push_back(std::make_unique<ModelServer>(std::move(deps)));
    metrics->GetGauge("shoal_worker_model_memory_bytes", "Measured memory of each loaded model.",
                      {{"model", config.name}})->Set(static_cast<double>(w->servers_.back()->memory_bytes()));
  }
  for (auto& s : w->servers_) {
    RETURN_IF_ERROR(w->models_kv_->Put(wire::ModelToToken(s->config().name), ModelConfigToJson(s->config())));
  }
  RETURN_IF_ERROR(w->workers_kv_->Put(w->id_, w->HeartbeatJson()));
  for (auto& s : w->servers_) s->Start();
  w->heartbeat_ = std::thread([p = w.get()] { p->HeartbeatLoop(); });
  LOG_INFO("worker", "worker " << w->id_ << " serving " << w->servers_.size() << " model(s)");
  return w;
}

Worker::~Worker() { Stop(); }

void Worker::Stop() {
  {
    std::lock_guard<std::mutex> lock(hb_mu_);
    if (stop_.exchange(true)) return;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  for (auto& s : servers_) s->Stop();
  if (workers_kv_) (void)workers_kv_->Delete(id_);
  (void)client_->Flush(1000);
}

std::vector<std::string> Worker::ModelNames() const {
  std::vector<std::string> out;
  for (const auto& s : servers_) out.push_back(s->config().name);
  return out;
}

std::string Worker::HeartbeatJson() const {
  nlohmann::json models = nlohmann::json::array();
  int64_t used = 0;
  for (const auto& s : servers_) {
    models.push_back({{"name", s->config().name}, {"state", "loaded"}, {"memory_bytes", s->memory_bytes()}});
    used += s->memory_bytes();
  }
  nlohmann::json j = {{"id", id_},
                      {"host", host_},
                      {"pid", ::getpid()},
                      {"started_unix_ms", started_unix_ms_},
                      {"heartbeat_unix_ms", SystemClock::Get()->NowUnixMs()},
                      {"memory_used_bytes", used},
                      {"models", models}};
  return j.dump();
}

void Worker::HeartbeatLoop() {
  std::unique_lock<std::mutex> lock(hb_mu_);
  while (!stop_) {
    hb_cv_.wait_for(lock, std::chrono::milliseconds(options_.heartbeat_interval_ms));
    if (stop_) break;
    lock.unlock();
    Status s = workers_kv_->Put(id_, HeartbeatJson());
    if (!s.ok()) LOG_WARN("worker", "heartbeat failed: " << s.ToString());
    lock.lock();
  }
}

}  // namespace shoal
