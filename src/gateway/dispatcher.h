// Dispatcher: the gateway's side of the queue. Splits a client request into
// chunks, publishes each to JetStream (shoal.work.<model>) with a per-chunk
// pub-ack subject, collects the workers' replies on the gateway's own inbox,
// drops duplicates (redeliveries), reassembles chunks in order and completes
// the caller once: with the result, the first error, 429 when the queue is
// full, 503 when no stream takes the work, or 504 at the deadline.
//
// With dispatch "push" (the baseline that pulling is measured against) each
// chunk goes instead straight to one worker that has the model loaded, on
// core NATS (shoal.push.<worker>.<model>; not durable), chosen by least
// outstanding rows or by power of two choices. The estimate of a worker's
// load is its last load report (shoal.load.<worker>, every few ms) plus the
// rows this gateway sent it since that report, minus what came back since:
// exact for this gateway's own work, and as fresh as the reports for other
// gateways' work. Chunks for a model no live worker reports loaded go to the
// queue as in pull mode. A worker that vanishes (no subscriber: NATS answers
// "no responders"; or no load report for push_worker_timeout_ms) fails the
// requests with chunks outstanding there with 503 worker_lost.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/status.h"
#include "gateway/http.h"
#include "queue/nats_client.h"
#include "wire/work_message.h"

namespace shoal {

class BlobOffload;

// One request for a token model (embed, score or classify) as the routes
// parsed it. Its result is one row of floats per input.
struct EmbedJob {
  std::string task = "embed";
  std::string model;
  std::vector<std::string> texts;                 // either texts ...
  std::vector<std::vector<int32_t>> token_ids;    // ... or token ids
  std::vector<std::string> texts_pair;            // score: texts[i] with texts_pair[i]
  bool truncate = false;
  int64_t deadline_unix_ms = 0;
  std::shared_ptr<ClientPresence> client;  // see ItemJob::client
  size_t size() const { return texts.empty() ? token_ids.size() : texts.size(); }
};

struct EmbedResult {
  int rows = 0;
  int dim = 0;
  std::vector<float> data;  // rows * dim, in input order (embeddings, scores or label probabilities)
  int64_t prompt_tokens = 0;
  bool truncated_any = false;
};

using EmbedCallback = std::function<void(Result<EmbedResult>)>;

// One request for an item task (ocr, generate): whole inputs the runtime
// takes itself. Each item travels in its own queue message, so several
// workers can serve one request.
struct ItemJob {
  std::string task;
  std::string model;
  std::vector<std::string> items;  // image bytes, or a MessagePack request document
  int64_t deadline_unix_ms = 0;
  // What an input is called in the messages of errors a worker found in it
  // ("image": an error whose reason holds "image", such as invalid_image,
  // reads "image 2: ..."); empty: messages as the worker wrote them.
  std::string item_name;
  // The caller's HTTP client (may be null). Once it is gone, the workers
  // are told to stop the request's work (as a PartialCallback returning
  // false does); the request still completes as usual.
  std::shared_ptr<ClientPresence> client;
};

struct ItemResult {
  std::vector<std::string> items;  // one MessagePack result document per input, in input order
};

using ItemCallback = std::function<void(Result<ItemResult>)>;
// Streamed output before the result: `item` indexes the job's inputs,
// `chunk` is one MessagePack document. Called in order for each item, on
// the dispatcher's reply thread; it must not block. Returns false once the
// caller is gone (its client disconnected): the dispatcher then tells the
// workers (wire::kCancelSubject), which stop the request's work where they
// can; the request still completes as usual.
using PartialCallback = std::function<bool(size_t item, std::string_view chunk)>;

// What routes need from the queue side; faked in route unit tests.
class WorkSubmitter {
 public:
  virtual ~WorkSubmitter() = default;
  // Completes `done` exactly once, from any thread, possibly inline.
  virtual void SubmitEmbed(EmbedJob job, EmbedCallback done) = 0;
  // Same contract for item tasks; `partial` (may be empty) gets streamed
  // output before `done`.
  virtual void SubmitItems(ItemJob job, ItemCallback done, PartialCallback partial = {}) {
    (void)job;
    (void)partial;
    done(Unavailable("this gateway cannot queue item tasks"));
  }
  // Asks the fleet to load `model` without sending work (a gateway that
  // answers 503 instead of waiting). Best effort; repeated asks coalesce.
  virtual void RequestLoad(const std::string& model) { (void)model; }
};

struct DispatcherOptions {
  std::string gateway_id;        // empty: random; at most 128 bytes
  int chunk_size = 32;           // inputs per queue message
  int64_t retry_after_s = 1;     // advertised on 429/503
  std::string dispatch = "pull";           // pull | push
  std::string push_policy = "least-loaded";  // push: least-loaded | p2c
  // Push: a worker with no load report for this long is dropped and its
  // outstanding work failed (503 worker_lost).
  int64_t push_worker_timeout_ms = 3000;
  Status Validate() const;
};

// What the push dispatcher knows about one worker.
struct PushWorkerLoad {
  std::string id;
  std::set<std::string> models;  // loaded, as last reported
  int64_t reported_rows = 0;     // rows held or running, as last reported
  int64_t own_rows = 0;          // rows this gateway sent there, not yet answered
  int64_t own_at_report = 0;     // own_rows when the last report arrived
  int64_t last_report_mono_us = 0;
  // The estimate the policies compare.
  int64_t Estimate() const { return std::max(own_rows, reported_rows + own_rows - own_at_report); }
};

class Dispatcher final : public WorkSubmitter {
 public:
  // `client` and `metrics` must outlive the dispatcher.
  static Result<std::unique_ptr<Dispatcher>> Create(const DispatcherOptions& options, NatsClient* client,
                                                    MetricsRegistry* metrics, const Clock* clock = nullptr);
  ~Dispatcher() override;
  void SubmitEmbed(EmbedJob job, EmbedCallback done) override;
  void SubmitItems(ItemJob job, ItemCallback done, PartialCallback partial = {}) override;
  // Offloads work messages over its threshold (docs/blob-store.md); must
  // outlive the dispatcher's use of it. Call before the first Submit.
  void SetBlobOffload(BlobOffload* offload) { offload_ = offload; }
  // Queues a load hint on the model's subject (de-duplicated per 10 s).
  void RequestLoad(const std::string& model) override;
  // Fails every pending request with Unavailable and stops the timer.
  void Stop();
  size_t InFlight() const;
  // Push mode: the workers known from load reports now (a copy).
  std::vector<PushWorkerLoad> PushWorkers() const;
  const std::string& reply_subject() const { return reply_subject_; }
  // Tests only: runs in every push-mode submit after the workers are chosen
  // and before the request is registered (the window a worker can be
  // dropped in). Set before the first submit.
  void SetAfterPickHook(std::function<void()> hook) { after_pick_hook_ = std::move(hook); }

