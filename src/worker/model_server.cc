#include <nats/nats.h>

#include "worker/model_server.h"

#include <algorithm>
#include <system_error>
#include <charconv>
#include <cmath>
#include <optional>

#include "common/log.h"

namespace shoal {
namespace {

// A runtime reports failures as a Status. One that throws instead (an
// allocation its input made too large, a bug) fails that pass with
// runtime_error, like any other failed pass, rather than ending the worker
// and, through redelivery, the next worker that pulls the same work.
template <typename F>
auto RunGuarded(F&& run) -> decltype(run()) {
  try {
    return run();
  } catch (const std::exception& e) {
    return Internal(std::string("exception: ") + e.what(), "runtime_error");
  } catch (...) {
    return Internal("an exception that is not a std::exception", "runtime_error");
  }
}

// Work handed back because the runtime was unavailable comes back after this.
constexpr int64_t kRedeliverDelayMs = 250;
// How long the fetcher waits at a time for room under --blob-max-fetched
// (it goes round its loop in between, seeing a stop).
constexpr int64_t kPayloadRoomWaitMs = 50;
// How long a message run on its own waits for an out-of-process runtime to
// come back from a restart before it is handed back instead.
constexpr int64_t kRuntimeBackWaitMs = 5000;
// How long a model with work in the queue waits for room under
// --pull-ahead before it may pull past the bound (see PullGate): 8 device
// turns of other models, or 2 and 500 ms (slow passes), more than it
// normally takes for a claim to come free. A device with no turns at all
// (one stuck pass) never makes it starved.
constexpr int64_t kStarvedAfterTurns = 8;
constexpr auto kStarvedAfter = std::chrono::milliseconds(500);
constexpr int64_t kPendingAskMs = 500;  // the longest wait for the server's answer
constexpr int kMaxLanes = 1024;  // see ModelServer::lanes_

// Counts `n` messages in `count` for as long as it lives (see
// ModelServer::in_hand_).
class InHand {
 public:
  InHand(std::atomic<size_t>& count, size_t n, bool already_counted = false) : count_(count), n_(n) {
    if (!already_counted) count_ += n_;
  }
  ~InHand() { count_ -= n_; }
  InHand(const InHand&) = delete;
  InHand& operator=(const InHand&) = delete;

