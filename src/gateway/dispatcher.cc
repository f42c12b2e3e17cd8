#include "gateway/dispatcher.h"

#include "blob/blob_offload.h"

#include <charconv>
#include <cstring>
#include <random>

#include <nats/nats.h>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "wire/work_message.h"

namespace shoal {

struct Dispatcher::Pending {
  std::function<void(Parts)> done;
  PartialCallback partial;
  std::vector<size_t> first_item;  // per chunk: the job index of its first input (partials)
  std::string item_name;           // see ItemJob::item_name
  int chunk_count = 0;
  int received = 0;
  int64_t deadline_mono_us = 0;  // the request's deadline on this process's steady clock: the timer's
  std::vector<bool> have;
  std::vector<int> next_seq;  // per chunk: the number of the partial reply it expects next
  std::shared_ptr<ClientPresence> client;  // see ItemJob::client
  std::atomic<bool> cancel_sent{false};    // the caller went away and the workers were told
  std::atomic<int> sent{0};  // chunks published (and not refused by the stream): work that may run
  std::vector<wire::WorkReply> parts;
  std::vector<std::string> blob_refs;  // offloaded chunks, deleted on completion; guarded by mu_
  // Push: per chunk, the worker it went to (empty: the queue) and its rows.
  std::vector<std::string> chunk_worker;
  std::vector<int64_t> chunk_rows;
};

Status DispatcherOptions::Validate() const {
  if (chunk_size < 1 || static_cast<size_t>(chunk_size) > wire::kMaxInputsPerMessage)
    return InvalidArgument("--chunk-size (chunk_size) must be 1 to " + std::to_string(wire::kMaxInputsPerMessage) +
                           ", not " + std::to_string(chunk_size));
  if (retry_after_s < 0) return InvalidArgument("retry_after_s must be >= 0");
  if (dispatch != "pull" && dispatch != "push") return InvalidArgument("dispatch must be pull or push");
  if (push_policy != "least-loaded" && push_policy != "p2c")
    return InvalidArgument("push_policy must be least-loaded or p2c");
  if (push_worker_timeout_ms < 100) return InvalidArgument("push_worker_timeout_ms must be >= 100");
  // It is part of every reply subject (escaped, up to 3 bytes a byte), and
  // workers refuse reply subjects over 1,024 bytes.
  if (gateway_id.size() > 128) return InvalidArgument("gateway_id must be at most 128 bytes");
  return Status::Ok();
}

namespace {

// Items at least this large are moved into their work message as a piece
// of their own rather than copied into it (SubmitItems).
constexpr size_t kItemPieceBytes = size_t{64} << 10;

std::string RandomId() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd());
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(gen()));
  return buf;
}

}  // namespace

Result<std::unique_ptr<Dispatcher>> Dispatcher::Create(const DispatcherOptions& options, NatsClient* client,
                                                       MetricsRegistry* metrics, const Clock* clock) {
  RETURN_IF_ERROR(options.Validate());
  auto d = std::unique_ptr<Dispatcher>(new Dispatcher());
  d->options_ = options;
  d->client_ = client;
  d->clock_ = clock ? clock : SystemClock::Get();
  d->id_ = options.gateway_id.empty() ? RandomId() : wire::ModelToToken(options.gateway_id);
  // Request ids are unique to this process even under a fixed --gateway-id:
  // a restarted gateway counting from 0 again would reuse ids whose work
  // JetStream still deduplicates (Nats-Msg-Id, 2 minutes) or still holds,
  // and its callers would get 504s or an earlier caller's answer.
  d->request_prefix_ = options.gateway_id.empty() ? d->id_ + "-" : d->id_ + "-" + RandomId().substr(0, 8) + "-";
  // The subjects too: two processes given the same --gateway-id (a rolling
  // restart that overlaps) would otherwise each take the other's replies,
  // and drop them as duplicates (deleting their blobs).
  d->subject_prefix_ = "_SHOAL.gw." + d->id_ + ".";
  if (!options.gateway_id.empty()) d->subject_prefix_.append(RandomId().substr(0, 8)).append(".");
  d->reply_subject_ = d->subject_prefix_ + "r";
  d->ack_prefix_ = d->subject_prefix_ + "a.";
  d->published_ = metrics->GetCounter("shoal_gateway_chunks_published_total", "Work messages published.");
  d->duplicates_ = metrics->GetCounter("shoal_gateway_duplicate_replies_total",
                                       "Replies dropped as duplicates (redelivered work).");
  d->queue_full_ = metrics->GetCounter("shoal_gateway_queue_full_total", "Requests refused: queue full.");
  d->cancels_ = metrics->GetCounter("shoal_gateway_cancels_total",
                                    "Requests whose clients went away before their answer; the workers were told.");
  d->timeouts_ = metrics->GetCounter("shoal_gateway_deadline_exceeded_total", "Requests that hit their deadline.");
  d->chunks_per_request_ = metrics->GetHistogram("shoal_gateway_chunks_per_request",
                                                 "Queue messages per client request.", {}, SizeBuckets());
  d->pushed_ = metrics->GetCounter("shoal_gateway_chunks_pushed_total",
                                   "Work messages sent straight to a worker (push dispatch).");
  d->push_fallback_ = metrics->GetCounter("shoal_gateway_push_fallback_total",
                                          "Push dispatch: chunks sent to the queue because no live worker "
                                          "reported the model loaded.");
  d->worker_lost_ = metrics->GetCounter("shoal_gateway_push_worker_lost_total",
                                        "Push dispatch: workers dropped (no subscriber or no load report).");
  d->push_ = options.dispatch == "push";
  d->push_nr_prefix_ = d->subject_prefix_ + "n.";
  ASSIGN_OR_RETURN(d->sub_, client->Subscribe(d->subject_prefix_ + ">", &Dispatcher::OnMessage, d.get()));
  if (d->push_) {
    ASSIGN_OR_RETURN(d->load_sub_, client->Subscribe(std::string(wire::kLoadSubjectPrefix) + ">",
                                                     &Dispatcher::OnMessage, d.get()));
  }
  RETURN_IF_ERROR(client->Flush(2000));
  d->timer_ = std::thread([p = d.get()] { p->TimerLoop(); });
  return d;
}