 private:
  struct Pending;
  // Every chunk's reply, in chunk order, or the request's first error.
  using Parts = Result<std::vector<wire::WorkReply>>;
  struct Chunk {
    wire::EncodedMessage data;  // encoded WorkBody, large items as pieces of their own
    int64_t estimate = 0;  // Shoal-Token-Estimate
    int64_t rows = 0;      // inputs (push: counted against the chosen worker)
  };
  Dispatcher() = default;
  // Registers the request and publishes its chunks; `done` gets the parts.
  void Submit(const std::string& model, int64_t deadline_unix_ms, std::vector<Chunk> chunks,
              std::function<void(Parts)> done, PartialCallback partial, std::vector<size_t> first_item,
              std::string item_name = {}, std::shared_ptr<ClientPresence> client = {});
  // Whether request `id` still waits for its answer.
  bool IsPending(const std::string& id) const;
  // The caller of request `id` is gone (or the request failed: not
  // `client_gone`): tells the workers, once (wire::kCancelSubject), so they
  // stop what they can of its work.
  void AnnounceCancel(const std::string& id, Pending& p, bool client_gone = true);
  // Publishes chunk `c` (its body `data`, or empty with `payload_ref` set);
  // on failure completes the request with the error and returns false.
  // `worker` non-empty: pushed straight to that worker instead of the queue.
  bool PublishChunk(const std::string& id, int c, int count, const std::string& model, const std::string& worker,
                    const std::string& deadline, int64_t estimate, std::string_view data,
                    const std::string& payload_ref);
  // Counts `n` more chunks of request `id` as sent (see Pending::sent).
  void AddSent(const std::string& id, int n);
  static void OnMessage(natsConnection*, natsSubscription*, natsMsg*, void* closure);
  // A reply that came inline: handled now, or queued behind a reply by
  // reference of the same request still being fetched.
  void HandleReply(std::string_view data);
  void HandleDecodedReply(wire::WorkReply reply);
  // A reply stored in the blob store (of `chunk`, -1 when the worker did not
  // say): fetched, handled and deleted on an offload thread, in order with
  // the request's other replies (a streamed event must not be overtaken by
  // the ones after it, nor by the final reply).
  void HandleReplyRef(std::string ref, std::string request_id, int chunk);
  // One reply of a request with a reply by reference in flight.
  struct QueuedReply {
    std::string ref;                       // non-empty: to fetch from the blob store
    int chunk = -1;                        // ref: its chunk, -1 unknown
    std::optional<wire::WorkReply> reply;  // else: the reply itself
  };
  // Handles request `id`'s queued replies in order until none is left. On an
  // offload thread; one at a time per request.
  void DrainReplies(const std::string& id);
  // Fetches a reply by reference and handles it. A failed fetch fails the
  // request, unless its chunk is answered already (a redelivered copy).
  void FetchReply(const std::string& ref, const std::string& request_id, int chunk);
  void HandlePubAck(std::string_view subject_tail, natsMsg* msg);
  // Removes the request and completes it with `result`, once.
  // Answers request `id` with `result`, unless it is answered already
  // (false).
  bool Complete(const std::string& id, Parts result);
  void TimerLoop();
  // Push: the worker to send `rows` of `model` to (counted as sent), or
  // empty when no live worker reports it loaded.
  std::string PickWorker(const std::string& model, int64_t rows);
  void HandleLoadReport(std::string_view data);
  // Push: `rows` sent to `worker` are answered or given up on.
  void ReleaseRows(const std::string& worker, int64_t rows);
  // Push: drops workers without a recent load report and fails the
  // requests that had chunks there.
  void SweepLostWorkers();
  // Fails every request with a chunk outstanding at `worker`.
  void FailWorkerRequests(const std::string& worker, const std::string& why);
  // Push: after registering request `id`, completes it with 503 worker_lost
  // (and returns false) when a worker chosen for it was dropped meanwhile.
  bool ChosenWorkersLive(const std::string& id, const Pending& p);

