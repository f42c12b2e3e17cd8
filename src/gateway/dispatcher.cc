#include "gateway/dispatcher.h"

#include <random>

#include <nats/nats.h>

#include "common/log.h"
#include "wire/work_message.h"

namespace shoal {

struct Dispatcher::Pending {
  std::function<void(Parts)> done;
  PartialCallback partial;
  std::vector<size_t> first_item;  // per chunk: the job index of its first input (partials)
  int chunk_count = 0;
  int received = 0;
  int64_t deadline_unix_ms = 0;
  std::vector<bool> have;
  std::vector<wire::WorkReply> parts;
};

Status DispatcherOptions::Validate() const {
  if (chunk_size < 1 || chunk_size > 4096) return InvalidArgument("chunk_size must be in [1, 4096]");
  if (retry_after_s < 0) return InvalidArgument("retry_after_s must be >= 0");
  return Status::Ok();
}

namespace {

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
  d->reply_subject_ = "_SHOAL.gw." + d->id_ + ".r";
  d->ack_prefix_ = "_SHOAL.gw." + d->id_ + ".a.";
  d->published_ = metrics->GetCounter("shoal_gateway_chunks_published_total", "Work messages published.");
  d->duplicates_ = metrics->GetCounter("shoal_gateway_duplicate_replies_total",
                                       "Replies dropped as duplicates (redelivered work).");
  d->queue_full_ = metrics->GetCounter("shoal_gateway_queue_full_total", "Requests refused: queue full.");
  d->timeouts_ = metrics->GetCounter("shoal_gateway_deadline_exceeded_total", "Requests that hit their deadline.");
  d->chunks_per_request_ = metrics->GetHistogram("shoal_gateway_chunks_per_request",
                                                 "Queue messages per client request.", {}, SizeBuckets());
  ASSIGN_OR_RETURN(d->sub_, client->Subscribe("_SHOAL.gw." + d->id_ + ".>", &Dispatcher::OnMessage, d.get()));
  RETURN_IF_ERROR(client->Flush(2000));
  d->timer_ = std::thread([p = d.get()] { p->TimerLoop(); });
  return d;
}

Dispatcher::~Dispatcher() {
  Stop();
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
  for (auto& id : ids) Complete(id, Unavailable("gateway is shutting down"));
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
    chunks.push_back({wire::EncodeWorkBody(body), estimate});
  }
  auto assemble = [done = std::move(done)](Parts parts) {
    if (!parts.ok()) return done(parts.status());
    EmbedResult r;
    for (const auto& part : *parts) {
      if (r.dim == 0) r.dim = part.dim;
      if (part.dim != r.dim) return done(Internal("workers returned different embedding widths"));
      r.rows += part.rows;
      for (int32_t t : part.token_counts) r.prompt_tokens += t;
      r.truncated_any = r.truncated_any || part.truncated_any;
    }
    r.data.reserve(static_cast<size_t>(r.rows) * r.dim);
    for (const auto& part : *parts) r.data.insert(r.data.end(), part.embeddings.begin(), part.embeddings.end());
    done(std::move(r));
  };
  Submit(job.model, job.deadline_unix_ms, std::move(chunks), std::move(assemble), {}, {});
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
    chunks.push_back({wire::EncodeWorkBody(body), 1});
    first_item.push_back(i);
  }
  auto assemble = [n, done = std::move(done)](Parts parts) {
    if (!parts.ok()) return done(parts.status());
    ItemResult r;
    r.items.reserve(n);
    for (auto& part : *parts)
      for (auto& item : part.items) r.items.push_back(std::move(item));
    if (r.items.size() != n)
      return done(Internal("workers returned " + std::to_string(r.items.size()) + " results for " +
                           std::to_string(n) + " inputs"));
    done(std::move(r));
  };
  Submit(job.model, job.deadline_unix_ms, std::move(chunks), std::move(assemble), std::move(partial),
         std::move(first_item));
}