 private:
  std::atomic<size_t>& count_;
  const size_t n_;
};

bool ParseInt(std::string_view s, int64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

void ApplyActivation(const std::string& activation, Embeddings* out) {
  if (activation == "sigmoid") {
    for (float& v : out->data) v = 1.0f / (1.0f + std::exp(-v));
  } else if (activation == "softmax") {
    for (int r = 0; r < out->rows; ++r) {
      float* row = out->data.data() + static_cast<size_t>(r) * out->dim;
      const float max = *std::max_element(row, row + out->dim);
      float sum = 0;
      for (int k = 0; k < out->dim; ++k) sum += row[k] = std::exp(row[k] - max);
      for (int k = 0; k < out->dim; ++k) row[k] /= sum;
    }
  }
}

Status ParseWorkHeaders(const Delivery& d, wire::WorkHeaders* h) {
  h->request_id = std::string(d.Header(wire::kHdrRequestId));
  h->reply_to = std::string(d.Header(wire::kHdrReplyTo));
  if (h->request_id.empty() || h->reply_to.empty())
    return InvalidArgument("work message lacks request id or reply subject");
  if (!IsPublishableSubject(h->reply_to)) {
    // Nobody can be answered there: the message is termed unanswered.
    h->request_id.clear();
    h->reply_to.clear();
    return InvalidArgument("work message has a reply subject nothing can be published to", "invalid_work_message");
  }
  std::string_view chunk = d.Header(wire::kHdrChunk);
  if (!chunk.empty()) {
    auto slash = chunk.find('/');
    int64_t i = 0, n = 0;
    if (slash == std::string_view::npos || !ParseInt(chunk.substr(0, slash), &i) ||
        !ParseInt(chunk.substr(slash + 1), &n) || i < 0 || n < 1 || i >= n || n > INT32_MAX)
      return InvalidArgument("bad " + std::string(wire::kHdrChunk) + " header '" + std::string(chunk) +
                                 "' (index/count, 0 <= index < count)",
                             "invalid_work_message");
    h->chunk_index = static_cast<int>(i);
    h->chunk_count = static_cast<int>(n);
  }
  int64_t v = 0;
  if (ParseInt(d.Header(wire::kHdrDeadline), &v)) h->deadline_unix_ms = v;
  if (ParseInt(d.Header(wire::kHdrTokenEstimate), &v)) h->token_estimate = v;
  h->payload_ref = std::string(d.Header(wire::kHdrPayloadRef));
  return Status::Ok();
}

ModelServer::ModelServer(ModelServerDeps deps)
    : d_(std::move(deps)), batcher_(d_.config.batching, d_.clock), activation_(d_.config.EffectiveActivation()) {
  gated_poll_ms_ = d_.idle_poll_ms;
  Labels l = {{"model", d_.config.name}};
  auto* m = d_.metrics;
  batches_ = m->GetCounter("shoal_worker_batches_total", "Forward passes run.", l);
  batch_rows_ = m->GetHistogram("shoal_worker_batch_rows", "Rows per forward pass.", l, SizeBuckets());
  std::vector<double> token_buckets;
  for (double v = 16; v <= 65536; v *= 2) token_buckets.push_back(v);
  batch_tokens_ = m->GetHistogram("shoal_worker_batch_padded_tokens",
                                  "Padded tokens (rows x longest) per forward pass.", l, token_buckets);
  run_seconds_ = m->GetHistogram("shoal_worker_forward_seconds", "Forward pass time.", l, LatencyBuckets());
  pulled_wait_seconds_ = m->GetHistogram(
      "shoal_worker_queue_wait_seconds",
      "Time work waited in the shared queue before this worker pulled it, first deliveries only (work queued "
      "before the model was loaded here is counted in shoal_worker_load_wait_seconds instead).",
      l, LatencyBuckets());
  batch_wait_seconds_ = m->GetHistogram("shoal_worker_batch_wait_seconds",
                                        "Time pulled work waited until its batch was cut, the wait for a device turn included.", l, LatencyBuckets());
  tokens_total_ = m->GetCounter("shoal_worker_tokens_total", "Real (unpadded) tokens embedded.", l);
  expired_ = m->GetCounter("shoal_worker_expired_total", "Work dropped because its deadline passed.", l);
  cancelled_ = m->GetCounter("shoal_worker_cancelled_total",
                             "Inputs not run, or stopped part-way, because their callers went away.", l);
  redelivered_ = m->GetCounter("shoal_worker_redelivered_total", "Work delivered more than once.", l);
  payload_waits_ = m->GetCounter("shoal_worker_blob_payload_waits_total",
                                 "Pulled messages whose offloaded payload waited for room under --blob-max-fetched.", l);
  errors_ = m->GetErrorCodeCounters("shoal_worker_errors_total", "Work answered with an error, by code.", l);
  handed_back_ = HandedBackCounter(*m, d_.config.name);
  load_waits_ = m->GetCounter("shoal_worker_load_waits_total", "Requests that waited for a model to load.", l);
  load_wait_seconds_ = m->GetHistogram("shoal_worker_load_wait_seconds",
                                       "How long requests waited for a model to load.", l,
                                       LatencyBuckets());
  runtime_unavailable_ = m->GetCounter("shoal_worker_runtime_unavailable_total",
                                      "Batches handed back to the queue because the runtime was unavailable.", l);
  pushed_ = m->GetCounter("shoal_worker_pushed_total", "Work messages pushed straight to this worker (push dispatch).", l);
  shortened_ = m->GetCounter("shoal_worker_batches_shortened_total",
                             "Batches cut below the batch budget to the turn quantum because other models were "
                             "waiting for the device.",
                             l);
  forward_cost_ = m->GetGauge("shoal_worker_forward_cost_us_per_token",
                              "Measured forward time per real token (per input for item models) in microseconds of "
                              "one device slot, a moving average over the model's batches since it was loaded: what "
                              "the turn quantum divides by. 0 until measured.",
                              l);
  forward_cost_->Set(0);  // a reload measures again
  turn_wait_seconds_ = m->GetHistogram("shoal_worker_device_wait_seconds",
                                       "Time a formed batch waited for its turn on the device.", l,
                                       LatencyBuckets());
}

ModelServer::~ModelServer() { Stop(); }

void ModelServer::Start() {
  if (!d_.runtime->UsesDevice() && d_.runtime->TakesItems())
    lanes_ = std::clamp(d_.runtime->ConcurrentCalls(), 1, kMaxLanes);
  lane_mode_ = lanes_ > 1;
  fetcher_ = std::thread([this] { FetchLoop(); });
  executor_ = std::thread([this] { ExecLoop(); });
}

void ModelServer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  space_cv_.notify_all();
  // Cut the fetcher's long poll short (an eviction must not wait for it),
  // keeping the subscription: its pull stays listed at the server until it
  // expires, and the subscription must outlive it (see ConsumerPark).
  // Disconnected, the wake cannot be sent: the fetch then ends with its
  // pull (at most --fetch-poll-ms), and the subscription is kept for the
  // reconnection.
  if (d_.consumer && fetcher_.joinable()) {
    while (!fetcher_done_) {
      (void)d_.consumer->Wake();
      for (int i = 0; i < 20 && !fetcher_done_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (fetcher_.joinable()) fetcher_.join();
  const Status stopping = WorkerStopping();
  // Pulled work goes back to the queue once the subscription's last pull
  // has expired, and a little later (the server removes an expired pull on
  // a timer): sent back at once, it could come straight back to that pull
  // and cost a delivery.
  constexpr int64_t kAfterLastPullMs = 50;
  const int64_t pull_left_ms = d_.consumer ? d_.consumer->PullLeftMs() : 0;
  const int64_t hand_back_after_ms = kAfterLastPullMs + pull_left_ms;
  // What the server delivers to the subscription from now on (and what it
  // delivered that no fetch took) waits there for the model's next load or
  // is handed back when the park closes it.
  if (d_.consumer && d_.park) d_.park(std::move(d_.consumer));
  d_.consumer.reset();
  if (executor_.joinable()) executor_.join();
  // Batches handed to lanes run to their end, as the executor's does.
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_stop_ = true;
  }
  lane_cv_.notify_all();
  for (auto& t : lane_threads_) t.join();
  lane_threads_.clear();
  // Pulled but never run: hand it back rather than leave it to AckWait.
  std::vector<std::unique_ptr<PendingWork>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (batcher_.size() > 0)
      for (auto& w : batcher_.Take()) left.push_back(std::move(w));
    in_hand_ -= left.size();
  }
  if (d_.held_rows) {
    int64_t rows = 0;
    for (const auto& w : left) rows += w->row_count();
    d_.held_rows->Done(rows);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    MaybeReleaseClaimLocked();
  }
  // Pulled and still waiting for room for their payloads: back as well.
  HandBackDeferred(hand_back_after_ms, stopping);
  Release(std::move(left), stopping, hand_back_after_ms);
}

std::optional<wire::WorkHeaders> WorkHeadersOrSettle(Delivery& delivery, NatsClient* client,
                                                     const std::string& worker_id) {
  if (!delivery.Header(wire::kHdrLoadHint).empty()) {
    (void)delivery.Ack();  // the model is loaded: the hint has done its job
    return std::nullopt;
  }
  wire::WorkHeaders headers;
  if (Status st = ParseWorkHeaders(delivery, &headers); !st.ok()) {
    LOG_WARN("worker", "dropping malformed work message: " << st.message());
    // A caller that can be reached hears why, rather than at its deadline.
    if (client != nullptr && !headers.request_id.empty()) PublishErrorReply(*client, headers, st, worker_id);
    (void)delivery.Term();
    return std::nullopt;
  }
  return headers;
}

void ModelServer::Release(std::vector<std::unique_ptr<PendingWork>> work, const Status& last_chance,
                          int64_t delay_ms) {
  for (auto& w : work) HandBackOrFail(w->delivery, w->headers, w->progress, last_chance, delay_ms);
}

void ModelServer::HandBackOrFail(Delivery& delivery, const wire::WorkHeaders& headers,
                                 ProgressKeeper::Watch& progress, const Status& last_chance, int64_t delay_ms) {
  progress.Finish();  // before the message is settled or handed back
  // Pushed work has no queue to go back to: its caller hears now.
  if (delivery.is_core() || static_cast<int64_t>(delivery.NumDelivered()) >= d_.max_deliver) {
    Fail(delivery, headers, last_chance);
    return;
  }
  (void)delivery.Nak(delay_ms);
  handed_back_->Inc();
}

Status ModelServer::Reply(const wire::WorkReply& reply, const std::string& reply_to) {
  std::string encoded = wire::EncodeWorkReply(reply);
  // NATS refuses a body over what max_payload leaves (headers included):
  // that goes by reference whatever the threshold says.
  if (d_.blob && (d_.blob->ShouldOffload(encoded.size()) || !d_.client->BodyFits(encoded.size())))
    return ReplyByRef(encoded, reply, reply_to);
  Status s = d_.client->Publish(reply_to, encoded);
  if (!s.ok()) LOG_WARN("worker", "reply to " << reply_to << " failed: " << s.ToString());
  return s;
}

Status ModelServer::ReplyByRef(const std::string& encoded, const wire::WorkReply& reply,
                               const std::string& reply_to) {
  auto ref = d_.blob->Put(encoded, "reply");
  if (!ref.ok()) return BlobOffload::PutFailure(ref.status(), "the result");
  natsMsg* raw = nullptr;
  if (natsMsg_Create(&raw, reply_to.c_str(), nullptr, nullptr, 0) != NATS_OK) return Internal("cannot build reply");
  NatsMsgPtr msg(raw);
  natsMsgHeader_Set(raw, wire::kHdrPayloadRef, ref->ToString().c_str());
  // So the gateway can fail the request at once if the payload is lost
  // (unless this chunk is answered already), and keep its replies in order.
  natsMsgHeader_Set(raw, wire::kHdrRequestId, reply.request_id.c_str());
  natsMsgHeader_Set(raw, wire::kHdrChunk, std::to_string(reply.chunk_index).c_str());
  Status s = d_.client->PublishMsg(raw);
  if (!s.ok()) LOG_WARN("worker", "reply to " << reply_to << " failed: " << s.ToString());
  return s;
}

Status WorkerStopping() {
  return Unavailable("the worker stopped before running this work; retry", "worker_stopping");
}

Counter* HandedBackCounter(MetricsRegistry& metrics, const std::string& model) {
  return metrics.GetCounter("shoal_worker_handed_back_total",
                            "Work handed back to the queue unrun (model stopping, runtime unavailable).",
                            {{"model", model}});
}

void PublishErrorReply(NatsClient& client, const wire::WorkHeaders& headers, const Status& status,
                       const std::string& worker_id) {
  if (headers.reply_to.empty()) return;
  wire::WorkReply r;
  r.request_id = headers.request_id;
  r.chunk_index = headers.chunk_index;
  r.status = status;
  r.worker_id = worker_id;
  Status s = client.Publish(headers.reply_to, wire::EncodeWorkReply(r));
  if (!s.ok()) LOG_WARN("worker", "reply to " << headers.reply_to << " failed: " << s.ToString());
}

void ModelServer::Fail(Delivery& delivery, const wire::WorkHeaders& headers, const Status& status) {
  PublishErrorReply(*d_.client, headers, status, d_.worker_id);
  // Terminal: bad input or a failed run is never retried in a loop.
  (void)delivery.Term();
  errors_->Get(status.ReasonOrDefault())->Inc();
}

bool ModelServer::FailIfExpired(Delivery& delivery, const wire::WorkHeaders& headers, int64_t now_unix_ms) {
  if (headers.deadline_unix_ms <= 0 || now_unix_ms <= headers.deadline_unix_ms) return false;
  expired_->Inc();
  Fail(delivery, headers, DeadlineExceeded("deadline passed before the work was run"));
  return true;
}

bool ModelServer::FailIfExpiredOrCancelled(Delivery& delivery, const wire::WorkHeaders& headers,
                                           int64_t now_unix_ms) {
  if (FailIfExpired(delivery, headers, now_unix_ms)) return true;
  if (d_.cancelled == nullptr || !d_.cancelled->Contains(headers.request_id)) return false;
  cancelled_->Inc();
  Fail(delivery, headers, Cancelled());
  return true;
}

Result<std::unique_ptr<PendingWork>> ModelServer::Prepare(std::string_view data) const {
  ASSIGN_OR_RETURN(wire::WorkBody body, wire::DecodeWorkBody(data));
  const ModelConfig& c = d_.config;
  if (body.model != c.name) return NotFound("this worker does not serve model '" + body.model + "'");
  if (body.task != c.task) return InvalidArgument("model '" + c.name + "' does not do task '" + body.task + "'");
  if (body.size() == 0) return InvalidArgument("no inputs");
  if (d_.runtime->TakesItems()) return PrepareItems(std::move(body));
  if (!body.items.empty())
    return InvalidArgument("model '" + c.name + "' takes text, not binary inputs", "wrong_input_type");
  auto w = std::make_unique<PendingWork>();
  w->rows.reserve(body.size());
  const int max_len = c.max_seq_len;
  const auto& tok = *d_.tokenizer;
  auto too_long = [&](size_t i, int64_t n) {
    return Unprocessable("input " + std::to_string(body.first_input + static_cast<int64_t>(i)) + " has " +
                             std::to_string(n) +
                             " tokens; model '" + c.name + "' takes at most " + std::to_string(max_len) +
                             " (send \"truncate\": true to cut it)",
                         "input_too_long");
  };
  const bool pairs = c.TakesPairs();
  if (pairs && (body.texts_pair.size() != body.texts.size() || !body.token_ids.empty()))
    return InvalidArgument("model '" + c.name + "' scores text pairs; send pairs of strings");
  if (!pairs && !body.texts_pair.empty())
    return InvalidArgument("model '" + c.name + "' takes single texts, not pairs");
  for (size_t i = 0; i < body.texts.size(); ++i) {
    // With truncate, a long text is read only as far as it is kept; without
    // it, whole, for the count its error reports.
    Encoding e = pairs ? tok.EncodePair(body.texts[i], body.texts_pair[i], max_len, body.truncate)
                       : tok.Encode(body.texts[i], max_len, body.truncate);
    if (e.truncated) {
      if (!body.truncate) return too_long(i, e.full_length);
      w->truncated_any = true;
    }
    if (pairs) w->second_starts.push_back(e.second_start);
    w->rows.push_back(std::move(e.ids));
  }
  const int64_t vocab = static_cast<int64_t>(tok.vocab_size());
  for (size_t i = 0; i < body.token_ids.size(); ++i) {
    auto& in = body.token_ids[i];
    const int64_t input = body.first_input + static_cast<int64_t>(i);  // as the client numbered it
    if (in.empty()) return InvalidArgument("input " + std::to_string(input) + " is an empty token array");
    for (int32_t id : in)
      if (id < 0 || id >= vocab)
        return InvalidArgument("input " + std::to_string(input) + " has token id " + std::to_string(id) +
                                   " outside the vocabulary [0, " + std::to_string(vocab) + ")",
                               "invalid_token_id");
    // Token arrays are the model's own ids without special tokens, as the
    // OpenAI API sends them; add [CLS]/[SEP] unless already framed.
    std::vector<int32_t> row;
    bool framed = in.size() >= 2 && in.front() == tok.cls_id() && in.back() == tok.sep_id();
    if (framed) {
      row = std::move(in);
    } else {
      row.reserve(in.size() + 2);
      row.push_back(tok.cls_id());
      row.insert(row.end(), in.begin(), in.end());
      row.push_back(tok.sep_id());
    }
    if (static_cast<int>(row.size()) > max_len) {
      if (!body.truncate) return too_long(i, static_cast<int64_t>(row.size()));
      row.resize(max_len);
      row.back() = tok.sep_id();
      w->truncated_any = true;
    }
    w->rows.push_back(std::move(row));
  }
  for (const auto& r : w->rows) {
    w->token_counts.push_back(static_cast<int32_t>(r.size()));
    w->tokens += static_cast<int64_t>(r.size());
  }
  return w;
}

Result<std::unique_ptr<PendingWork>> ModelServer::PrepareItems(wire::WorkBody body) const {
  const ModelConfig& c = d_.config;
  if (!body.token_ids.empty() || !body.texts_pair.empty())
    return InvalidArgument("model '" + c.name + "' takes " + (c.ItemTask() ? "whole inputs" : "texts") +
                               ", not token ids or text pairs",
                           "wrong_input_type");
  if (c.ItemTask() && body.items.empty())
    return InvalidArgument("model '" + c.name + "' takes binary inputs, not text", "wrong_input_type");
  auto w = std::make_unique<PendingWork>();
  // A runtime that tokenizes for itself (a remote backend) takes the texts.
  w->items = body.items.empty() ? std::move(body.texts) : std::move(body.items);
  w->tokens = static_cast<int64_t>(w->items.size());
  return w;
}

Result<std::unique_ptr<PendingWork>> ModelServer::PrepareDelivery(const Delivery& delivery,
                                                                 const wire::WorkHeaders& headers) const {
  if (headers.payload_ref.empty()) return Prepare(delivery.Data());
  if (!d_.blob)
    return Status(StatusCode::kBadGateway,
                  "the work payload is in a blob store and this worker has none (--blob-store)", "blob_store_missing");
  ASSIGN_OR_RETURN(std::string payload, d_.blob->Fetch(headers.payload_ref));
  return Prepare(payload);
}

void ModelServer::Push(Delivery delivery) {
  wire::WorkHeaders headers;
  if (Status st = ParseWorkHeaders(delivery, &headers); !st.ok()) {
    LOG_WARN("worker", "dropping malformed pushed message: " << st.message());
    if (!headers.request_id.empty()) Fail(delivery, headers, st);
    return;
  }
  pushed_->Inc();
  if (FailIfExpiredOrCancelled(delivery, headers, d_.clock->NowUnixMs())) return;
  // An offloaded payload is fetched on this (subscription) thread: pushed
  // work over the blob threshold is rare, and push is the baseline.
  auto work = PrepareDelivery(delivery, headers);
  if (!work.ok()) {
    Fail(delivery, headers, work.status());
    return;
  }
  const int64_t rows = (*work)->row_count();
  (*work)->headers = std::move(headers);
  (*work)->delivery = std::move(delivery);
  (*work)->enqueued_mono_us = (*work)->published_mono_us = d_.clock->NowMonoUs();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!stop_) {
      if (d_.held_rows) d_.held_rows->Add(rows);
      batcher_.Add(std::move(work).value());
      ++in_hand_;
      lock.unlock();
      work_cv_.notify_one();
      return;
    }
  }
  Fail((*work)->delivery, (*work)->headers, WorkerStopping());
}

void ModelServer::FetchLoop() {
  struct Done {
    std::atomic<bool>& flag;
    ~Done() { flag = true; }
  } done{fetcher_done_};
  const auto& b = d_.config.batching;
  while (!stop_) {
    // The worker is stopping (its device turns are over): what would be
    // pulled now could never run, only wait to be handed back.
    if (d_.scheduler != nullptr && d_.scheduler->shut_down()) break;
    if (!deferred_.empty()) {
      // Pulled already: taken in before anything new is pulled, whether
      // the batcher has room or not (a message keeping its place in the
      // line for payload room must not wait on anything else meanwhile).
      if (!d_.runtime->Available()) {
        HoldDeferredWhileRuntimeDown();
        continue;
      }
      deferred_down_since_us_ = 0;
      TakeIn(std::exchange(deferred_, {}), /*counted=*/true);
      continue;
    }
    int64_t free_tokens = 0, free_rows = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Pull only what fits the next batch: the rest stays in the shared
      // queue for other workers.
      space_cv_.wait(lock, [&] { return stop_ || (batcher_.FreeTokens() > 0 && batcher_.FreeRows() > 0); });
      if (stop_) break;
      free_tokens = batcher_.FreeTokens();
      free_rows = batcher_.FreeRows();
    }
    if (!d_.runtime->Available()) {
      // The runtime is restarting: leave the work in the queue (for other
      // workers, or for us once it is back) rather than burn deliveries.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ForgetRoomWait();
      continue;
    }
    int want = static_cast<int>(std::clamp<int64_t>(
        static_cast<int64_t>(free_tokens / std::max(1.0, avg_tokens_per_msg_)), 1, std::max<int64_t>(1, free_rows)));
    want = std::min(want, b.max_batch_size);
    if (d_.held_rows && d_.held_rows->limit() > 0) {
      // The worker already holds as much as its bound: leave the rest in the
      // shared queue for whichever worker frees up first.
      // The bound is in rows, a pull takes messages: as many as the rows
      // left hold at the recent rows per message (one at least, and only
      // one before any message has told how many rows they carry).
      const bool known = avg_rows_per_msg_ > 0;
      const double rows_per_msg = known ? std::max(1.0, avg_rows_per_msg_) : 1.0;
      const int64_t room = d_.held_rows->Room(static_cast<int64_t>(std::ceil(want * rows_per_msg)), 100);
      if (room <= 0) {
        ForgetRoomWait();
        continue;
      }
      want = known ? static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(room / rows_per_msg), 1, want)) : 1;
    }
    int64_t poll_ms = d_.fetch_poll_ms;
    if (d_.pull_gate != nullptr && d_.pull_gate->bounded()) {
      // Load-aware pulling: open a pull only while few passes wait for this
      // worker's device (work for this model waiting already is one of them:
      // what comes now joins it), and keep it open briefly, since a pull
      // cannot be withdrawn once the device falls behind.
      bool waiting;
      {
        std::lock_guard<std::mutex> lock(mu_);
        waiting = claim_held_;
      }
      // Work delivered late to an earlier pull is ours already: take it at
      // once (waiting for room would leave it unacked, and unseen by the
      // device scheduler, for as long as the device is behind). A model
      // with work in the queue that has found no room for a while pulls
      // past the bound by one pass (see PullGate).
      PullGate::Puller puller = waiting ? PullGate::Puller::kHolder : PullGate::Puller::kWaiting;
      // The stream's count includes what this server holds itself.
      const bool queued = !waiting && d_.scheduler != nullptr && d_.backlog &&
                          d_.backlog() > static_cast<int64_t>(in_hand_.load());
      const auto now = std::chrono::steady_clock::now();
      if (!queued) {
        ForgetRoomWait();
      } else if (room_wait_from_turn_ < 0) {
        room_wait_from_turn_ = static_cast<int64_t>(d_.scheduler->turns_granted());
        room_wait_since_ = now;
      } else if (const int64_t turns = static_cast<int64_t>(d_.scheduler->turns_granted()) - room_wait_from_turn_;
                 turns >= kStarvedAfterTurns || (turns >= 2 && now - room_wait_since_ >= kStarvedAfter)) {
        // The device keeps running other models' passes, yet no claim
        // comes free: they keep theirs (see PullGate). A device that is
        // stuck (no turns) is no reason to take work another worker could.
        // The stream's count also holds work running at other workers: the
        // server says whether any waits undelivered (asked at most every
        // kStarvedAfter, so a busy fleet does not flood it, and an answer
        // is not trusted for longer: another worker may take the work).
        if (now - pending_asked_ >= kStarvedAfter) {
          pending_asked_ = now;
          auto pending = d_.consumer->NumPending(kPendingAskMs);
          starved_ = pending.ok() && *pending > 0;
        }
        if (starved_) puller = PullGate::Puller::kStarved;
      }
      if (d_.consumer->Undelivered() == 0 && !d_.pull_gate->WaitForRoom(20, &stop_, puller)) continue;
      ForgetRoomWait();
      poll_ms = std::min(poll_ms, gated_poll_ms_);
    }
    auto fetched = d_.consumer->Fetch(want, poll_ms);
    // A model that keeps getting nothing polls less often (twice as long
    // each time, up to fetch_poll_ms); work brings the short poll back.
    gated_poll_ms_ = fetched.ok() && fetched->empty() ? std::min(d_.fetch_poll_ms, gated_poll_ms_ * 2) : d_.idle_poll_ms;
    if (!fetched.ok()) {
      if (stop_) break;
      // A lost connection is logged once by the NATS client, not per poll.
      if (fetched.status().reason() != "nats_disconnected")
        LOG_WARN("worker", "fetch for " << d_.config.name << " failed: " << fetched.status().ToString());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    if (fetched->empty()) continue;
    InHand in_hand(in_hand_, fetched->size());  // until TakeIn counts them
    LOG_DEBUG("worker", d_.config.name << ": fetched " << fetched->size() << " (asked " << want << ")");
    std::vector<PulledWork> pulled;
    pulled.reserve(fetched->size());
    for (Delivery& delivery : *fetched) {
      auto headers = WorkHeadersOrSettle(delivery, d_.client, d_.worker_id);
      if (!headers) continue;
      PulledWork& p = pulled.emplace_back();
      p.info = delivery.Metadata();  // one parse per message
      if (p.info.num_delivered > 1) redelivered_->Inc();
      // Noted in progress from now on: fetching the payloads before it
      // (from the blob store) may take longer than AckWait.
      if (d_.progress != nullptr) p.progress = d_.progress->Start({delivery.AckSubject()});
      p.delivery = std::move(delivery);
      p.headers = std::move(*headers);
    }
    TakeIn(std::move(pulled), /*counted=*/false);
  }
}