Dispatcher::~Dispatcher() {
  Stop();
  load_sub_.reset();
  sub_.reset();  // unsubscribes; no callback runs after this
}

void Dispatcher::Stop() {
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
    for (auto& [id, p] : pending_) ids.push_back(id);
  }
  timer_cv_.notify_all();
  if (timer_.joinable()) timer_.join();
  // Unsubscribed here, not in the destructor: a reply (or one fetched from
  // the blob store) must not reach this dispatcher once its owner goes on
  // to free what the handlers use (the gateway's blob offload, its router).
  // Resetting waits for a handler that is running.
  load_sub_.reset();
  sub_.reset();
  for (auto& id : ids) Complete(id, Unavailable("gateway is shutting down", "shutting_down"));
}

std::vector<PushWorkerLoad> Dispatcher::PushWorkers() const {
  std::lock_guard<std::mutex> lock(push_mu_);
  std::vector<PushWorkerLoad> out;
  for (const auto& [id, w] : push_workers_) out.push_back(w);
  return out;
}

bool Dispatcher::IsPending(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.count(id) > 0;
}

size_t Dispatcher::InFlight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void Dispatcher::SubmitEmbed(EmbedJob job, EmbedCallback done) {
  const size_t n = job.size();
  if (n == 0) {
    done(InvalidArgument("no inputs"));
    return;
  }
  const size_t chunk = static_cast<size_t>(options_.chunk_size);
  std::vector<Chunk> chunks;
  for (size_t begin = 0; begin < n; begin += chunk) {
    wire::WorkBody body;
    body.task = job.task;
    body.model = job.model;
    body.truncate = job.truncate;
    body.first_input = static_cast<int64_t>(begin);
    const size_t end = std::min(n, begin + chunk);
    int64_t estimate = 0;
    if (!job.texts.empty()) {
      const bool pairs = !job.texts_pair.empty();
      for (size_t i = begin; i < end; ++i) {
        estimate += static_cast<int64_t>(job.texts[i].size() / 4 + 2);
        body.texts.push_back(std::move(job.texts[i]));
        if (pairs) {
          estimate += static_cast<int64_t>(job.texts_pair[i].size() / 4 + 1);
          body.texts_pair.push_back(std::move(job.texts_pair[i]));
        }
      }
    } else {
      for (size_t i = begin; i < end; ++i) {
        estimate += static_cast<int64_t>(job.token_ids[i].size() + 2);
        body.token_ids.push_back(std::move(job.token_ids[i]));
      }
    }
    chunks.push_back({{{wire::EncodeWorkBody(body)}}, estimate, static_cast<int64_t>(end - begin)});
  }
  std::vector<int64_t> chunk_rows;
  for (const Chunk& c : chunks) chunk_rows.push_back(c.rows);
  auto assemble = [done = std::move(done), chunk_rows = std::move(chunk_rows)](Parts parts) {
    if (!parts.ok()) return done(parts.status());
    EmbedResult r;
    for (size_t c = 0; c < parts->size(); ++c) {
      const auto& part = (*parts)[c];
      // The routes index rows by input: a reply (from a worker of another
      // version, say) with rows for other inputs than the chunk's is an error.
      if (part.rows != chunk_rows[c] || part.dim <= 0)
        return done(Status(StatusCode::kBadGateway,
                           "a worker returned " + std::to_string(part.rows) + " rows of width " +
                               std::to_string(part.dim) + " for a chunk of " + std::to_string(chunk_rows[c]) +
                               " inputs",
                           "bad_worker_reply"));
      if (r.dim == 0) r.dim = part.dim;
      if (part.dim != r.dim)
        return done(Status(StatusCode::kBadGateway, "workers returned different embedding widths", "bad_worker_reply"));
      r.rows += part.rows;
      for (int32_t t : part.token_counts) r.prompt_tokens += t;
      r.truncated_any = r.truncated_any || part.truncated_any;
    }
    r.data.reserve(static_cast<size_t>(r.rows) * r.dim);
    for (const auto& part : *parts) r.data.insert(r.data.end(), part.embeddings.begin(), part.embeddings.end());
    done(std::move(r));
  };
  Submit(job.model, job.deadline_unix_ms, std::move(chunks), std::move(assemble), {}, {}, {}, std::move(job.client));
}