void Dispatcher::Submit(const std::string& model, int64_t deadline_unix_ms, std::vector<Chunk> chunks,
                        std::function<void(Parts)> done, PartialCallback partial, std::vector<size_t> first_item) {
  if (deadline_unix_ms <= 0) deadline_unix_ms = clock_->NowUnixMs() + 30000;
  const int count = static_cast<int>(chunks.size());
  const std::string id = id_ + "-" + std::to_string(seq_.fetch_add(1));
  auto p = std::make_shared<Pending>();
  p->done = std::move(done);
  p->partial = std::move(partial);
  p->first_item = std::move(first_item);
  p->chunk_count = count;
  p->deadline_unix_ms = deadline_unix_ms;
  p->have.assign(count, false);
  p->parts.resize(count);
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stop_) {
      lock.unlock();
      p->done(Unavailable("gateway is shutting down"));
      return;
    }
    pending_.emplace(id, p);
    deadlines_.emplace(deadline_unix_ms, id);
  }
  timer_cv_.notify_one();
  chunks_per_request_->Observe(count);

  const std::string subject = wire::WorkSubject(model);
  const std::string deadline = std::to_string(deadline_unix_ms);
  for (int c = 0; c < count; ++c) {
    const std::string& data = chunks[c].data;
    std::string chunk_id = std::to_string(c) + "/" + std::to_string(count);
    std::string ack_subject = ack_prefix_ + id + "." + std::to_string(c);
    natsMsg* raw = nullptr;
    natsStatus s = natsMsg_Create(&raw, subject.c_str(), ack_subject.c_str(), data.data(),
                                  static_cast<int>(data.size()));
    if (s != NATS_OK) {
      Complete(id, Internal("cannot build work message"));
      return;
    }
    NatsMsgPtr msg(raw);
    natsMsgHeader_Set(raw, wire::kHdrRequestId, id.c_str());
    natsMsgHeader_Set(raw, wire::kHdrChunk, chunk_id.c_str());
    natsMsgHeader_Set(raw, wire::kHdrDeadline, deadline.c_str());
    natsMsgHeader_Set(raw, wire::kHdrTokenEstimate, std::to_string(chunks[c].estimate).c_str());
    natsMsgHeader_Set(raw, wire::kHdrReplyTo, reply_subject_.c_str());
    natsMsgHeader_Set(raw, wire::kHdrMsgId, (id + "." + std::to_string(c)).c_str());
    Status ps = client_->PublishMsg(raw);
    if (!ps.ok()) {
      Complete(id, Unavailable("cannot publish work: " + ps.message(), "queue_unavailable"));
      return;
    }
    published_->Inc();
  }
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
    self->HandleReply(data);
  } else if (subject.substr(0, self->ack_prefix_.size()) == self->ack_prefix_) {
    self->HandlePubAck(subject.substr(self->ack_prefix_.size()), raw);
  }
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
  if (data.find("maximum messages") != std::string_view::npos ||
      data.find("maximum bytes") != std::string_view::npos ||
      data.find("resource limits") != std::string_view::npos ||
      data.find("insufficient resources") != std::string_view::npos) {
    queue_full_->Inc();
    Complete(id, ResourceExhausted("the work queue is full; retry later", "queue_full"));
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
  const std::string id = reply->request_id;  // reply is moved from below
  const bool is_partial = reply->partial;
  std::shared_ptr<Pending> p;
  bool complete = false;
  Status error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) {
      duplicates_->Inc();  // late, redelivered, or for a request already failed
      return;
    }
    p = it->second;
    const int c = reply->chunk_index;
    if (c < 0 || c >= p->chunk_count || p->have[c]) {
      duplicates_->Inc();
      return;
    }
    if (is_partial) {
      // Replies arrive in order on this one subscription thread, so a
      // chunk's partials reach the callback in the order they were sent.
      // (A redelivered chunk may repeat partials already passed on.)
      if (!p->partial || !reply->status.ok() || reply->items.empty()) return;
    } else if (!reply->status.ok()) {
      error = reply->status;
    } else {
      p->have[c] = true;
      p->parts[c] = std::move(reply).value();
      complete = ++p->received == p->chunk_count;
    }
  }
  if (is_partial) {
    const size_t c = static_cast<size_t>(reply->chunk_index);
    const size_t item = (c < p->first_item.size() ? p->first_item[c] : 0) + static_cast<size_t>(reply->item);
    p->partial(item, reply->items.front());
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

void Dispatcher::Complete(const std::string& id, Parts result) {
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // already completed
    p = std::move(it->second);
    pending_.erase(it);
    auto range = deadlines_.equal_range(p->deadline_unix_ms);
    for (auto d = range.first; d != range.second; ++d)
      if (d->second == id) {
        deadlines_.erase(d);
        break;
      }
  }
  p->done(std::move(result));
}

void Dispatcher::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (deadlines_.empty()) {
      timer_cv_.wait(lock);
      continue;
    }
    const int64_t now = clock_->NowUnixMs();
    const int64_t first = deadlines_.begin()->first;
    if (first > now) {
      timer_cv_.wait_for(lock, std::chrono::milliseconds(std::min<int64_t>(first - now, 1000)));
      continue;
    }
    std::string id = deadlines_.begin()->second;
    lock.unlock();
    timeouts_->Inc();
    Complete(id, DeadlineExceeded("the request did not complete before its deadline", "deadline_exceeded"));
    lock.lock();
  }
}

}  // namespace shoal