void ModelServer::HoldDeferredWhileRuntimeDown() {
  // Out of the line for payload room: other models' payloads need not wait
  // for this runtime. Work whose caller stopped waiting is answered now.
  const int64_t now_ms = d_.clock->NowUnixMs();
  std::vector<PulledWork> keep;
  for (PulledWork& p : deferred_) {
    p.payload_ticket = ByteBudget::Ticket();
    if (FailIfExpiredOrCancelled(p.delivery, p.headers, now_ms)) {
      --in_hand_;
      continue;
    }
    keep.push_back(std::move(p));
  }
  deferred_ = std::move(keep);
  const int64_t now_us = d_.clock->NowMonoUs();
  if (deferred_down_since_us_ == 0) {
    deferred_down_since_us_ = now_us;
  } else if (now_us - deferred_down_since_us_ >= kRuntimeBackWaitMs * 1000) {
    // Down for longer than a restart takes: back to the queue, for a worker
    // whose runtime is up (as a batch that waited for it would be).
    HandBackDeferred(kRedeliverDelayMs,
                     Unavailable("model '" + d_.config.name + "' runtime was unavailable on every delivery of this work",
                                 "runtime_unavailable"));
    deferred_down_since_us_ = 0;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

void ModelServer::HandBackDeferred(int64_t delay_ms, const Status& last_chance) {
  for (PulledWork& p : deferred_) HandBackOrFail(p.delivery, p.headers, p.progress, last_chance, delay_ms);
  in_hand_ -= deferred_.size();
  deferred_.clear();
}

void ModelServer::TakeIn(std::vector<PulledWork> pulled, bool counted) {
  InHand in_hand(in_hand_, pulled.size(), counted);  // until it is in the batcher (counted again there) or settled
  const int64_t now_ms = d_.clock->NowUnixMs();
  std::vector<std::unique_ptr<PendingWork>> ready;
  for (size_t i = 0; i < pulled.size(); ++i) {
    PulledWork& p = pulled[i];
    Delivery& delivery = p.delivery;
    wire::WorkHeaders* headers = &p.headers;
    const Delivery::Info& info = p.info;
    // Before its payload is fetched from the blob store and decoded.
    if (FailIfExpiredOrCancelled(delivery, *headers, now_ms)) continue;
    ByteBudget::Hold payload_hold;
    if (!headers->payload_ref.empty() && d_.fetched_payloads != nullptr) {
      // Unparsable: PrepareDelivery answers it (blob_ref_invalid).
      if (auto ref = ParseBlobRef(headers->payload_ref); ref.ok()) {
        // The size a reference claims, bounded (it is checked only as the
        // payload is read).
        const auto bytes = static_cast<int64_t>(std::min<uint64_t>(ref->size, uint64_t{1} << 50));
        payload_hold = d_.fetched_payloads->Take(bytes, kPayloadRoomWaitMs, &p.payload_ticket);
        if (!payload_hold.held()) {
          // The worker holds all the fetched payloads its bound allows:
          // this message and those after it wait, pulled (their progress
          // noted), for the next round.
          for (size_t k = i; k < pulled.size(); ++k) {
            if (!pulled[k].waited) payload_waits_->Inc();
            pulled[k].waited = true;
            deferred_.push_back(std::move(pulled[k]));
          }
          in_hand_ += pulled.size() - i;
          break;
        }
      }
    }
    auto work = PrepareDelivery(delivery, *headers);
    if (!work.ok()) {
      if (work.status().code() == StatusCode::kUnavailable) {
        // The blob store did not hand over the payload in time: a later
        // delivery may find it answering (its last one answers with this).
        LOG_WARN("worker", d_.config.name << ": " << work.status().ToString() << "; handing the message back");
        HandBackOrFail(delivery, *headers, p.progress, work.status(), kRedeliverDelayMs);
        continue;
      }
      p.progress.Finish();  // before the message is settled
      Fail(delivery, *headers, work.status());
      continue;
    }
    const int64_t published_ms = info.published_unix_ms;
    const int64_t now_mono = d_.clock->NowMonoUs();
    if (published_ms > 0 && published_ms < d_.loaded_unix_ms && info.num_delivered == 1) {
      // Queued before this model was loaded here: it waited for the load.
      load_waits_->Inc();
      load_wait_seconds_->Observe(static_cast<double>(d_.loaded_unix_ms - published_ms) / 1e3);
    } else if (published_ms > 0 && info.num_delivered == 1) {
      pulled_wait_seconds_->Observe(static_cast<double>(std::max<int64_t>(0, now_ms - published_ms)) / 1e3);
    }
    (*work)->headers = std::move(*headers);
    (*work)->delivery = std::move(delivery);
    (*work)->progress = std::move(p.progress);
    (*work)->payload_hold = std::move(payload_hold);
    avg_tokens_per_msg_ = 0.9 * avg_tokens_per_msg_ + 0.1 * static_cast<double>((*work)->tokens);
    const auto rows = static_cast<double>((*work)->row_count());
    avg_rows_per_msg_ = avg_rows_per_msg_ > 0 ? 0.9 * avg_rows_per_msg_ + 0.1 * rows : rows;
    (*work)->enqueued_mono_us = now_mono;
    (*work)->published_mono_us =
        published_ms > 0 ? now_mono - std::max<int64_t>(0, now_ms - published_ms) * 1000 : now_mono;
    ready.push_back(std::move(work).value());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : ready) {
      if (d_.held_rows) d_.held_rows->Add(w->row_count());
      batcher_.Add(std::move(w));
    }
    in_hand_ += ready.size();
    if (!ready.empty() && !claim_held_ && d_.pull_gate != nullptr && d_.pull_gate->bounded()) {
      d_.pull_gate->Take();  // this model's work now waits for the device
      claim_held_ = true;
    }
  }
  if (!ready.empty()) work_cv_.notify_one();
}

void ModelServer::MaybeReleaseClaimLocked() {
  if (!claim_held_ || batcher_.size() > 0) return;
  claim_held_ = false;
  d_.pull_gate->Release();
}

void ModelServer::ExecLoop() {
  while (true) {
    std::vector<std::unique_ptr<PendingWork>> batch;
    bool capped = false;
    bool start_lane = false;  // every lane started so far is busy
    bool to_lane = false;     // the batch went to a lane
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        if (lane_mode_) {
          // A free lane takes the oldest message as soon as there is one.
          if (lanes_busy_ < lanes_ && batcher_.size() > 0) break;
          work_cv_.wait(lock);
          continue;
        }
        int64_t wait_us = batcher_.UsUntilReady();
        if (wait_us == 0) break;
        if (wait_us < 0) {
          work_cv_.wait(lock);
        } else {
          work_cv_.wait_for(lock, std::chrono::microseconds(wait_us));
        }
      }
      if (stop_) break;
      if (d_.scheduler != nullptr && d_.runtime->UsesDevice()) {
        // One forward pass at a time per device, shared fairly between
        // models: the turn goes to the oldest waiting work, weighted by
        // backlog. The batch is cut only once the turn is ours, so work
        // that arrives while the device is busy joins it (bigger batches
        // under load) instead of waiting for the next turn.
        const int64_t oldest = batcher_.OldestPublishedMonoUs();
        int64_t backlog = static_cast<int64_t>(batcher_.size());
        lock.unlock();
        if (d_.backlog) backlog = std::max(backlog, d_.backlog());
        const int64_t t0 = d_.clock->NowMonoUs();
        // Stopping: what is held goes back (Stop() releases the batcher).
        if (!AcquireTurn(oldest, backlog)) break;
        turn_wait_seconds_->Observe(static_cast<double>(d_.clock->NowMonoUs() - t0) / 1e6);
        lock.lock();
        if (stop_) break;
      }
      to_lane = lane_mode_;
      batch = batcher_.Take(TokenCap(turn_), &capped, to_lane ? 1 : 0);
      // The batch is the device's now: its claim can go to the next pass.
      MaybeReleaseClaimLocked();
      if (to_lane) {
        lane_work_.push_back(std::move(batch));
        ++lanes_busy_;
        start_lane = static_cast<size_t>(lanes_busy_) > lane_threads_.size();
      }
    }
    space_cv_.notify_one();
    if (start_lane) StartLane();
    if (to_lane) {
      lane_cv_.notify_one();
      continue;
    }
    if (capped) shortened_->Inc();
    batch_run_us_ = 0;
    batch_run_tokens_ = 0;
    RunTaken(std::move(batch));
    if (turn_.valid() && batch_run_tokens_ > 0) {
      // Forward time only: expired work, replies and failures do not count.
      const double sample = static_cast<double>(std::max<int64_t>(1, batch_run_us_.load())) /
                            static_cast<double>(batch_run_tokens_.load());
      slot_us_per_token_ = cost_measured_ ? 0.8 * slot_us_per_token_ + 0.2 * sample : sample;
      cost_measured_ = true;
      forward_cost_->Set(slot_us_per_token_);
    }
    turn_.Release();
    if (d_.on_batch) d_.on_batch();
  }
  if (turn_.valid()) turn_.Release();  // stopped right after its turn came
}

