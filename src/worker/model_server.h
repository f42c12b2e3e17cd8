// ModelServer: serves one loaded model inside a worker. Owns the model's
// pull consumer, tokenizer, batcher and its threads (fetcher, executor, and
// lanes for a runtime that serves several calls at once);
// uses the runtime the worker's ModelManager owns, and runs each forward
// pass in a turn of the worker's DeviceScheduler. It is the model's
// attachment: the manager destroys it (stopping its threads) before it
// unloads the runtime.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "blob/blob_offload.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "queue/nats_client.h"
#include "runtime/runtime.h"
#include "tokenize/wordpiece_tokenizer.h"
#include "worker/batcher.h"
#include "worker/cancelled_requests.h"
#include "worker/device_scheduler.h"
#include "worker/model_manager.h"
#include "worker/progress_keeper.h"
#include "worker/pull_gate.h"

namespace shoal {

// The rows one worker holds (pulled or pushed; waiting in its batchers or
// running), shared by its model servers, and an optional bound on how many
// pulling may take: without one, each model pulls up to its own batch budget
// whatever the device is doing, so a multi-model worker can hold work that
// an idle peer could have run. Thread-safe.
class HeldRows {
 public:
  explicit HeldRows(int64_t limit = 0) : limit_(limit) {}
  int64_t limit() const { return limit_; }
  int64_t count() const { return std::max<int64_t>(0, count_.load()); }
  void Add(int64_t rows) { count_.fetch_add(rows); }
  void Done(int64_t rows) {
    count_.fetch_sub(rows);
    if (limit_ > 0) {
      { std::lock_guard<std::mutex> lock(mu_); }
      cv_.notify_all();
    }
  }
  // Rows a pull may take now: limit - held, after waiting up to wait_ms for
  // some room (0 when there is none yet). Unbounded: `want`.
  int64_t Room(int64_t want, int64_t wait_ms) {
    if (limit_ <= 0) return want;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), [&] { return count() < limit_; });
    return std::max<int64_t>(0, std::min(want, limit_ - count()));
  }

 private:
  const int64_t limit_;
  std::atomic<int64_t> count_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

struct ModelServerDeps {
  ModelConfig config;
  Runtime* runtime = nullptr;                      // loaded; outlives the server
  std::unique_ptr<WordPieceTokenizer> tokenizer;
  std::unique_ptr<PullConsumer> consumer;
  // Takes the consumer when the server stops (see ConsumerPark: the
  // subscription must outlive its pulls). Required with a consumer.
  std::function<void(std::unique_ptr<PullConsumer>)> park;
  NatsClient* client = nullptr;                   // publishes replies
  MetricsRegistry* metrics = nullptr;
  const Clock* clock = nullptr;
  std::string worker_id;
  int64_t fetch_poll_ms = 500;
  int64_t ack_wait_ms = 30000;
  int max_deliver = 5;
  DeviceScheduler* scheduler = nullptr;           // null: run without turns
  // The scheduler's slots are this host's CPU cores: a pass of a runtime
  // that TakesThreadCount() asks for 1..intra_op_threads of them (see
  // PassWidth) and runs on as many threads as it got; any other runtime's
  // pass takes every slot. False: every pass takes one
  // slot and runs on the model's configured threads.
  bool slots_are_cores = false;
  // Fetches payloads of work messages that carry a reference and offloads
  // large replies; null: a referenced payload is answered blob_store_missing.
  BlobOffload* blob = nullptr;
  // Worker-wide bound on payloads fetched from the blob store and not yet
  // answered (may be null: none). A pulled message whose payload does not
  // fit waits, pulled and noted in progress, until room frees; no new pull
  // is made meanwhile.
  ByteBudget* fetched_payloads = nullptr;
  std::function<void()> on_batch;                 // after each batch (marks the model used)
  std::function<int64_t()> backlog;               // messages waiting for this model in the stream
  int64_t loaded_unix_ms = 0;                     // work queued before this waited for the load
  // Worker-wide counters this server adds to (may be null; outlive the
  // server): microseconds its runtime spent running forward passes, and
  // rows held in its batcher or running now (and the pull bound).
  std::atomic<int64_t>* busy_us = nullptr;
  HeldRows* held_rows = nullptr;
  // Worker-wide bound on passes waiting for the device (null or unbounded:
  // pull freely). While it is bounded, a pull stays open at most
  // `idle_poll_ms` (an open pull cannot be withdrawn when the device falls
  // behind).
  PullGate* pull_gate = nullptr;
  // Notes progress on pulled work, from its pull until it is answered, so
  // neither a pass longer than AckWait nor work waiting behind one is
  // redelivered meanwhile (may be null: nothing keeps long work ours).
  ProgressKeeper* progress = nullptr;
  // Requests whose callers went away (may be null): item runtimes that can
  // stop part-way are told (ItemCalls::cancelled).
  const CancelledRequests* cancelled = nullptr;
  int64_t idle_poll_ms = 20;
  // While other models wait for the device, a batch is cut to about this
  // much of its turn's time (the model's measured cost per token; one item
  // until a pass has been measured), so a model draining a backlog hands
  // the device on after each quantum instead of holding it for a full
  // batch. 0: full batches always.
  int64_t turn_quantum_us = 0;
};