void Dispatcher::SubmitItems(ItemJob job, ItemCallback done, PartialCallback partial) {
  const size_t n = job.items.size();
  if (n == 0) {
    done(InvalidArgument("no inputs"));
    return;
  }
  std::vector<Chunk> chunks;
  std::vector<size_t> first_item;
  for (size_t i = 0; i < n; ++i) {
    wire::WorkBody body;
    body.task = job.task;
    body.model = job.model;
    body.items.push_back(std::move(job.items[i]));
    // A large item (an image) becomes a piece of the message, not a copy:
    // an offloaded message is streamed to the store piece by piece.
    chunks.push_back({wire::EncodeWorkBodyPieces(std::move(body), kItemPieceBytes), 1, 1});
    first_item.push_back(i);
  }
  auto assemble = [n, done = std::move(done)](Parts parts) {
    if (!parts.ok()) return done(parts.status());
    // One input per chunk, so one result per reply: counted per chunk, a
    // reply with two results and one with none would hand an input its
    // neighbour's result.
    ItemResult r;
    r.items.reserve(n);
    for (size_t c = 0; c < parts->size(); ++c) {
      auto& part = (*parts)[c];
      if (part.items.size() != 1)
        return done(Status(StatusCode::kBadGateway,
                           "worker " + part.worker_id + " returned " + std::to_string(part.items.size()) +
                               " results for input " + std::to_string(c) + ", which is one input",
                           "bad_worker_reply"));
      r.items.push_back(std::move(part.items.front()));
    }
    done(std::move(r));
  };
  Submit(job.model, job.deadline_unix_ms, std::move(chunks), std::move(assemble), std::move(partial),
         std::move(first_item), std::move(job.item_name), std::move(job.client));
}

void Dispatcher::Submit(const std::string& model, int64_t deadline_unix_ms, std::vector<Chunk> chunks,
                        std::function<void(Parts)> done, PartialCallback partial, std::vector<size_t> first_item,
                        std::string item_name, std::shared_ptr<ClientPresence> client) {
  // NATS refuses a message over the server's max_payload, headers
  // included: such a message goes to the blob store whatever its threshold
  // says, and without a store the request is too large for this cluster.
  if (!offload_) {
    for (const Chunk& ch : chunks)
      if (!client_->BodyFits(ch.data.size()))
        return done(Status(StatusCode::kPayloadTooLarge,
                           "a work message of this request would take " + std::to_string(ch.data.size()) +
                               " bytes, more than the NATS server's max_payload leaves for a body (" +
                               std::to_string(client_->MaxBodyBytes()) +
                               "); send fewer or smaller inputs, or give the gateway a blob store (--blob-store)",
                           "message_too_large"));
  }
  if (deadline_unix_ms <= 0) deadline_unix_ms = clock_->NowUnixMs() + 30000;
  const int count = static_cast<int>(chunks.size());
  const std::string id = request_prefix_ + std::to_string(seq_.fetch_add(1));
  auto p = std::make_shared<Pending>();
  p->done = std::move(done);
  p->partial = std::move(partial);
  p->first_item = std::move(first_item);
  p->item_name = std::move(item_name);
  p->client = std::move(client);
  p->chunk_count = count;
  // The timer runs on the steady clock: a step of the wall clock (NTP, a
  // resumed VM) must not hold requests past their time or end them early.
  p->deadline_mono_us = clock_->NowMonoUs() + (deadline_unix_ms - clock_->NowUnixMs()) * 1000;
  p->have.assign(count, false);
  p->next_seq.assign(count, 0);
  p->parts.resize(count);
  p->chunk_worker.resize(count);
  p->chunk_rows.resize(count);
  if (push_) {
    for (int c = 0; c < count; ++c) {
      p->chunk_rows[c] = chunks[c].rows;
      p->chunk_worker[c] = PickWorker(model, p->chunk_rows[c]);
      if (p->chunk_worker[c].empty()) push_fallback_->Inc();
    }
    if (after_pick_hook_) after_pick_hook_();
  }
  // Cleared when the request completes (or here, when it is refused), so it
  // never outlives the dispatcher.
  if (p->client)
    p->client->OnGone([this, id] {
      std::shared_ptr<Pending> gone;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(id);
        if (it == pending_.end()) return;
        gone = it->second;
      }
      AnnounceCancel(id, *gone);
    });
  bool earliest = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stop_) {
      lock.unlock();
      if (p->client) p->client->OnGone(nullptr);
      for (int c = 0; c < count; ++c)
        if (!p->chunk_worker[c].empty()) ReleaseRows(p->chunk_worker[c], p->chunk_rows[c]);
      p->done(Unavailable("gateway is shutting down", "shutting_down"));
      return;
    }
    pending_.emplace(id, p);
    auto at = deadlines_.emplace(p->deadline_mono_us, id);
    earliest = at == deadlines_.begin();
  }
  if (earliest) timer_cv_.notify_one();  // otherwise the timer wakes for an earlier one first
  // A client gone already is announced now: workers remember the cancel
  // for work that comes after it.
  if (p->client && p->client->gone()) AnnounceCancel(id, *p);
  chunks_per_request_->Observe(count);
  if (push_ && !ChosenWorkersLive(id, *p)) return;

  const std::string deadline = std::to_string(deadline_unix_ms);
  for (int c = 0; c < count; ++c) {
    // A put the store refused answered the request already (PutAsync calls
    // back at once then): its other chunks are not sent.
    if (c > 0 && offload_ && !IsPending(id)) return;
    if (offload_ && (offload_->ShouldOffload(chunks[c].data.size()) || !client_->BodyFits(chunks[c].data.size()))) {
      // The put blocks on file or network I/O: never on this thread (an
      // HTTP event loop). The message follows once the blob is stored.
      const int64_t estimate = chunks[c].estimate;
      offload_->PutAsync(std::move(chunks[c].data.pieces), "request",
                         [this, id, c, count, model, worker = p->chunk_worker[c], deadline,
                          estimate](Result<BlobRef> ref) {
                           if (!ref.ok()) {
                             Complete(id, BlobOffload::PutFailure(ref.status(), "the request payload"));
                             return;
                           }
                           std::string text = ref->ToString();
                           bool live = false;
                           {
                             std::lock_guard<std::mutex> lock(mu_);
                             auto it = pending_.find(id);
                             if (it != pending_.end()) {
                               live = true;
                               it->second->blob_refs.push_back(text);
                             }
                           }
                           if (!live) return offload_->DeleteAsync(std::move(text));  // answered meanwhile
                           PublishChunk(id, c, count, model, worker, deadline, estimate, {}, text);
                         });
      continue;
    }
    const std::string data = std::move(chunks[c].data).Join();
    if (!PublishChunk(id, c, count, model, p->chunk_worker[c], deadline, chunks[c].estimate, data, {})) return;
  }
}