void ModelServer::StartLane() {
  try {
    lane_threads_.emplace_back([this] { LaneLoop(); });
    return;
  } catch (const std::system_error& e) {
    LOG_WARN("worker", d_.config.name << ": cannot start another lane (" << e.what() << "); " << lane_threads_.size()
                                      << " serve it");
  }
  // The lanes there are serve (one at least: still one message, one input
  // per call); with none, the executor runs batches itself.
  std::vector<std::vector<std::unique_ptr<PendingWork>>> orphaned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_ = std::max<int>(1, static_cast<int>(lane_threads_.size()));
    if (lane_threads_.empty()) {
      lane_mode_ = false;
      for (auto& b : lane_work_) orphaned.push_back(std::move(b));
      lane_work_.clear();
      lanes_busy_ = 0;
    }
  }
  for (auto& b : orphaned) RunTaken(std::move(b));
}

void ModelServer::LaneLoop() {
  for (;;) {
    std::vector<std::unique_ptr<PendingWork>> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      lane_cv_.wait(lock, [&] { return lanes_stop_ || !lane_work_.empty(); });
      if (lane_work_.empty()) return;  // stopping, and every batch handed over has run
      batch = std::move(lane_work_.front());
      lane_work_.pop_front();
    }
    RunTaken(std::move(batch));
    if (d_.on_batch) d_.on_batch();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --lanes_busy_;
    }
    work_cv_.notify_all();
  }
}