class ModelServer final : public ModelAttachment {
 public:
  explicit ModelServer(ModelServerDeps deps);
  ~ModelServer() override;
  // Starts the fetcher and executor threads. Call once (a worker's model
  // manager calls it when it keeps the model).
  void Start() override;
  // Stops both threads; see Worker::Stop. Idempotent.
  void Stop();
  const ModelConfig& config() const { return d_.config; }
  int64_t memory_bytes() const { return d_.runtime->MemoryBytes(); }
  // Pulled or pushed work waits in the batcher, is being prepared for it
  // (a payload fetched from the blob store, tokenized) or is being run
  // (a pass, or messages run one by one that wait for a restarting
  // runtime). See ModelAttachment.
  bool HoldsWork() const override { return in_hand_.load() > 0; }

  // Decodes and tokenizes one message body into work (without its
  // delivery), or the error its caller gets. Called on the fetcher thread.
  Result<std::unique_ptr<PendingWork>> Prepare(std::string_view body) const;
  // Prepare() on a delivery's body, fetched first from the blob store when
  // the message carries only a reference.
  Result<std::unique_ptr<PendingWork>> PrepareDelivery(const Delivery& delivery,
                                                       const wire::WorkHeaders& headers) const;

  // Takes one work message pushed straight to this worker (push dispatch;
  // a Delivery::Core message) into the same batcher pulled work goes to.
  // Bad input, expired work and work arriving while the server stops are
  // answered with an error at once. Never blocks on the device; callable
  // from any thread (nats.c's delivery thread).
  void Push(Delivery delivery);

