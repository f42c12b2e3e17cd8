// ModelServer: serves one loaded model inside a worker. Owns the model's
// pull consumer, tokenizer, batcher and its two threads (fetcher, executor);
// uses the runtime the worker's ModelManager owns, and runs each forward
// pass in a turn of the worker's DeviceScheduler. It is the model's
// attachment: the manager destroys it (stopping both threads) before it
// unloads the runtime.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "queue/nats_client.h"
#include "runtime/runtime.h"
#include "tokenize/wordpiece_tokenizer.h"
#include "worker/batcher.h"
#include "worker/device_scheduler.h"
#include "worker/model_manager.h"

namespace shoal {

struct ModelServerDeps {
  ModelConfig config;
  Runtime* runtime = nullptr;                      // loaded; outlives the server
  std::unique_ptr<WordPieceTokenizer> tokenizer;
  std::unique_ptr<PullConsumer> consumer;
  NatsClient* client = nullptr;                   // publishes replies
  MetricsRegistry* metrics = nullptr;
  const Clock* clock = nullptr;
  std::string worker_id;
  int64_t fetch_poll_ms = 500;
  int64_t ack_wait_ms = 30000;
  int max_deliver = 5;
  DeviceScheduler* scheduler = nullptr;           // null: run without turns
  std::function<void()> on_batch;                 // after each batch (marks the model used)
  std::function<int64_t()> backlog;               // messages waiting for this model in the stream
  int64_t loaded_unix_ms = 0;                     // work queued before this waited for the load
};

class ModelServer final : public ModelAttachment {
 public:
  explicit ModelServer(ModelServerDeps deps);
  ~ModelServer() override;
  // Starts the fetcher and executor threads. Call once.
  void Start();
  // Stops both threads; see Worker::Stop. Idempotent.
  void Stop();
  const ModelConfig& config() const { return d_.config; }
  int64_t memory_bytes() const { return d_.runtime->MemoryBytes(); }

  // Decodes and tokenizes one message body into work (without its
  // delivery), or the error its caller gets. Called on the fetcher thread.
  Result<std::unique_ptr<PendingWork>> Prepare(std::string_view body) const;

 private:
  void FetchLoop();
  void ExecLoop();
  void RunBatch(std::vector<std::unique_ptr<PendingWork>> batch);
  // Item work (TakesItems runtimes): whole inputs, no tokenizer.
  Result<std::unique_ptr<PendingWork>> PrepareItems(wire::WorkBody body) const;
  void RunItemBatch(std::vector<std::unique_ptr<PendingWork>> live);
  // Runs the items of `work` through the runtime, streaming partial output
  // to each caller. Fills one reply per work on success.
  Status RunItems(const std::vector<std::unique_ptr<PendingWork>>& work, std::vector<wire::WorkReply>* replies);
  // Sends each reply and acks, or fails the work with `failure`.
  void Finish(std::vector<std::unique_ptr<PendingWork>>& live, std::vector<wire::WorkReply>& replies,
              const Status& failure);
  // Hands pulled-but-unrun work back to the queue for redelivery, except
  // work on its last allowed delivery: its caller gets `last_chance` (a
  // message past MaxDeliver would sit in the queue unanswered).
  void Release(std::vector<std::unique_ptr<PendingWork>> work, const Status& last_chance, int64_t delay_ms = 0);
  // Publishes an error reply (when the caller can be reached) and terms.
  void Fail(Delivery& delivery, const wire::WorkHeaders& headers, const Status& status);
  Status Reply(const wire::WorkReply& reply, const std::string& reply_to);

  ModelServerDeps d_;
  std::mutex mu_;  // guards batcher_, stop_ waits
  std::condition_variable work_cv_;   // executor waits for work
  std::condition_variable space_cv_;  // fetcher waits for budget
  Batcher batcher_;
  const std::string activation_;      // applied to every output row
  std::atomic<bool> stop_{false};
  double avg_tokens_per_msg_ = 32;    // fetcher thread only
  std::thread fetcher_;
  std::thread executor_;

  Counter* batches_ = nullptr;
  Histogram* batch_rows_ = nullptr;
  Histogram* batch_tokens_ = nullptr;
  Histogram* run_seconds_ = nullptr;
  Histogram* queue_wait_seconds_ = nullptr;
  Counter* tokens_total_ = nullptr;
  Counter* expired_ = nullptr;
  Counter* redelivered_ = nullptr;
  Counter* load_waits_ = nullptr;
  Histogram* load_wait_seconds_ = nullptr;
  Histogram* turn_wait_seconds_ = nullptr;
  Counter* runtime_unavailable_ = nullptr;
};

// Applies a model's activation ("none", "sigmoid", "softmax" per row) in
// place to a runtime's raw output.
void ApplyActivation(const std::string& activation, Embeddings* out);

// Parses the Shoal-* headers of a work message.
Result<wire::WorkHeaders> ParseWorkHeaders(const Delivery& d);

// Answers one work message's caller with `status` (no-op without a reply
// subject). The caller then terms the message.
void PublishErrorReply(NatsClient& client, const wire::WorkHeaders& headers, const Status& status,
                       const std::string& worker_id);

}  // namespace shoal