void ModelServer::RunTaken(std::vector<std::unique_ptr<PendingWork>> batch) {
  int64_t batch_rows = 0;
  for (const auto& w : batch) batch_rows += w->row_count();
  struct RowsDone {  // however the batch ends, its rows stop counting
    HeldRows* held;
    int64_t rows;
    ~RowsDone() {
      if (held) held->Done(rows);
    }
  } rows_done{d_.held_rows, batch_rows};
  InHand in_hand(in_hand_, batch.size(), /*already_counted=*/true);  // since it came
  if (!batch.empty()) RunBatch(std::move(batch));
}

void ModelServer::ForgetRoomWait() {
  room_wait_from_turn_ = -1;
  starved_ = false;
}

bool ModelServer::AcquireTurn(int64_t oldest_published_mono_us, int64_t backlog) {
  auto acquired = d_.scheduler->Acquire(d_.config.name, oldest_published_mono_us, backlog, &stop_, WantedWidth());
  if (!acquired.ok()) return false;
  turn_ = std::move(acquired).value();
  turn_width_ = turn_.width();
  return true;
}

int64_t ModelServer::TokenCap(const DeviceScheduler::Turn& turn) const {
  if (!turn.valid() || d_.turn_quantum_us <= 0 || d_.scheduler->waiting() == 0) return 0;
  // Not measured yet (the first batch after a load): one item, which
  // measures it.
  if (!cost_measured_) return 1;
  const double tokens = static_cast<double>(d_.turn_quantum_us) * turn.width() / slot_us_per_token_;
  return std::max<int64_t>(1, static_cast<int64_t>(std::min(tokens, 1e15)));
}