 private:
  // Stores an encoded reply too large for a message in the blob store and
  // sends only its reference (header Shoal-Payload-Ref, empty body).
  Status ReplyByRef(const std::string& encoded, const wire::WorkReply& reply, const std::string& reply_to);
  void FetchLoop();
  // A message pulled for this model, not yet prepared (fetcher thread).
  struct PulledWork {
    Delivery delivery{nullptr, nullptr};
    wire::WorkHeaders headers;
    Delivery::Info info;
    ProgressKeeper::Watch progress;  // from its pull
    bool waited = false;             // it has waited for room for its payload
    ByteBudget::Ticket payload_ticket;  // its place among takes waiting for room
  };
  // Prepares pulled messages (fetching offloaded payloads) into the
  // batcher, or answers them; those from the first whose payload finds no
  // room under fetched_payloads on wait in deferred_. `counted`: they count
  // in in_hand_ already (they come from deferred_).
  void TakeIn(std::vector<PulledWork> pulled, bool counted);
  // While the runtime is down: deferred_ leaves the line for payload room
  // and is answered where its caller stopped waiting; past
  // kRuntimeBackWaitMs of it, handed back. Sleeps a little.
  void HoldDeferredWhileRuntimeDown();
  // Hands deferred_ back to the queue (after `delay_ms`), failing with
  // `last_chance` what is on its last delivery.
  void HandBackDeferred(int64_t delay_ms, const Status& last_chance);
  // Gives this server's PullGate claim back once no work of it waits for
  // the device. Requires mu_.
  void MaybeReleaseClaimLocked();
  void ExecLoop();
  // A lane thread: runs the batches the executor hands it (see lanes_).
  void LaneLoop();
  // Starts one more lane (executor thread); when none can be, lanes_ falls
  // to the lanes there are.
  void StartLane();
  // Runs a batch taken from the batcher; its rows and messages stop
  // counting as held when it ends.
  void RunTaken(std::vector<std::unique_ptr<PendingWork>> batch);
  // Waits for this model's next device turn (see DeviceScheduler::Acquire)
  // into turn_; false when the server or the scheduler is stopping.
  bool AcquireTurn(int64_t oldest_published_mono_us, int64_t backlog);
  // The fetcher no longer waits for room under --pull-ahead (it found
  // some, or has no queued work): its starvation count starts again.
  void ForgetRoomWait();
  // What this model's passes ask the scheduler for (see slots_are_cores).
  PassWidth WantedWidth() const;
  // The token cap of the batch cut in `turn` (see turn_quantum_us); 0: the
  // batch budget alone. Executor thread.
  int64_t TokenCap(const DeviceScheduler::Turn& turn) const;
  void RunBatch(std::vector<std::unique_ptr<PendingWork>> batch);
  // Runs messages that are still within their deadlines, answers each.
  void RunLive(std::vector<std::unique_ptr<PendingWork>> live);
  // RunLive for each message on its own, each once the runtime is
  // available (up to a few seconds; else the rest is handed back).
  void RunEachAlone(std::vector<std::unique_ptr<PendingWork>> work);
  // Item work (TakesItems runtimes): whole inputs, no tokenizer.
  Result<std::unique_ptr<PendingWork>> PrepareItems(wire::WorkBody body) const;
  void RunItemBatch(std::vector<std::unique_ptr<PendingWork>> live);
  // Runs the items of `work` through the runtime, streaming partial output
  // to each caller. A message whose every input is done before the others
  // (Runtime::RunItemsAsReady) is answered and acked at once, and marked in
  // *answered; the others get one reply each in *replies on success.
  Status RunItems(const std::vector<std::unique_ptr<PendingWork>>& work, std::vector<wire::WorkReply>* replies,
                  std::vector<bool>* answered);
  // Adds one input's result document to its message's reply; an input that
  // failed on its own (its ItemError) fails the reply. Not OK: a token
  // task's row that is not one (the model failing).
  Status AddItemResult(std::string result, Status item_error, size_t input, wire::WorkReply* reply) const;
  // Sends each reply and acks, or fails the work with `failure`.
  void Finish(std::vector<std::unique_ptr<PendingWork>>& live, std::vector<wire::WorkReply>& replies,
              const Status& failure);
  void FinishOne(PendingWork& work, const wire::WorkReply& reply, const Status& failure);
  // Hands pulled-but-unrun work back to the queue for redelivery, except
  // work on its last allowed delivery: its caller gets `last_chance` (a
  // message past MaxDeliver would sit in the queue unanswered).
  void Release(std::vector<std::unique_ptr<PendingWork>> work, const Status& last_chance, int64_t delay_ms = 0);
  // Release for one message: its progress notes stop, then it goes back to
  // the queue (after `delay_ms`), or is answered `last_chance` when it
  // cannot (pushed, or on its last allowed delivery).
  void HandBackOrFail(Delivery& delivery, const wire::WorkHeaders& headers, ProgressKeeper::Watch& progress,
                      const Status& last_chance, int64_t delay_ms);
  // Publishes an error reply (when the caller can be reached) and terms.
  void Fail(Delivery& delivery, const wire::WorkHeaders& headers, const Status& status);
  // Work whose deadline passed by `now_unix_ms` is answered as expired
  // (counted, terminated): true. Else false, and nothing is done.
  bool FailIfExpired(Delivery& delivery, const wire::WorkHeaders& headers, int64_t now_unix_ms);
  // The same, and work whose caller is gone (its request id in the cancel
  // set) is answered as cancelled (counted, terminated).
  bool FailIfExpiredOrCancelled(Delivery& delivery, const wire::WorkHeaders& headers, int64_t now_unix_ms);
  Status Reply(const wire::WorkReply& reply, const std::string& reply_to);