bool Dispatcher::PublishChunk(const std::string& id, int c, int count, const std::string& model,
                              const std::string& worker, const std::string& deadline, int64_t estimate,
                              std::string_view data, const std::string& payload_ref) {
  std::string chunk_id = std::to_string(c) + "/" + std::to_string(count);
  // Push: straight to the chosen worker; the reply subject only brings back
  // NATS's "no responders" when that worker is gone. Queue: the stream's
  // publish ack comes back on the reply subject.
  const std::string subject = worker.empty() ? wire::WorkSubject(model) : wire::PushSubject(worker, model);
  std::string ack_subject = (worker.empty() ? ack_prefix_ : push_nr_prefix_) + id + "." + std::to_string(c);
  natsMsg* raw = nullptr;
  natsStatus s = natsMsg_Create(&raw, subject.c_str(), ack_subject.c_str(), data.data(),
                                static_cast<int>(data.size()));
  if (s != NATS_OK) {
    Complete(id, Internal("cannot build work message"));
    return false;
  }
  NatsMsgPtr msg(raw);
  natsMsgHeader_Set(raw, wire::kHdrRequestId, id.c_str());
  natsMsgHeader_Set(raw, wire::kHdrChunk, chunk_id.c_str());
  natsMsgHeader_Set(raw, wire::kHdrDeadline, deadline.c_str());
  natsMsgHeader_Set(raw, wire::kHdrTokenEstimate, std::to_string(estimate).c_str());
  natsMsgHeader_Set(raw, wire::kHdrReplyTo, reply_subject_.c_str());
  natsMsgHeader_Set(raw, wire::kHdrMsgId, (id + "." + std::to_string(c)).c_str());
  if (!payload_ref.empty()) natsMsgHeader_Set(raw, wire::kHdrPayloadRef, payload_ref.c_str());
  Status ps = client_->PublishMsg(raw);
  if (!ps.ok()) {
    // Too large: the same message fails the same way on every try.
    Complete(id, ps.code() == StatusCode::kPayloadTooLarge
                     ? ps
                     : Unavailable("cannot publish work: " + ps.message(), "queue_unavailable"));
    return false;
  }
  (worker.empty() ? published_ : pushed_)->Inc();
  AddSent(id, 1);
  return true;
}

void Dispatcher::AddSent(const std::string& id, int n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = pending_.find(id); it != pending_.end()) it->second->sent += n;
}