PassWidth ModelServer::WantedWidth() const {
  if (!d_.slots_are_cores || d_.scheduler == nullptr) return {1, 1};
  const int slots = d_.scheduler->slots();
  // A runtime that cannot run on fewer cores (a socket runtime, OCR, the
  // simulated accelerator) has the device to itself, as with one slot.
  if (!d_.runtime->TakesThreadCount()) return {slots, slots};
  const int cap = d_.config.intra_op_threads > 0 ? std::min(d_.config.intra_op_threads, slots) : slots;
  return {1, cap};
}

void ModelServer::RunBatch(std::vector<std::unique_ptr<PendingWork>> batch) {
  const int64_t now_us = d_.clock->NowMonoUs();
  const int64_t now_ms = d_.clock->NowUnixMs();
  // Expired while waiting, or its caller gone (the rest of a many-image
  // OCR request, say): answer and drop before spending compute on it.
  std::vector<std::unique_ptr<PendingWork>> live;
  for (auto& w : batch) {
    batch_wait_seconds_->Observe(static_cast<double>(now_us - w->enqueued_mono_us) / 1e6);
    if (FailIfExpiredOrCancelled(w->delivery, w->headers, now_ms)) continue;
    live.push_back(std::move(w));
  }
  if (live.empty()) return;
  // A message delivered a third time, or for the last time allowed, may be
  // what broke its earlier batches (it crashed an out-of-process runtime or
  // ran it past its timeout, and the batch was handed back): it runs on its
  // own, so it cannot take the others down with it until their deliveries
  // run out. A second delivery still batches: most are the hand-backs of a
  // stopped or killed worker, which should run at full width.
  const auto suspect = [&](const PendingWork& w) {
    if (live.size() < 2 || w.delivery.is_core()) return false;
    const int64_t n = static_cast<int64_t>(w.delivery.NumDelivered());
    return n > 2 || (n > 1 && n >= d_.max_deliver);
  };
  std::vector<std::unique_ptr<PendingWork>> fresh, again;
  for (auto& w : live) (suspect(*w) ? again : fresh).push_back(std::move(w));
  if (!fresh.empty()) RunLive(std::move(fresh));
  RunEachAlone(std::move(again));
}

void ModelServer::RunEachAlone(std::vector<std::unique_ptr<PendingWork>> work) {
  const auto rest_from = [&work](size_t i) {
    return std::vector<std::unique_ptr<PendingWork>>(
        std::make_move_iterator(work.begin() + static_cast<std::ptrdiff_t>(i)), std::make_move_iterator(work.end()));
  };
  for (size_t i = 0; i < work.size(); ++i) {
    // One of them may have just taken an out-of-process runtime down: the
    // next runs once it is back, not into its restart (which would hand
    // it back and use up one of its deliveries for another's crash).
    // Real time (it sleeps), whatever clock the server was given. The
    // device is not this model's meanwhile: other models' passes run.
    bool gave_turn = false;
    if (!d_.runtime->Available() && turn_.valid()) {
      turn_.Release();
      gave_turn = true;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kRuntimeBackWaitMs);
    while (!d_.runtime->Available() && !stop_ && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!d_.runtime->Available()) {
      Release(rest_from(i),
              Unavailable("model '" + d_.config.name + "' runtime was unavailable on every delivery of this work",
                          "runtime_unavailable"),
              kRedeliverDelayMs);
      return;
    }
    if (gave_turn) {
      int64_t oldest = 0;
      for (size_t k = i; k < work.size(); ++k)
        if (oldest == 0 || work[k]->published_mono_us < oldest) oldest = work[k]->published_mono_us;
      if (!AcquireTurn(oldest, static_cast<int64_t>(work.size() - i))) {  // stopping
        Release(rest_from(i), WorkerStopping(), kRedeliverDelayMs);
        return;
      }
    }
    // Expired while it waited for the runtime or the device.
    if (FailIfExpired(work[i]->delivery, work[i]->headers, d_.clock->NowUnixMs())) continue;
    std::vector<std::unique_ptr<PendingWork>> one;
    one.push_back(std::move(work[i]));
    RunLive(std::move(one));
  }
}

