// Dispatcher: the gateway's side of the queue. Splits a client request into
// chunks, publishes each to JetStream (shoal.work.<model>) with a per-chunk
// pub-ack subject, collects the workers' replies on the gateway's own inbox,
// drops duplicates (redeliveries), reassembles chunks in order and completes
// the caller once: with the result, the first error, 429 when the queue is
// full, 503 when no stream takes the work, or 504 at the deadline.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/status.h"
#include "queue/nats_client.h"
#include "wire/work_message.h"

namespace shoal {

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
};

struct ItemResult {
  std::vector<std::string> items;  // one MessagePack result document per input, in input order
};

using ItemCallback = std::function<void(Result<ItemResult>)>;
// Streamed output before the result: `item` indexes the job's inputs,
// `chunk` is one MessagePack document. Called in order for each item, on
// the dispatcher's reply thread; it must not block.
using PartialCallback = std::function<void(size_t item, std::string_view chunk)>;

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
  std::string gateway_id;        // empty: random
  int chunk_size = 32;           // inputs per queue message
  int64_t retry_after_s = 1;     // advertised on 429/503
  Status Validate() const;
};

class Dispatcher final : public WorkSubmitter {
 public:
  // `client` and `metrics` must outlive the dispatcher.
  static Result<std::unique_ptr<Dispatcher>> Create(const DispatcherOptions& options, NatsClient* client,
                                                    MetricsRegistry* metrics, const Clock* clock = nullptr);
  ~Dispatcher() override;
  void SubmitEmbed(EmbedJob job, EmbedCallback done) override;
  void SubmitItems(ItemJob job, ItemCallback done, PartialCallback partial = {}) override;
  // Queues a load hint on the model's subject (de-duplicated per 10 s).
  void RequestLoad(const std::string& model) override;
  // Fails every pending request with Unavailable and stops the timer.
  void Stop();
  size_t InFlight() const;
  const std::string& reply_subject() const { return reply_subject_; }

 private:
  struct Pending;
  // Every chunk's reply, in chunk order, or the request's first error.
  using Parts = Result<std::vector<wire::WorkReply>>;
  struct Chunk {
    std::string data;      // encoded WorkBody
    int64_t estimate = 0;  // Shoal-Token-Estimate
  };
  Dispatcher() = default;
  // Registers the request and publishes its chunks; `done` gets the parts.
  void Submit(const std::string& model, int64_t deadline_unix_ms, std::vector<Chunk> chunks,
              std::function<void(Parts)> done, PartialCallback partial, std::vector<size_t> first_item);
  static void OnMessage(natsConnection*, natsSubscription*, natsMsg*, void* closure);
  void HandleReply(std::string_view data);
  void HandlePubAck(std::string_view subject_tail, natsMsg* msg);
  // Removes the request and completes it with `result`, once.
  void Complete(const std::string& id, Parts result);
  void TimerLoop();

  DispatcherOptions options_;
  NatsClient* client_ = nullptr;
  const Clock* clock_ = nullptr;
  std::string id_;
  std::string reply_subject_;   // _SHOAL.gw.<id>.r
  std::string ack_prefix_;      // _SHOAL.gw.<id>.a.
  NatsSubscriptionPtr sub_;
  std::atomic<uint64_t> seq_{0};

  mutable std::mutex mu_;  // guards pending_, deadlines_, stop_
  std::unordered_map<std::string, std::shared_ptr<Pending>> pending_;
  std::multimap<int64_t, std::string> deadlines_;
  bool stop_ = false;
  std::condition_variable timer_cv_;
  std::thread timer_;

  Counter* published_ = nullptr;
  Counter* duplicates_ = nullptr;
  Counter* queue_full_ = nullptr;
  Counter* timeouts_ = nullptr;
  Histogram* chunks_per_request_ = nullptr;
};

}  // namespace shoal