void Dispatcher::RequestLoad(const std::string& model) {
  const std::string subject = wire::WorkSubject(model);
  natsMsg* raw = nullptr;
  if (natsMsg_Create(&raw, subject.c_str(), nullptr, nullptr, 0) != NATS_OK) return;
  NatsMsgPtr msg(raw);
  // One hint per model per 10 s window, whichever gateway sends it: the
  // stream drops the rest as duplicates.
  const std::string dedupe = "load-hint." + wire::ModelToToken(model) + "." +
                             std::to_string(clock_->NowUnixMs() / 10000);
  natsMsgHeader_Set(raw, wire::kHdrLoadHint, "1");
  natsMsgHeader_Set(raw, wire::kHdrMsgId, dedupe.c_str());
  Status s = client_->PublishMsg(raw);
  if (!s.ok()) LOG_WARN("gateway", "load hint for " << model << ": " << s.ToString());
}

void Dispatcher::OnMessage(natsConnection*, natsSubscription*, natsMsg* raw, void* closure) {
  NatsMsgPtr msg(raw);
  auto* self = static_cast<Dispatcher*>(closure);
  std::string_view subject = natsMsg_GetSubject(raw);
  std::string_view data(natsMsg_GetData(raw), static_cast<size_t>(natsMsg_GetDataLength(raw)));
  if (subject == self->reply_subject_) {
    const char* ref = nullptr;
    if (natsMsgHeader_Get(raw, wire::kHdrPayloadRef, &ref) == NATS_OK && ref != nullptr && *ref != '\0') {
      const char* id = nullptr;
      if (natsMsgHeader_Get(raw, wire::kHdrRequestId, &id) != NATS_OK || id == nullptr) id = "";
      const char* chunk_text = nullptr;
      int chunk = -1;
      if (natsMsgHeader_Get(raw, wire::kHdrChunk, &chunk_text) == NATS_OK && chunk_text != nullptr)
        std::from_chars(chunk_text, chunk_text + std::strlen(chunk_text), chunk);  // left -1 if not a number
      self->HandleReplyRef(ref, id, chunk);
      return;
    }
    self->HandleReply(data);
  } else if (subject.substr(0, self->push_nr_prefix_.size()) == self->push_nr_prefix_) {
    if (!natsMsg_IsNoResponders(raw)) return;
    // tail: <request id>.<chunk>; nobody listens on that worker's push
    // subject any more: it is gone, and so is what it held of ours.
    std::string_view tail = subject.substr(self->push_nr_prefix_.size());
    const auto dot = tail.rfind('.');
    if (dot == std::string_view::npos) return;
    const std::string id(tail.substr(0, dot));
    int chunk = -1;
    std::from_chars(tail.data() + dot + 1, tail.data() + tail.size(), chunk);
    std::string worker;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->pending_.find(id);
      if (it != self->pending_.end() && chunk >= 0 && chunk < it->second->chunk_count)
        worker = it->second->chunk_worker[chunk];
    }
    if (worker.empty()) return;
    self->FailWorkerRequests(worker, "worker " + worker + " is gone (no subscriber on its push subject)");
  } else if (subject.substr(0, std::strlen(wire::kLoadSubjectPrefix)) == wire::kLoadSubjectPrefix) {
    self->HandleLoadReport(data);
  } else if (subject.substr(0, self->ack_prefix_.size()) == self->ack_prefix_) {
    self->HandlePubAck(subject.substr(self->ack_prefix_.size()), raw);
  }
}

void Dispatcher::HandleReplyRef(std::string ref, std::string request_id, int chunk) {
  if (!offload_) {
    LOG_WARN("gateway", "a reply came by reference but this gateway has no blob store (--blob-store)");
    if (!request_id.empty())
      Complete(request_id, Status(StatusCode::kBadGateway,
                                  "the reply came through the blob store, which this gateway has none of "
                                  "(--blob-store)",
                                  "blob_store_missing"));
    return;
  }
  // Fetching blocks: not on the NATS callback thread.
  if (request_id.empty()) {  // nothing to keep it in order with
    offload_->Post([this, ref = std::move(ref), chunk] { FetchReply(ref, {}, chunk); });
    return;
  }
  bool first;
  {
    std::lock_guard<std::mutex> lock(order_mu_);
    auto& queue = in_order_[request_id];
    first = queue.empty();
    queue.push_back({std::move(ref), chunk, std::nullopt});
  }
  if (first) offload_->Post([this, request_id = std::move(request_id)] { DrainReplies(request_id); });
}

void Dispatcher::DrainReplies(const std::string& id) {
  while (true) {
    QueuedReply next;
    {
      std::lock_guard<std::mutex> lock(order_mu_);
      auto it = in_order_.find(id);
      if (it == in_order_.end() || it->second.empty()) return;
      // Taken, but left in place until handled: what comes meanwhile
      // queues behind it.
      next = std::move(it->second.front());
    }
    try {
      if (!next.ref.empty()) {
        FetchReply(next.ref, id, next.chunk);
      } else if (next.reply) {
        HandleDecodedReply(std::move(*next.reply));
      }
    } catch (...) {
      // Out of memory holding a large reply, say: the request fails now,
      // and its queue still drains (what comes later finds it answered).
      Complete(id, Internal("the gateway could not handle a reply", "reply_failed"));
    }
    std::lock_guard<std::mutex> lock(order_mu_);
    auto it = in_order_.find(id);
    if (it == in_order_.end()) return;
    it->second.pop_front();
    if (it->second.empty()) {
      in_order_.erase(it);
      return;
    }
  }
}