void ModelServer::RunLive(std::vector<std::unique_ptr<PendingWork>> live) {
  if (d_.runtime->TakesItems()) return RunItemBatch(std::move(live));
  const ModelConfig& c = d_.config;
  LOG_DEBUG("worker", c.name << ": running batch of " << live.size() << " message(s)");
  std::vector<wire::WorkReply> replies(live.size());
  for (size_t i = 0; i < live.size(); ++i) {
    replies[i].request_id = live[i]->headers.request_id;
    replies[i].chunk_index = live[i]->headers.chunk_index;
    replies[i].rows = static_cast<int>(live[i]->rows.size());
    replies[i].token_counts = live[i]->token_counts;
    replies[i].truncated_any = live[i]->truncated_any;
    replies[i].worker_id = d_.worker_id;
  }
  Status failure;
  int dim = 0;
  auto passes = PlanForwardPasses(live, c.batching.max_batch_tokens, c.batching.max_batch_size);
  for (const auto& pass : passes) {
    TokenBatch tb;
    tb.rows = static_cast<int>(pass.size());
    tb.seq_len = pass.back().len;  // sorted ascending
    tb.input_ids.assign(static_cast<size_t>(tb.rows) * tb.seq_len, d_.tokenizer->pad_id());
    tb.attention_mask.assign(static_cast<size_t>(tb.rows) * tb.seq_len, 0);
    if (c.TakesPairs()) tb.token_type_ids.assign(static_cast<size_t>(tb.rows) * tb.seq_len, 0);
    for (int r = 0; r < tb.rows; ++r) {
      const PendingWork& w = *live[pass[r].item];
      const auto& ids = w.rows[pass[r].row];
      const size_t at = static_cast<size_t>(r) * tb.seq_len;
      std::copy(ids.begin(), ids.end(), tb.input_ids.begin() + at);
      std::fill_n(tb.attention_mask.begin() + at, ids.size(), 1);
      if (!tb.token_type_ids.empty() && !w.second_starts.empty()) {
        const size_t second = static_cast<size_t>(w.second_starts[pass[r].row]);
        std::fill(tb.token_type_ids.begin() + at + second, tb.token_type_ids.begin() + at + ids.size(), 1);
      }
    }
    if (d_.slots_are_cores && d_.runtime->TakesThreadCount()) tb.threads = turn_width_;
    const int64_t t0 = d_.clock->NowMonoUs();
    auto out = RunGuarded([&] { return d_.runtime->Run(tb); });
    const int64_t run_us = d_.clock->NowMonoUs() - t0;
    if (out.ok()) {
      batch_run_us_ += run_us * turn_width_;
      for (const RowRef& row : pass) batch_run_tokens_ += row.len;
    }
    if (d_.busy_us) d_.busy_us->fetch_add(run_us * turn_width_);
    run_seconds_->Observe(static_cast<double>(run_us) / 1e6);
    batches_->Inc();
    batch_rows_->Observe(tb.rows);
    batch_tokens_->Observe(static_cast<double>(tb.rows) * tb.seq_len);
    if (!out.ok() && out.status().code() == StatusCode::kUnavailable) {
      // The runtime went away mid-batch (an out-of-process runtime crashed
      // or is restarting): not the callers' fault. Hand the work back to the
      // queue; it is redelivered and every caller still gets one answer.
      LOG_WARN("worker", c.name << ": " << out.status().ToString() << "; returning " << live.size()
                                << " message(s) to the queue");
      runtime_unavailable_->Inc();
      Release(std::move(live),
              Unavailable("model '" + c.name + "' runtime failed on every delivery of this work: " +
                              out.status().message(),
                          "runtime_unavailable"),
              kRedeliverDelayMs);
      return;
    }
    if (!out.ok()) {
      if (live.size() > 1) {
        // It may be one caller's input that the model fails on: rerun
        // each message on its own, so the others still get their answers.
        LOG_WARN("worker", c.name << ": " << out.status().ToString() << "; running the batch's " << live.size()
                                  << " messages one by one");
        return RunEachAlone(std::move(live));
      }
      // The runtime refused this input (a text pair for a model that
      // takes none): the caller's error, with the runtime's code; anything
      // else is the model failing.
      const int code = HttpStatusFor(out.status().code());
      failure = code >= 400 && code < 500
                    ? out.status()
                    : Status(StatusCode::kInternal, "model '" + c.name + "' failed: " + out.status().message(),
                             "runtime_error");
      break;
    }
    const bool width_changed = dim > 0 && out->dim != dim;
    if (out->rows != tb.rows || out->dim <= 0 || width_changed ||
        (c.task == "score" && out->dim != 1) ||
        (!c.labels.empty() && out->dim != static_cast<int>(c.labels.size()))) {
      failure = Internal("model '" + c.name + "' returned " + std::to_string(out->rows) + " x " +
                             std::to_string(out->dim) + " for a batch of " + std::to_string(tb.rows) +
                             (width_changed ? " (an earlier pass of this batch returned " + std::to_string(dim) +
                                                  " per row)"
                              : c.task == "score" ? " (a score model returns one value per pair)"
                              : c.labels.empty()  ? ""
                                                  : " (one logit per label expected)"),
                         "runtime_error");
      break;
    }
    ApplyActivation(activation_, &*out);
    dim = out->dim;
    for (int r = 0; r < tb.rows; ++r) {
      auto& rep = replies[pass[r].item];
      if (rep.embeddings.empty()) {
        rep.dim = dim;
        rep.embeddings.resize(static_cast<size_t>(rep.rows) * dim);
      }
      std::copy_n(out->data.begin() + static_cast<size_t>(r) * dim, dim,
                  rep.embeddings.begin() + static_cast<size_t>(pass[r].row) * dim);
    }
  }
  Finish(live, replies, failure);
}

void ModelServer::Finish(std::vector<std::unique_ptr<PendingWork>>& live, std::vector<wire::WorkReply>& replies,
                         const Status& failure) {
  static const wire::WorkReply kNone;  // failed: no reply to send
  for (size_t i = 0; i < live.size(); ++i) FinishOne(*live[i], failure.ok() ? replies[i] : kNone, failure);
}

void ModelServer::FinishOne(PendingWork& work, const wire::WorkReply& reply, const Status& failure) {
  if (!failure.ok() || !reply.status.ok()) {
    Fail(work.delivery, work.headers, failure.ok() ? reply.status : failure);
    return;
  }
  if (work.items.empty()) tokens_total_->Inc(work.tokens);
  // Reply first, then ack: a crash in between redelivers, never loses.
  if (Status sent = Reply(reply, work.headers.reply_to); !sent.ok()) {
    if (sent.reason() == "blob_store_unavailable" && !work.streamed) {
      // The result could not be stored for now: run again on a later
      // delivery (as a payload the store did not hand over is), rather
      // than fail a request the store may serve in a moment; the last one
      // answers with this. Not once its caller has had part of the output:
      // a run again would stream it from the start.
      LOG_WARN("worker", d_.config.name << ": " << sent.ToString() << "; handing the message back");
      HandBackOrFail(work.delivery, work.headers, work.progress, sent, kRedeliverDelayMs);
      return;
    }
    // The answer did not go out (e.g. over the server's max payload): say
    // so rather than ack work whose caller would never hear of it.
    Status failure = Internal("the reply could not be sent: " + sent.message(), "reply_failed");
    if (sent.code() == StatusCode::kPayloadTooLarge) {
      failure = Status(StatusCode::kPayloadTooLarge,
                       "the result is larger than a NATS message may be and this worker has no blob store "
                       "(--blob-store); send fewer inputs per request: " +
                           sent.message(),
                       "result_too_large");
    } else if (sent.reason() == "blob_store_unavailable" || sent.reason() == kBlobStoreFull) {
      failure = sent;  // 503 / 429: the caller may try again
    }
    Fail(work.delivery, work.headers, failure);
    return;
  }
  (void)work.delivery.Ack();
}

Status ModelServer::AddItemResult(std::string result, Status item_error, size_t input, wire::WorkReply* reply) const {
  const ModelConfig& c = d_.config;
  wire::WorkReply& r = *reply;
  if (!r.status.ok()) return Status::Ok();  // another input of this message failed
  if (!item_error.ok()) {
    r.status = std::move(item_error);  // only this input's caller gets it
    return Status::Ok();
  }
  if (c.ItemTask()) {
    r.items.push_back(std::move(result));
    return Status::Ok();
  }
  // A token task served by an item runtime: each result is one row of floats.
  auto row = wire::DecodeFloatRow(result);
  if (!row.ok() || row->empty() || (r.dim != 0 && static_cast<int>(row->size()) != r.dim) ||
      (c.task == "score" && row->size() != 1))
    return Internal("model '" + c.name + "' returned a malformed row for input " + std::to_string(input) +
                        (row.ok() ? "" : ": " + row.status().message()),
                    "runtime_error");
  Embeddings e{1, static_cast<int>(row->size()), std::move(*row)};
  ApplyActivation(activation_, &e);
  r.dim = e.dim;
  r.embeddings.insert(r.embeddings.end(), e.data.begin(), e.data.end());
  return Status::Ok();
}