  ModelServerDeps d_;
  std::mutex mu_;  // guards batcher_, stop_ waits
  std::condition_variable work_cv_;   // executor waits for work
  std::condition_variable space_cv_;  // fetcher waits for budget
  Batcher batcher_;
  const std::string activation_;      // applied to every output row
  std::atomic<bool> stop_{false};
  // Messages this server took and has not settled: being prepared after
  // their fetch, in the batcher, or in a batch that has not ended. Work
  // moving from one to the next is counted in the next before it stops
  // counting in the last, so HoldsWork never misses it once its fetch has
  // returned (messages a fetch is still receiving are not counted: an
  // eviction then hands them back to the queue).
  std::atomic<size_t> in_hand_{0};
  // Fetcher thread only: the device's turns_granted() when this model,
  // with work in the queue, began to find no room under --pull-ahead (-1:
  // it is not waiting).
  int64_t room_wait_from_turn_ = -1;
  std::chrono::steady_clock::time_point room_wait_since_;  // and the time then
  // Fetcher thread only: the server's last answer that work waits
  // undelivered for this model, and when it was asked.
  bool starved_ = false;
  std::chrono::steady_clock::time_point pending_asked_;
  bool claim_held_ = false;           // guarded by mu_: waiting work holds a PullGate claim
  double avg_tokens_per_msg_ = 32;    // fetcher thread only
  double avg_rows_per_msg_ = 0;       // fetcher thread only; 0: none seen yet
  int64_t gated_poll_ms_ = 20;        // fetcher thread only: pull length under a PullGate
  std::atomic<bool> fetcher_done_{false};  // FetchLoop has returned
  // Fetcher thread only (Stop, once it has joined): pulled messages waiting
  // for room for their payloads, in order; counted in in_hand_.
  std::vector<PulledWork> deferred_;
  int64_t deferred_down_since_us_ = 0;  // fetcher thread: since when deferred_ waits for the runtime
  // Executor thread only: slots held by the current turn (1 without a
  // scheduler); the pass's threads when slots_are_cores, and the weight of
  // its run time in busy_us.
  // The device turn of the pass the executor is running; executor thread
  // only. RunEachAlone gives it up while it waits for a runtime restart.
  DeviceScheduler::Turn turn_;
  int turn_width_ = 1;
  // Executor thread only: a turn's slot-microseconds of forward time per
  // token (items count one), a moving average over this server's batches
  // (valid once cost_measured_), and the forward time (in slot-us: each
  // pass's time by its turn's width) and tokens of the batch running now,
  // which RunBatch adds to (atomic: lanes add to it too, though only a
  // device runtime's batches, which run on the executor, read it).
  double slot_us_per_token_ = 0;
  bool cost_measured_ = false;
  std::atomic<int64_t> batch_run_us_{0};
  std::atomic<int64_t> batch_run_tokens_{0};
  std::thread fetcher_;
  std::thread executor_;
  // A runtime serving several calls at once (Runtime::ConcurrentCalls, not
  // on the device): the executor hands one-message batches to up to this
  // many lane threads, each taken as soon as a lane is free; lanes start
  // as they are needed. 1: the executor runs every batch itself.
  std::atomic<int> lanes_{1};
  // Batches go to lanes (one message each, one input per call); set at
  // Start when lanes_ > 1, and stays set while any lane runs, even one.
  std::atomic<bool> lane_mode_{false};
  std::vector<std::thread> lane_threads_;  // executor thread only (and Stop, once it has joined)
  std::condition_variable lane_cv_;  // lanes wait for a batch
  std::deque<std::vector<std::unique_ptr<PendingWork>>> lane_work_;  // guarded by mu_
  int lanes_busy_ = 0;       // guarded by mu_: batches handed to lanes and not yet run
  bool lanes_stop_ = false;  // guarded by mu_: lanes return once lane_work_ is empty

  Counter* batches_ = nullptr;
  Histogram* batch_rows_ = nullptr;
  Histogram* batch_tokens_ = nullptr;
  Histogram* run_seconds_ = nullptr;
  Histogram* pulled_wait_seconds_ = nullptr;  // shoal_worker_queue_wait_seconds
  Histogram* batch_wait_seconds_ = nullptr;
  Counter* tokens_total_ = nullptr;
  Counter* expired_ = nullptr;
  Counter* cancelled_ = nullptr;
  Counter* redelivered_ = nullptr;
  Counter* payload_waits_ = nullptr;
  // shoal_worker_errors_total{model, code}: codes may be a runtime's or an
  // upstream's own strings, so bounded (per model, across its loads).
  ErrorCodeCounters* errors_ = nullptr;
  Counter* handed_back_ = nullptr;
  Counter* load_waits_ = nullptr;
  Histogram* load_wait_seconds_ = nullptr;
  Histogram* turn_wait_seconds_ = nullptr;
  Counter* runtime_unavailable_ = nullptr;
  Counter* pushed_ = nullptr;
  Counter* shortened_ = nullptr;
  Gauge* forward_cost_ = nullptr;  // slot_us_per_token_, once measured
};

// Applies a model's activation ("none", "sigmoid", "softmax" per row) in
// place to a runtime's raw output.
void ApplyActivation(const std::string& activation, Embeddings* out);

// Parses the Shoal-* headers of a work message into `h`. On an error, `h`
// still holds the request id and reply subject when the message had them.
Status ParseWorkHeaders(const Delivery& d, wire::WorkHeaders* h);

// The headers of a delivered work message; a load hint is acked and a
// malformed message terminated instead (nullopt), its caller told why
// (through `client`, when not null) if the message says where to reply.
std::optional<wire::WorkHeaders> WorkHeadersOrSettle(Delivery& delivery, NatsClient* client,
                                                     const std::string& worker_id);

// What work gets when the worker stops before running it and it cannot go
// back to the queue (503 worker_stopping).
Status WorkerStopping();

// shoal_worker_handed_back_total{model}: work handed back to the queue unrun.
Counter* HandedBackCounter(MetricsRegistry& metrics, const std::string& model);

// Answers one work message's caller with `status` (no-op without a reply
// subject). The caller then terms the message.
void PublishErrorReply(NatsClient& client, const wire::WorkHeaders& headers, const Status& status,
                       const std::string& worker_id);

}  // namespace shoal