void Dispatcher::FetchReply(const std::string& ref, const std::string& request_id, int chunk) {
  bool over = false;  // answered, failed or timed out already: nobody reads it
  if (!request_id.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    over = pending_.find(request_id) == pending_.end();
  }
  // Only a reply's blob is this gateway's to delete: a reply may come from
  // anyone who can publish on its subject, and its reference name any blob
  // (a request's payload a worker still needs). A blob left behind here,
  // or after a fetch the store failed for a while only, is swept later.
  const bool ours = BlobOffload::IsKind(ref, "reply");
  if (!ours) LOG_WARN("gateway", "a reply refers to " << ref << ", which is no reply's blob: it is not deleted");
  if (over) {
    duplicates_->Inc();
    if (ours) offload_->DeleteAsync(ref);
    return;
  }
  auto data = offload_->Fetch(ref);
  if (ours && data.status().code() != StatusCode::kUnavailable) offload_->DeleteAsync(ref);
  Status failed = data.status();
  if (data.ok()) {
    auto reply = wire::DecodeWorkReply(*data);
    if (reply.ok()) return HandleDecodedReply(std::move(reply).value());
    // Its headers say whose it is: that request hears now, not at its deadline.
    failed = Status(StatusCode::kBadGateway, "a worker sent a reply this gateway cannot read: " + reply.status().message(),
                    "bad_worker_reply");
  }
  LOG_WARN("gateway", "reply payload " << ref << ": " << failed.ToString());
  if (request_id.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(request_id);
    if (it == pending_.end()) return;  // answered already
    // A redelivered copy of a chunk already answered: the answer stands.
    if (chunk >= 0 && chunk < it->second->chunk_count && it->second->have[chunk]) return;
  }
  Complete(request_id, failed);
}

void Dispatcher::HandlePubAck(std::string_view tail, natsMsg* msg) {
  // tail: <request id>.<chunk>
  auto dot = tail.rfind('.');
  if (dot == std::string_view::npos) return;
  std::string id(tail.substr(0, dot));
  if (natsMsg_IsNoResponders(msg)) {
    Complete(id, Unavailable("the work queue (stream SHOAL_WORK) is not available", "queue_unavailable"));
    return;
  }
  std::string_view data(natsMsg_GetData(msg), static_cast<size_t>(natsMsg_GetDataLength(msg)));
  if (data.find("\"error\"") == std::string_view::npos) return;  // stored
  AddSent(id, -1);  // refused: not in the queue
  if (data.find("maximum messages") != std::string_view::npos ||
      data.find("maximum bytes") != std::string_view::npos ||
      data.find("resource limits") != std::string_view::npos ||
      data.find("insufficient resources") != std::string_view::npos) {
    queue_full_->Inc();
    Complete(id, ResourceExhausted("the work queue is full; retry later", "queue_full"));
    return;
  }
  if (data.find("message size exceeds") != std::string_view::npos) {
    // The stream's own bound on a message (under the server's max_payload).
    Complete(id, Status(StatusCode::kPayloadTooLarge,
                        "a work message of this request is larger than the work stream takes: " + std::string(data),
                        "message_too_large"));
    return;
  }
  LOG_WARN("gateway", "publish refused: " << data);
  Complete(id, Unavailable("the work queue refused the request: " + std::string(data), "queue_unavailable"));
}

void Dispatcher::HandleReply(std::string_view data) {
  auto reply = wire::DecodeWorkReply(data);
  if (!reply.ok()) {
    LOG_WARN("gateway", "undecodable reply: " << reply.status().message());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(order_mu_);
    auto it = in_order_.find(reply->request_id);
    if (it != in_order_.end()) {
      it->second.push_back({{}, -1, std::move(reply).value()});
      return;
    }
  }
  HandleDecodedReply(std::move(reply).value());
}