Status ModelServer::RunItems(const std::vector<std::unique_ptr<PendingWork>>& work,
                             std::vector<wire::WorkReply>* replies, std::vector<bool>* answered) {
  const ModelConfig& c = d_.config;
  answered->assign(work.size(), false);
  const auto reply_for = [&](size_t i) {
    wire::WorkReply r;
    r.request_id = work[i]->headers.request_id;
    r.chunk_index = work[i]->headers.chunk_index;
    r.worker_id = d_.worker_id;
    r.rows = static_cast<int>(work[i]->items.size());
    return r;
  };
  std::vector<std::string> inputs;
  std::vector<int64_t> deadlines;                // per input: its message's
  std::vector<std::pair<size_t, size_t>> owner;  // input -> (work, index within its message)
  std::vector<size_t> first_input(work.size());  // per work: the index of its first input
  for (size_t i = 0; i < work.size(); ++i) {
    first_input[i] = inputs.size();
    for (size_t k = 0; k < work[i]->items.size(); ++k) {
      inputs.push_back(work[i]->items[k]);
      deadlines.push_back(work[i]->headers.deadline_unix_ms);
      owner.emplace_back(i, k);
    }
  }
  std::vector<int> seq(work.size(), 0);
  PartialSink partial = [&](size_t item, std::string_view chunk) {
    if (item >= owner.size()) return;
    const auto [i, k] = owner[item];
    wire::WorkReply r = reply_for(i);
    r.rows = 0;
    r.partial = true;
    r.seq = seq[i]++;
    r.item = static_cast<int>(k);
    r.items.emplace_back(chunk);
    work[i]->streamed = true;
    (void)Reply(r, work[i]->headers.reply_to);
  };
  // Results handed over early, per input, and how many inputs of each
  // message are still out: a message whose last input is done is answered
  // then, not when the batch's longest input is.
  std::vector<std::optional<std::string>> early(inputs.size());
  std::vector<size_t> left(work.size());
  for (size_t i = 0; i < work.size(); ++i) left[i] = work[i]->items.size();
  ResultSink done = [&](size_t item, const std::string& result) {
    if (item >= owner.size() || early[item]) return;
    const size_t i = owner[item].first;
    early[item] = result;
    if (--left[i] > 0) return;
    wire::WorkReply r = reply_for(i);
    Status failure;
    for (size_t n = first_input[i]; n < first_input[i] + work[i]->items.size() && failure.ok(); ++n)
      failure = AddItemResult(*early[n], ParseItemError(*early[n]), n, &r);
    FinishOne(*work[i], r, failure);
    work[i]->progress = ProgressKeeper::Watch();  // answered: no more progress notes
    (*answered)[i] = true;
  };
  // A batch always takes its first message whole, so one message (an
  // OpenAI embed chunk of 32 texts, say) can hold more inputs than
  // max_batch_size: the runtime gets them in passes of at most that many.
  // On a lane, one input per call: the lanes are what bounds how many run
  // at once (a message published with several inputs runs them in turn).
  const size_t pass_rows = lane_mode_                     ? 1
                           : c.batching.max_batch_size > 0 ? static_cast<size_t>(c.batching.max_batch_size)
                                                          : inputs.size();
  std::vector<std::string> results;
  std::vector<Status> item_errors;  // per result: the error it carries for its input alone
  results.reserve(inputs.size());
  item_errors.reserve(inputs.size());
  for (size_t begin = 0; begin < inputs.size(); begin += pass_rows) {
    const size_t end = std::min(inputs.size(), begin + pass_rows);
    std::vector<std::string> pass(std::make_move_iterator(inputs.begin() + static_cast<std::ptrdiff_t>(begin)),
                                  std::make_move_iterator(inputs.begin() + static_cast<std::ptrdiff_t>(end)));
    ItemCalls calls;
    calls.partial = [&partial, begin](size_t item, std::string_view chunk) { partial(begin + item, chunk); };
    calls.done = [&done, begin](size_t item, const std::string& result) { done(begin + item, result); };
    if (d_.cancelled != nullptr)
      calls.cancelled = [&, begin](size_t item) {
        return begin + item < owner.size() && d_.cancelled->Contains(work[owner[begin + item].first]->headers.request_id);
      };
    const std::vector<int64_t> pass_deadlines(deadlines.begin() + static_cast<std::ptrdiff_t>(begin),
                                              deadlines.begin() + static_cast<std::ptrdiff_t>(end));
    const int64_t t0 = d_.clock->NowMonoUs();
    auto out = RunGuarded([&] { return d_.runtime->RunItemsAsReady(pass, pass_deadlines, calls); });
    const int64_t run_us = d_.clock->NowMonoUs() - t0;
    if (out.ok()) {
      // Inputs that failed on their own (an undecodable image, a deadline
      // that passed) took next to nothing: counted, they would make the
      // measured cost per input, and so the turn quantum's cap, wrong.
      int64_t ran = 0;
      for (size_t k = 0; k < out->size(); ++k) {
        item_errors.push_back(ParseItemError((*out)[k]));
        ran += item_errors.back().ok() ? 1 : 0;
        // Dropped unrun, or stopped, because its caller went away (asked
        // here: an upstream's own error code may read "cancelled"), or at
        // its deadline (its caller had its 504).
        if (item_errors.back().reason() == "cancelled" && calls.cancelled && calls.cancelled(k)) {
          cancelled_->Inc();
        } else if (item_errors.back().code() == StatusCode::kDeadlineExceeded) {
          expired_->Inc();
        }
      }
      if (ran > 0) {
        batch_run_us_ += run_us * turn_width_;
        batch_run_tokens_ += ran;
      }
    }
    if (d_.busy_us && d_.runtime->UsesDevice()) d_.busy_us->fetch_add(run_us * turn_width_);
    run_seconds_->Observe(static_cast<double>(run_us) / 1e6);
    batches_->Inc();
    batch_rows_->Observe(static_cast<double>(pass.size()));
    if (!out.ok()) return out.status();
    if (out->size() != pass.size())
      return Internal("model '" + c.name + "' returned " + std::to_string(out->size()) + " results for " +
                          std::to_string(pass.size()) + " inputs",
                      "runtime_error");
    for (auto& r : *out) results.push_back(std::move(r));
  }
  replies->clear();
  for (size_t i = 0; i < work.size(); ++i) replies->push_back(reply_for(i));
  for (size_t n = 0; n < results.size(); ++n) {
    const size_t i = owner[n].first;
    if ((*answered)[i]) continue;
    RETURN_IF_ERROR(AddItemResult(std::move(results[n]), std::move(item_errors[n]), n, &(*replies)[i]));
  }
  return Status::Ok();
}

void ModelServer::RunItemBatch(std::vector<std::unique_ptr<PendingWork>> live) {
  const ModelConfig& c = d_.config;
  std::vector<wire::WorkReply> replies;
  std::vector<bool> answered;
  Status s = RunItems(live, &replies, &answered);
  // Messages answered while the others ran are done: whatever happens to
  // the rest (handed back, rerun, failed) is not theirs.
  if (std::find(answered.begin(), answered.end(), true) != answered.end()) {
    std::vector<std::unique_ptr<PendingWork>> rest;
    std::vector<wire::WorkReply> rest_replies;
    for (size_t i = 0; i < live.size(); ++i) {
      if (answered[i]) continue;
      rest.push_back(std::move(live[i]));
      if (i < replies.size()) rest_replies.push_back(std::move(replies[i]));
    }
    live = std::move(rest);
    replies = std::move(rest_replies);
    if (live.empty()) return;
  }
  if (s.code() == StatusCode::kUnavailable) {
    LOG_WARN("worker", c.name << ": " << s.ToString() << "; returning " << live.size() << " message(s) to the queue");
    runtime_unavailable_->Inc();
    Release(std::move(live),
            Unavailable("model '" + c.name + "' runtime failed on every delivery of this work: " + s.message(),
                        "runtime_unavailable"),
            kRedeliverDelayMs);
    return;
  }
  const int code = HttpStatusFor(s.code());
  if (!s.ok() && ((code >= 400 && code < 500) || s.code() == StatusCode::kInternal) &&
      s.code() != StatusCode::kResourceExhausted && live.size() > 1) {
    // One caller's bad input (an undecodable image, one the model fails
    // on) must not fail the others batched with it: rerun each message on
    // its own. Not an overloaded backend's 429: no input caused it, and
    // rerunning would send it more requests.
    return RunEachAlone(std::move(live));
  }
  if (!s.ok() && s.code() == StatusCode::kInternal)
    s = Status(StatusCode::kInternal, "model '" + c.name + "' failed: " + s.message(),
               s.reason().empty() ? "runtime_error" : s.reason());
  Finish(live, replies, s);
}

}  // namespace shoal