  DispatcherOptions options_;
  NatsClient* client_ = nullptr;
  BlobOffload* offload_ = nullptr;
  const Clock* clock_ = nullptr;
  std::string id_;
  std::string subject_prefix_;  // _SHOAL.gw.<id>. (with a random part under a fixed --gateway-id)
  std::string reply_subject_;   // _SHOAL.gw.<id>.r
  std::string ack_prefix_;      // _SHOAL.gw.<id>.a.
  SubscriptionPtr sub_;
  SubscriptionPtr load_sub_;  // push: shoal.load.>
  std::string push_nr_prefix_;    // push: _SHOAL.gw.<id>.n. (no-responders come back here)
  bool push_ = false;
  std::string request_prefix_;  // "<id_>-" or, under a fixed gateway id, "<id_>-<random>-"
  std::atomic<uint64_t> seq_{0};

  mutable std::mutex push_mu_;  // guards push_workers_, rng_
  std::map<std::string, PushWorkerLoad> push_workers_;
  std::mt19937_64 rng_{std::random_device{}()};

  std::mutex order_mu_;  // guards in_order_
  // Requests with a reply by reference being fetched: their replies, in
  // the order they came, handled by DrainReplies.
  std::unordered_map<std::string, std::deque<QueuedReply>> in_order_;

  mutable std::mutex mu_;  // guards pending_, deadlines_, stop_
  std::unordered_map<std::string, std::shared_ptr<Pending>> pending_;
  std::multimap<int64_t, std::string> deadlines_;  // steady-clock µs -> request id
  bool stop_ = false;
  std::condition_variable timer_cv_;
  std::thread timer_;

  Counter* published_ = nullptr;
  Counter* duplicates_ = nullptr;
  Counter* cancels_ = nullptr;
  Counter* queue_full_ = nullptr;
  Counter* timeouts_ = nullptr;
  Histogram* chunks_per_request_ = nullptr;
  Counter* pushed_ = nullptr;
  Counter* push_fallback_ = nullptr;
  Counter* worker_lost_ = nullptr;
  std::function<void()> after_pick_hook_;
};

}  // namespace shoal