void Dispatcher::HandleDecodedReply(wire::WorkReply reply) {
  const std::string id = reply.request_id;  // reply is moved from below
  const bool is_partial = reply.partial;
  std::shared_ptr<Pending> p;
  bool complete = false;
  bool forward = false;  // a partial reply to pass on
  Status error;
  std::string released_worker;
  int64_t released_rows = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) {
      duplicates_->Inc();  // late, redelivered, or for a request already failed
      return;
    }
    p = it->second;
    const int c = reply.chunk_index;
    // An unusable reply whose chunk could not be read (wire::DecodeWorkReply)
    // fails the request while any chunk is still unanswered.
    const bool unplaced_failure = c == -1 && !is_partial && !reply.status.ok();
    if (!unplaced_failure && (c < 0 || c >= p->chunk_count || p->have[c])) {
      duplicates_->Inc();
      return;
    }
    if (unplaced_failure) {
      error = reply.status;
    } else if (is_partial) {
      // Replies arrive in order on this one subscription thread, so a
      // chunk's partials reach the callback in the order they were sent,
      // numbered from 0. Any other number means the output the caller has
      // cannot go on: the chunk started again from its beginning (its
      // worker was lost and the work redelivered; it would repeat, or
      // differ from, what was passed on), or a partial went missing.
      if (!p->partial || !reply.status.ok() || reply.items.empty()) return;
      if (reply.seq == p->next_seq[c]) {
        ++p->next_seq[c];
        forward = true;
      } else {
        error = Status(StatusCode::kBadGateway,
                       reply.seq < p->next_seq[c]
                           ? "the worker streaming this output was lost and its work started again from the "
                             "beginning; the output already sent cannot be continued"
                           : "part of this streamed output was lost on its way",
                       "stream_interrupted");
      }
    } else if (!reply.status.ok()) {
      error = reply.status;
      p->have[c] = true;  // answered (with the error): nothing of it is left to run
      // An input the worker found bad (its reason names the kind of input,
      // as invalid_image does): say which one (a chunk of an item job holds
      // one input). Other errors, such as a model that does not do the
      // task, are not the input's.
      if (!p->item_name.empty() && error.reason().find(p->item_name) != std::string::npos &&
          static_cast<size_t>(c) < p->first_item.size())
        error = Status(error.code(), p->item_name + " " + std::to_string(p->first_item[c]) + ": " + error.message(),
                       error.reason());
    } else {
      p->have[c] = true;
      if (!p->chunk_worker[c].empty()) {
        released_worker = p->chunk_worker[c];
        released_rows = p->chunk_rows[c];
      }
      p->parts[c] = std::move(reply);
      complete = ++p->received == p->chunk_count;
    }
  }
  if (!released_worker.empty()) ReleaseRows(released_worker, released_rows);
  if (forward) {
    const size_t c = static_cast<size_t>(reply.chunk_index);
    const size_t item = (c < p->first_item.size() ? p->first_item[c] : 0) + static_cast<size_t>(reply.item);
    if (!p->partial(item, reply.items.front())) AnnounceCancel(id, *p);
    return;
  }
  if (!error.ok()) {
    Complete(id, error);
    return;
  }
  if (!complete) return;
  // All chunks here; only this thread can reach this point for the request.
  Complete(id, std::move(p->parts));
}

void Dispatcher::AnnounceCancel(const std::string& id, Pending& p, bool client_gone) {
  if (p.cancel_sent.exchange(true)) return;
  if (client_gone) cancels_->Inc();
  if (Status s = client_->Publish(wire::kCancelSubject, id); !s.ok())
    LOG_WARN("gateway", "could not announce the cancel of " << id << ": " << s.ToString());
}

bool Dispatcher::Complete(const std::string& id, Parts result) {
  std::shared_ptr<Pending> p;
  std::vector<std::string> blob_refs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return false;  // already completed
    p = std::move(it->second);
    pending_.erase(it);
    blob_refs.swap(p->blob_refs);
    auto range = deadlines_.equal_range(p->deadline_mono_us);
    for (auto d = range.first; d != range.second; ++d)
      if (d->second == id) {
        deadlines_.erase(d);
        break;
      }
  }
  if (p->client) p->client->OnGone(nullptr);
  // A request that failed (its deadline, a chunk's error, a full queue, an
  // interrupted stream, the gateway stopping) leaves the work it sent that
  // is not answered yet nothing to answer: the workers are told to drop
  // it, as for a caller that went away. Nothing is announced when none of
  // its work is out (refused before it was queued, or its one chunk failed).
  if (!result.ok() &&
      p->sent.load() > static_cast<int>(std::count(p->have.begin(), p->have.end(), true)))
    AnnounceCancel(id, *p, /*client_gone=*/false);
  // Push: chunks never answered stop counting against their workers.
  for (int c = 0; c < p->chunk_count; ++c)
    if (!p->have[c] && !p->chunk_worker[c].empty()) ReleaseRows(p->chunk_worker[c], p->chunk_rows[c]);
  try {
    p->done(std::move(result));
  } catch (...) {
    // Building the answer failed (out of memory on a large one): the
    // caller still hears. A responder answers once; a second call is
    // dropped if the first got through.
    try {
      p->done(Internal("the gateway could not build the answer", "reply_failed"));
    } catch (...) {
    }
  }
  // The request is answered: its offloaded payloads can go.
  for (auto& ref : blob_refs) offload_->DeleteAsync(std::move(ref));
  return true;
}

std::string Dispatcher::PickWorker(const std::string& model, int64_t rows) {
  std::lock_guard<std::mutex> lock(push_mu_);
  PushWorkerLoad* best = nullptr;
  if (options_.push_policy == "p2c") {
    // Two candidates drawn at random, the less loaded one wins.
    std::vector<PushWorkerLoad*> candidates;
    for (auto& [id, w] : push_workers_)
      if (w.models.count(model)) candidates.push_back(&w);
    if (!candidates.empty()) {
      std::uniform_int_distribution<size_t> pick(0, candidates.size() - 1);
      PushWorkerLoad* a = candidates[pick(rng_)];
      PushWorkerLoad* b = candidates[pick(rng_)];
      best = b->Estimate() < a->Estimate() ? b : a;
    }
  } else {
    // Least estimated load; ties broken at random (reservoir sampling), so
    // equally idle workers share the work instead of the first one taking all.
    int ties = 0;
    for (auto& [id, w] : push_workers_) {
      if (!w.models.count(model)) continue;
      if (best == nullptr || w.Estimate() < best->Estimate()) {
        best = &w;
        ties = 1;
      } else if (w.Estimate() == best->Estimate() &&
                 std::uniform_int_distribution<int>(0, ties++)(rng_) == 0) {
        best = &w;
      }
    }
  }
  if (best == nullptr) return {};
  best->own_rows += rows;
  return best->id;
}

