// Worker: the sidecar that pulls work from JetStream and runs models. For
// each model it serves it keeps one durable pull consumer, one fetcher
// thread (pulls up to the free token budget, decodes, tokenizes) and one
// executor thread (forms batches, runs the Runtime, replies, then acks), so
// batch k+1 is fetched and tokenized while batch k runs. Heartbeats go to
// the SHOAL_WORKERS KV bucket; the models it serves to SHOAL_MODELS.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/status.h"
#include "queue/nats_client.h"
#include "runtime/runtime.h"

namespace shoal {

struct WorkerOptions {
  std::string worker_id;             // empty: hostname-pid-random
  std::string model_repository;      // directory of model directories
  std::vector<std::string> models;   // names to serve; empty: all in the repository
  int intra_op_threads = 0;          // 0: model config, else hardware threads
  std::string runtime_override;      // non-empty: use this runtime for every model ("null")
  // Batching overrides for every model; 0 / -1: keep each model's config.
  int64_t max_batch_tokens = 0;
  int max_batch_size = 0;
  int64_t max_wait_us = -1;
  // Makes the runtime for a model; default CreateRuntime(config.runtime).
  // Tests inject fakes here.
  std::function<Result<std::unique_ptr<Runtime>>(const ModelConfig&)> runtime_factory;
  ConsumerOptions consumer;
  WorkStreamOptions stream;
  int64_t fetch_poll_ms = 500;       // long-poll when idle
  int64_t heartbeat_interval_ms = 2000;
  int64_t heartbeat_ttl_ms = 6000;
  Status Validate() const;
};


class ModelServer;

class Worker {
 public:
  // Loads every model (blocking), binds consumers, registers in the catalog
  // and starts the threads. `client` and `metrics` must outlive the worker.
  static Result<std::unique_ptr<Worker>> Create(const WorkerOptions& options, NatsClient* client,
                                                MetricsRegistry* metrics, const Clock* clock = nullptr);
  ~Worker();
  // Stops pulling, finishes the batch in flight (replies and acks it),
  // leaves pulled-but-unrun messages unacked for redelivery, deregisters.
  void Stop();
  const std::string& id() const { return id_; }
  std::vector<std::string> ModelNames() const;

 private:
  Worker() = default;
  void HeartbeatLoop();
  std::string HeartbeatJson() const;

  WorkerOptions options_;
  std::string id_;
  NatsClient* client_ = nullptr;
  MetricsRegistry* metrics_ = nullptr;
  std::unique_ptr<KvBucket> workers_kv_;
  std::unique_ptr<KvBucket> models_kv_;
  std::vector<std::unique_ptr<ModelServer>> servers_;
  int64_t started_unix_ms_ = 0;
  std::string host_;
  std::atomic<bool> stop_{false};
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  std::thread heartbeat_;
};

}  // namespace shoal