bool Dispatcher::ChosenWorkersLive(const std::string& id, const Pending& p) {
  // A worker dropped after PickWorker chose it but before the request was
  // registered: FailWorkerRequests scanned pending_ without this request.
  // It erased the worker before that scan, and the scan came before the
  // registration, so this check (after it) sees the worker gone.
  std::string lost;
  {
    std::lock_guard<std::mutex> lock(push_mu_);
    for (const auto& w : p.chunk_worker)
      if (!w.empty() && !push_workers_.count(w)) {
        lost = w;
        break;
      }
  }
  if (lost.empty()) return true;  // (the drop itself was counted in worker_lost_)
  Complete(id, Unavailable("worker " + lost + " was dropped as the request was sent to it; retry", "worker_lost"));
  return false;
}

void Dispatcher::ReleaseRows(const std::string& worker, int64_t rows) {
  std::lock_guard<std::mutex> lock(push_mu_);
  auto it = push_workers_.find(worker);
  if (it == push_workers_.end()) return;
  it->second.own_rows = std::max<int64_t>(0, it->second.own_rows - rows);
}

void Dispatcher::HandleLoadReport(std::string_view data) {
  nlohmann::json j = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return;
  auto id = j.find("id");
  auto models = j.find("models");
  if (id == j.end() || !id->is_string() || models == j.end() || !models->is_array()) return;
  int64_t rows = 0;
  if (auto r = j.find("outstanding_rows"); r != j.end() && r->is_number_integer()) rows = r->get<int64_t>();
  std::set<std::string> loaded;
  for (const auto& m : *models)
    if (m.is_string()) loaded.insert(m.get<std::string>());
  const std::string wid = id->get<std::string>();
  std::lock_guard<std::mutex> lock(push_mu_);
  PushWorkerLoad& w = push_workers_[wid];
  w.id = wid;
  w.models = std::move(loaded);
  w.reported_rows = std::max<int64_t>(0, rows);
  w.own_at_report = w.own_rows;
  w.last_report_mono_us = clock_->NowMonoUs();
}

void Dispatcher::FailWorkerRequests(const std::string& worker, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(push_mu_);
    if (push_workers_.erase(worker)) worker_lost_->Inc();
  }
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, p] : pending_)
      for (int c = 0; c < p->chunk_count; ++c)
        if (!p->have[c] && p->chunk_worker[c] == worker) {
          ids.push_back(id);
          break;
        }
  }
  if (!ids.empty()) LOG_WARN("gateway", why << ": failing " << ids.size() << " request(s)");
  for (const auto& id : ids) Complete(id, Unavailable(why + "; retry", "worker_lost"));
}

void Dispatcher::SweepLostWorkers() {
  const int64_t now = clock_->NowMonoUs();
  std::vector<std::string> lost;
  {
    std::lock_guard<std::mutex> lock(push_mu_);
    for (const auto& [id, w] : push_workers_)
      if (now - w.last_report_mono_us > options_.push_worker_timeout_ms * 1000) lost.push_back(id);
  }
  for (const auto& id : lost)
    FailWorkerRequests(id, "worker " + id + " sent no load report for " +
                               std::to_string(options_.push_worker_timeout_ms) + " ms");
}


void Dispatcher::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  int64_t next_sweep_us = 0;
  while (!stop_) {
    if (push_ && clock_->NowMonoUs() >= next_sweep_us) {
      next_sweep_us = clock_->NowMonoUs() + 100'000;
      lock.unlock();
      SweepLostWorkers();
      lock.lock();
      continue;
    }
    const int64_t max_wait_ms = push_ ? 100 : 1000;
    if (deadlines_.empty()) {
      if (push_) {
        timer_cv_.wait_for(lock, std::chrono::milliseconds(max_wait_ms));
      } else {
        timer_cv_.wait(lock);
      }
      continue;
    }
    const int64_t now = clock_->NowMonoUs();
    const int64_t first = deadlines_.begin()->first;
    if (first > now) {
      timer_cv_.wait_for(lock, std::chrono::microseconds(std::min<int64_t>(first - now, max_wait_ms * 1000)));
      continue;
    }
    std::string id = deadlines_.begin()->second;
    lock.unlock();
    // Counted only when it was the answer (a reply may have come meanwhile).
    if (Complete(id, DeadlineExceeded("the request did not complete before its deadline", "deadline_exceeded")))
      timeouts_->Inc();
    lock.lock();
  }
}

}  // namespace shoal
