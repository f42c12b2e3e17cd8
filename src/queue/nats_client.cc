#include "queue/nats_client.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <thread>

#include <nats/nats.h>

#include "common/clock.h"
#include "common/log.h"

namespace shoal {

void NatsDeleter::operator()(natsConnection* p) const {
  natsConnection_Close(p);
  natsConnection_Destroy(p);
}
void NatsDeleter::operator()(natsMsg* p) const { natsMsg_Destroy(p); }
void NatsDeleter::operator()(natsSubscription* p) const {
  natsSubscription_Unsubscribe(p);
  natsSubscription_Destroy(p);
}
void NatsDeleter::operator()(jsCtx* p) const { jsCtx_Destroy(p); }
void NatsDeleter::operator()(kvStore* p) const { kvStore_Destroy(p); }

namespace {
// The JetStream error code of a request nobody answered: the server runs
// without JetStream.
constexpr int kJetStreamNotEnabled = 10076;
}  // namespace

Status FromNats(int s, const std::string& what, int js_err) {
  if (s == NATS_OK) return Status::Ok();
  std::string msg = what + ": " + natsStatus_GetText(static_cast<natsStatus>(s));
  if (const char* last = nats_GetLastError(nullptr); last && *last && std::strstr(msg.c_str(), last) == nullptr)
    msg += std::string(" (") + last + ")";
  if (js_err) msg += " [js " + std::to_string(js_err) + "]";
  // Nobody answers the JetStream API: the server runs without JetStream.
  if (s == NATS_NO_RESPONDERS && js_err == kJetStreamNotEnabled)
    return Unavailable(msg + "; is JetStream enabled on the NATS server? (nats-server -js)", "jetstream_unavailable");
  // A clustered JetStream between leaders (an election, a restarting peer):
  // temporary, so callers that retry transient errors retry it.
  if (js_err == JSClusterNotAvailErr || js_err == JSStreamOfflineErr || js_err == JSConsumerOfflineErr)
    return Unavailable(msg);
  switch (s) {
    case NATS_TIMEOUT: return DeadlineExceeded(msg);
    case NATS_NOT_FOUND: return NotFound(msg);
    case NATS_MAX_PAYLOAD: return Status(StatusCode::kPayloadTooLarge, msg, "message_too_large");
    case NATS_INVALID_ARG: return InvalidArgument(msg);
    case NATS_NO_SERVER:
    case NATS_NOT_YET_CONNECTED:
    case NATS_INSUFFICIENT_BUFFER:  // the reconnect buffer is full
    case NATS_DRAINING:
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_RESPONDERS:
    case NATS_IO_ERROR:
    case NATS_STALE_CONNECTION:
      return Unavailable(msg);
    default: return Internal(msg);
  }
}

Status NatsOptions::Validate() const {
  if (url.empty()) return InvalidArgument("nats url is empty");
  if (connect_timeout_ms <= 0) return InvalidArgument("connect_timeout_ms must be > 0");
  if (write_deadline_ms < 0) return InvalidArgument("write_deadline_ms must be >= 0 (0: none)");
  if (ping_interval_ms <= 0 || ping_max_out < 1)
    return InvalidArgument("ping_interval_ms must be > 0 and ping_max_out >= 1");
  return Status::Ok();
}

Result<std::unique_ptr<NatsClient>> NatsClient::Connect(const NatsOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  natsOptions* opts = nullptr;
  natsStatus s = natsOptions_Create(&opts);
  if (s != NATS_OK) return FromNats(s, "nats options");
  std::unique_ptr<natsOptions, void (*)(natsOptions*)> guard(opts, natsOptions_Destroy);
  natsOptions_SetURL(opts, o.url.c_str());
  natsOptions_SetName(opts, o.name.c_str());
  natsOptions_SetTimeout(opts, o.connect_timeout_ms);
  natsOptions_SetSendAsap(opts, o.send_asap);
  natsOptions_SetWriteDeadline(opts, o.write_deadline_ms);
  natsOptions_SetPingInterval(opts, o.ping_interval_ms);
  natsOptions_SetMaxPingsOut(opts, o.ping_max_out);
  if (o.retry_forever) {
    natsOptions_SetMaxReconnect(opts, -1);
    natsOptions_SetReconnectWait(opts, 250);
  }
  // Replies for many requests arrive on one subscription: don't drop them
  // as a slow consumer.
  natsOptions_SetMaxPendingMsgs(opts, 1 << 20);
  // An operator sees the connection come and go (nats.c reconnects on its
  // own; work waits meanwhile). The callbacks run on nats.c's own thread and
  // may still run while the client is destroyed (closing does not wait for
  // them): they log a copy of the name that the closed callback, the last
  // to run on that thread, frees.
  auto client = std::unique_ptr<NatsClient>(new NatsClient());
  client->options_ = o;
  auto* name = new std::string(o.name);
  natsOptions_SetDisconnectedCB(
      opts,
      [](natsConnection* nc, void* n) {
        if (natsConnection_IsClosed(nc)) return;
        LOG_WARN("nats", "connection '" << *static_cast<std::string*>(n) << "' lost the NATS server; reconnecting");
      },
      name);
  natsOptions_SetReconnectedCB(
      opts,
      [](natsConnection* nc, void* n) {
        if (natsConnection_IsClosed(nc)) return;
        char url[256] = {0};
        (void)natsConnection_GetConnectedUrl(nc, url, sizeof(url));
        LOG_INFO("nats", "connection '" << *static_cast<std::string*>(n) << "' reconnected to " << url);
      },
      name);
  natsOptions_SetClosedCB(
      opts, [](natsConnection*, void* n) { delete static_cast<std::string*>(n); }, name);

  natsConnection* nc = nullptr;
  s = natsConnection_Connect(&nc, opts);
  if (s != NATS_OK) {
    if (nc == nullptr) delete name;  // no connection: no callback will run
    return FromNats(s, "connect to " + o.url);
  }
  client->conn_.reset(nc);

  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = o.js_api_timeout_ms;
  jsCtx* js = nullptr;
  s = natsConnection_JetStream(&js, nc, &jo);
  if (s != NATS_OK) return FromNats(s, "jetstream context");
  client->js_.reset(js);
  return client;
}

NatsClient::~NatsClient() {
  js_.reset();
  conn_.reset();
}

bool NatsClient::IsConnected() const {
  return natsConnection_Status(conn_.get()) == NATS_CONN_STATUS_CONNECTED;
}

int64_t NatsClient::MaxBodyBytes() const {
  const int64_t max_payload = natsConnection_GetMaxPayload(conn_.get());
  return max_payload > kHeaderRoom ? max_payload - kHeaderRoom : 0;
}

bool IsPublishableSubject(std::string_view subject) {
  if (subject.empty() || subject.size() > kMaxPublishSubject) return false;
  size_t token_start = 0;
  for (size_t i = 0; i <= subject.size(); ++i) {
    if (i == subject.size() || subject[i] == '.') {
      const std::string_view token = subject.substr(token_start, i - token_start);
      if (token.empty() || token == "*" || token == ">") return false;
      token_start = i + 1;
      continue;
    }
    const auto c = static_cast<unsigned char>(subject[i]);
    if (c <= ' ' || c == 0x7f) return false;
  }
  return true;
}

namespace {

Status UnpublishableSubject(std::string_view subject) {
  const size_t shown = std::min<size_t>(subject.size(), 64);
  return InvalidArgument("cannot publish to subject '" + std::string(subject.substr(0, shown)) +
                             (shown < subject.size() ? "...'" : "'") + " (" + std::to_string(subject.size()) +
                             " bytes): blanks, control bytes, empty or wildcard tokens, or more than " +
                             std::to_string(kMaxPublishSubject) + " bytes",
                         "invalid_subject");
}

}  // namespace

Status NatsClient::PublishMsg(natsMsg* msg) {
  if (const char* subject = natsMsg_GetSubject(msg); subject == nullptr || !IsPublishableSubject(subject))
    return UnpublishableSubject(subject == nullptr ? "" : subject);
  return FromNats(natsConnection_PublishMsg(conn_.get(), msg), "publish");
}

Status NatsClient::Publish(std::string_view subject, std::string_view data) {
  if (!IsPublishableSubject(subject)) return UnpublishableSubject(subject);
  std::string subj(subject);
  return FromNats(natsConnection_Publish(conn_.get(), subj.c_str(), data.data(),
                                         static_cast<int>(data.size())),
                  "publish " + subj);
}

Result<std::string> NatsClient::Request(const std::string& subject, std::string_view data,
                                        int64_t timeout_ms) {
  natsMsg* reply = nullptr;
  natsStatus s = natsConnection_Request(&reply, conn_.get(), subject.c_str(), data.data(),
                                        static_cast<int>(data.size()), timeout_ms);
  if (s == NATS_NO_RESPONDERS) return Unavailable("nobody answers on " + subject, "no_responders");
  if (s == NATS_TIMEOUT) return DeadlineExceeded("no reply on " + subject + " within " + std::to_string(timeout_ms) + " ms");
  if (s != NATS_OK) return FromNats(s, "request " + subject);
  NatsMsgPtr owned(reply);
  return std::string(natsMsg_GetData(reply), static_cast<size_t>(natsMsg_GetDataLength(reply)));
}

Result<std::string> NatsClient::Request(const std::string& subject, std::string_view data, int64_t timeout_ms,
                                        const std::atomic<bool>& cancel) {
  const std::string inbox = NewInbox();
  natsSubscription* raw = nullptr;
  natsStatus s = natsConnection_SubscribeSync(&raw, conn_.get(), inbox.c_str());
  if (s != NATS_OK) return FromNats(s, "subscribe " + inbox);
  NatsSubscriptionPtr sub(raw);
  (void)natsSubscription_AutoUnsubscribe(raw, 1);
  s = natsConnection_PublishRequest(conn_.get(), subject.c_str(), inbox.c_str(), data.data(),
                                    static_cast<int>(data.size()));
  if (s != NATS_OK) return FromNats(s, "request " + subject);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    if (cancel.load()) return Unavailable("request " + subject + " cancelled", "cancelled");
    const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return DeadlineExceeded("no reply on " + subject + " within " + std::to_string(timeout_ms) + " ms");
    natsMsg* reply = nullptr;
    s = natsSubscription_NextMsg(&reply, raw, std::min<int64_t>(left, 100));
    if (s == NATS_TIMEOUT) continue;
    // nats.c takes the server's 503 "no responders" message itself and
    // says NATS_NO_RESPONDERS.
    if (s == NATS_NO_RESPONDERS) return Unavailable("nobody answers on " + subject, "no_responders");
    if (s != NATS_OK) return FromNats(s, "request " + subject);
    NatsMsgPtr owned(reply);
    return std::string(natsMsg_GetData(reply), static_cast<size_t>(natsMsg_GetDataLength(reply)));
  }
}

struct Subscription::Done {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  static void Complete(void* closure) {
    auto* d = static_cast<Done*>(closure);
    std::lock_guard<std::mutex> lock(d->mu);
    d->done = true;
    d->cv.notify_all();
  }
};

Subscription::~Subscription() {
  // Drained, not just unsubscribed: what nats.c has received for it but not
  // yet handed over still reaches the handler (unsubscribing dropped it,
  // and a pushed request or a control request then waited out its caller's
  // timeout). Only while connected: a drain's flush cannot complete while
  // reconnecting and would hold the stop for its whole timeout. The drain's
  // timeout ends before the wait below does.
  const bool connected = natsConnection_Status(conn_) == NATS_CONN_STATUS_CONNECTED;
  if (!connected || natsSubscription_DrainTimeout(sub_, kMaxWaitMs / 2) != NATS_OK)
    (void)natsSubscription_Unsubscribe(sub_);
  bool finished;
  {
    std::unique_lock<std::mutex> lock(done_->mu);
    finished = done_->cv.wait_for(lock, std::chrono::milliseconds(kMaxWaitMs), [this] { return done_->done; });
  }
  if (finished) {
    delete done_;
  } else {
    // nats.c will still call Done::Complete: leave it its latch. What the
    // handler uses must outlive it (the owner's own locks, as in Worker).
    LOG_ERROR("nats", "a subscription's handler was still running " << kMaxWaitMs << " ms after unsubscribing");
  }
  natsSubscription_Destroy(sub_);
}

Result<SubscriptionPtr> NatsClient::Subscribe(const std::string& subject, NatsMsgHandler handler, void* closure) {
  natsSubscription* sub = nullptr;
  natsStatus s = natsConnection_Subscribe(&sub, conn_.get(), subject.c_str(), handler, closure);
  if (s != NATS_OK) return FromNats(s, "subscribe " + subject);
  natsSubscription_SetPendingLimits(sub, -1, -1);
  auto* done = new Subscription::Done;
  s = natsSubscription_SetOnCompleteCB(sub, &Subscription::Done::Complete, done);
  if (s != NATS_OK) {
    // Closed already (the connection went): nothing more will be delivered,
    // though the handler may still be finishing a message it had.
    Subscription::Done::Complete(done);
  }
  return SubscriptionPtr(new Subscription(sub, conn_.get(), done));
}

Status NatsClient::Flush(int64_t timeout_ms) {
  return FromNats(natsConnection_FlushTimeout(conn_.get(), timeout_ms), "flush");
}

std::string NatsClient::NewInbox() {
  natsInbox* inbox = nullptr;
  natsInbox_Create(&inbox);
  std::string out = inbox ? inbox : "";
  natsInbox_Destroy(inbox);
  return out;
}

// ----- Work stream ------------------------------------------------------------

Status WorkStreamOptions::Validate() const {
  if (name.empty()) return InvalidArgument("stream name is empty");
  if (replicas < 1 || replicas > 5) return InvalidArgument("stream replicas must be in [1, 5]");
  if (max_msgs < 1) return InvalidArgument("stream max_msgs must be >= 1");
  if (max_bytes < 1024) return InvalidArgument("stream max_bytes must be >= 1024");
  return Status::Ok();
}

namespace {

Status EnsureStream(NatsClient& client, jsStreamConfig& cfg, bool owner) {
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, client.js(), cfg.Name, nullptr, &jerr);
  if (s == NATS_OK) {
    jsStreamInfo_Destroy(si);
    if (!owner) return Status::Ok();
    s = js_UpdateStream(&si, client.js(), &cfg, nullptr, &jerr);
    if (s == NATS_OK) {
      jsStreamInfo_Destroy(si);
      return Status::Ok();
    }
    // Some fields (storage, retention) cannot change on a live stream.
    return FromNats(s, std::string("update stream ") + cfg.Name, jerr);
  }
  if (s != NATS_NOT_FOUND) return FromNats(s, std::string("stream info ") + cfg.Name, jerr);
  if (!owner) return NotFound(std::string("stream ") + cfg.Name + " does not exist (no owner created it yet)");
  s = js_AddStream(&si, client.js(), &cfg, nullptr, &jerr);
  if (s == NATS_OK) jsStreamInfo_Destroy(si);
  // Another owner may have won the race: that's fine.
  if (s != NATS_OK && jerr == JSStreamNameExistErr) return Status::Ok();
  return FromNats(s, std::string("add stream ") + cfg.Name, jerr);
}

}  // namespace

Status EnsureWorkStream(NatsClient& client, const WorkStreamOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  jsStreamConfig cfg;
  jsStreamConfig_Init(&cfg);
  const char* subjects[] = {o.subjects.c_str()};
  cfg.Name = o.name.c_str();
  cfg.Description = "Shoal work queue";
  cfg.Subjects = subjects;
  cfg.SubjectsLen = 1;
  cfg.Retention = js_WorkQueuePolicy;
  cfg.Storage = o.file_storage ? js_FileStorage : js_MemoryStorage;
  cfg.Replicas = o.replicas;
  cfg.MaxMsgs = o.max_msgs;
  cfg.MaxBytes = o.max_bytes;
  cfg.MaxMsgSize = o.max_msg_bytes;
  cfg.Discard = js_DiscardNew;  // a full queue refuses new work: explicit 429
  cfg.Duplicates = o.duplicate_window_ms * int64_t{1000000};
  cfg.AllowDirect = true;  // workers read the oldest message's age per model
  RETURN_IF_ERROR(EnsureStream(client, cfg, o.owner));

  // Dead letters: the server's MaxDeliver advisory for each work consumer.
  std::string dlq_name = o.name + "_DLQ";
  std::string dlq_subject = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." + o.name + ".*";
  const char* dlq_subjects[] = {dlq_subject.c_str()};
  jsStreamConfig dlq;
  jsStreamConfig_Init(&dlq);
  dlq.Name = dlq_name.c_str();
  dlq.Description = "Shoal work that exceeded MaxDeliver (advisories)";
  dlq.Subjects = dlq_subjects;
  dlq.SubjectsLen = 1;
  dlq.Storage = cfg.Storage;
  dlq.Replicas = o.replicas;
  dlq.MaxMsgs = 100000;
  dlq.Discard = js_DiscardOld;
  return EnsureStream(client, dlq, o.owner);
}

Result<StreamState> GetStreamState(NatsClient& client, const std::string& stream) {
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, client.js(), stream.c_str(), nullptr, &jerr);
  if (s != NATS_OK) return FromNats(s, "stream info " + stream, jerr);
  StreamState st{si->State.Msgs, si->State.Bytes, si->State.Consumers};
  jsStreamInfo_Destroy(si);
  return st;
}

Result<std::map<std::string, uint64_t>> GetSubjectCounts(NatsClient& client, const std::string& stream,
                                                         const std::string& filter) {
  jsOptions o;
  jsOptions_Init(&o);
  o.Stream.Info.SubjectsFilter = filter.c_str();
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, client.js(), stream.c_str(), &o, &jerr);
  if (s != NATS_OK) return FromNats(s, "stream info " + stream, jerr);
  std::map<std::string, uint64_t> out;
  if (si->State.Subjects != nullptr) {
    for (int i = 0; i < si->State.Subjects->Count; ++i) {
      const jsStreamStateSubject& e = si->State.Subjects->List[i];
      if (e.Msgs > 0) out[e.Subject] = e.Msgs;
    }
  }
  jsStreamInfo_Destroy(si);
  return out;
}

namespace {

// Publish time (Unix ms) of the first or the last message on `subject`.
Result<int64_t> MessageUnixMs(NatsClient& client, const std::string& stream, const std::string& subject,
                              bool last) {
  jsDirectGetMsgOptions dg;
  jsDirectGetMsgOptions_Init(&dg);
  if (last) {
    dg.LastBySubject = subject.c_str();
  } else {
    dg.Sequence = 1;
    dg.NextBySubject = subject.c_str();
  }
  natsMsg* msg = nullptr;
  natsStatus s = js_DirectGetMsg(&msg, client.js(), stream.c_str(), nullptr, &dg);
  if (s == NATS_NOT_FOUND) return NotFound("no message on " + subject);
  if (s != NATS_OK) return FromNats(s, "direct get " + subject);
  NatsMsgPtr owned(msg);
  const char* ts = nullptr;
  if (natsMsgHeader_Get(msg, "Nats-Time-Stamp", &ts) != NATS_OK || ts == nullptr) {
    return Internal("direct get reply without Nats-Time-Stamp");
  }
  // RFC 3339 with nanoseconds, UTC: 2026-11-30T18:20:23.123456789Z
  std::tm tm{};
  int year = 0, mon = 0, day = 0, hour = 0, min = 0;
  double sec = 0;
  if (std::sscanf(ts, "%d-%d-%dT%d:%d:%lfZ", &year, &mon, &day, &hour, &min, &sec) != 6) {
    return Internal(std::string("unreadable Nats-Time-Stamp ") + ts);
  }
  tm.tm_year = year - 1900;
  tm.tm_mon = mon - 1;
  tm.tm_mday = day;
  tm.tm_hour = hour;
  tm.tm_min = min;
  tm.tm_sec = 0;
  const int64_t base = static_cast<int64_t>(timegm(&tm));
  return base * 1000 + static_cast<int64_t>(sec * 1000.0);
}

}  // namespace

Result<int64_t> OldestMessageUnixMs(NatsClient& client, const std::string& stream, const std::string& subject) {
  return MessageUnixMs(client, stream, subject, /*last=*/false);
}

Result<int64_t> NewestMessageUnixMs(NatsClient& client, const std::string& stream, const std::string& subject) {
  return MessageUnixMs(client, stream, subject, /*last=*/true);
}

// ----- Deliveries ---------------------------------------------------------------

std::string_view Delivery::Data() const {
  return {natsMsg_GetData(msg_.get()), static_cast<size_t>(natsMsg_GetDataLength(msg_.get()))};
}

std::string_view Delivery::Header(const char* name) const {
  const char* v = nullptr;
  if (natsMsgHeader_Get(msg_.get(), name, &v) != NATS_OK || v == nullptr) return {};
  return v;
}

Delivery::Info Delivery::Metadata() const {
  Info info;
  if (core_) return info;
  jsMsgMetaData* meta = nullptr;
  if (natsMsg_GetMetaData(&meta, msg_.get()) != NATS_OK) return info;
  info.num_delivered = meta->NumDelivered;
  info.published_unix_ms = meta->Timestamp / 1000000;
  jsMsgMetaData_Destroy(meta);
  return info;
}

uint64_t Delivery::NumDelivered() const { return Metadata().num_delivered; }

int64_t Delivery::PublishedUnixMs() const { return Metadata().published_unix_ms; }

Status Delivery::Acknowledge(std::string_view body, const char* what) {
  if (core_) return Status::Ok();
  const char* reply = natsMsg_GetReply(msg_.get());
  if (reply == nullptr || conn_ == nullptr) return Internal(std::string(what) + ": not a stream delivery");
  return FromNats(natsConnection_Publish(conn_, reply, body.data(), static_cast<int>(body.size())), what);
}
Status Delivery::Ack() { return Acknowledge("+ACK", "ack"); }
Status Delivery::Term() { return Acknowledge("+TERM", "term"); }
Status Delivery::Nak(int64_t delay_ms) {
  if (delay_ms <= 0) return Acknowledge("-NAK", "nak");
  return Acknowledge("-NAK {\"delay\": " + std::to_string(delay_ms * 1000000) + "}", "nak");
}
std::string Delivery::AckSubject() const {
  if (core_ || !msg_) return {};
  const char* reply = natsMsg_GetReply(msg_.get());
  return reply ? std::string(reply) : std::string();
}

Status Delivery::InProgress() { return Acknowledge("+WPI", "in-progress"); }

// ----- Pull consumer -----------------------------------------------------------

Status ConsumerOptions::Validate() const {
  if (ack_wait_ms < 100) return InvalidArgument("ack_wait_ms must be >= 100");
  if (max_deliver < 1) return InvalidArgument("max_deliver must be >= 1");
  if (max_ack_pending < 1) return InvalidArgument("max_ack_pending must be >= 1");
  return Status::Ok();
}

void PullConsumer::Interrupt() {
  if (!sub_) return;
  // A drain, not an unsubscribe: an unsubscribe frees the messages queued
  // here and drops those still on the wire, unacked, so they would reach
  // nobody until AckWait. The drain gives up (and closes the subscription)
  // if the server does not confirm within a second. Without a connection
  // nothing more can arrive, and a drain would only wait for that second;
  // an unsubscribe would drop what is queued here (nats.c closes the
  // subscription at once), so the subscription is left as it is: TakeQueued
  // reads what is queued, and the hand-backs go out on reconnect.
  if (conn_ != nullptr && natsConnection_Status(conn_) != NATS_CONN_STATUS_CONNECTED) {
    interrupted_offline_ = true;
    return;
  }
  (void)natsSubscription_DrainTimeout(sub_.get(), 1000);
}

bool PullConsumer::Wake() {
  if (!sub_ || conn_ == nullptr || natsConnection_Status(conn_) != NATS_CONN_STATUS_CONNECTED) return false;
  // What the server sends when a pull expires (a status message without a
  // body): Fetch takes it as the end of its pull and returns; a Fetch that
  // finds it queued skips it.
  natsMsg* raw = nullptr;
  if (natsMsg_Create(&raw, wake_subject_.c_str(), nullptr, nullptr, 0) != NATS_OK) return false;
  NatsMsgPtr msg(raw);
  if (natsMsgHeader_Set(raw, "Status", "408") != NATS_OK) return false;
  return natsConnection_PublishMsg(conn_, raw) == NATS_OK;
}

std::string PullConsumer::Inbox() const { return inbox_ + ".0"; }

namespace {

// A message the server sends about a pull rather than from the stream (no
// body, no ack subject, a Status header: 404 no messages, 408 pull ended,
// 409 refused, 100 heartbeat), or Wake's stand-in for one; nullptr for a
// stream message.
const char* PullStatus(natsMsg* msg) {
  const char* status = nullptr;
  if (natsMsg_GetDataLength(msg) > 0 || natsMsg_GetReply(msg) != nullptr ||
      natsMsgHeader_Get(msg, "Status", &status) != NATS_OK)
    return nullptr;
  return status;
}

int64_t SteadyNowMs() { return SystemClock::Get()->NowMonoUs() / 1000; }

}  // namespace

std::vector<Delivery> PullConsumer::TakeQueued(int64_t max_wait_ms) {
  std::vector<Delivery> out;
  if (!sub_) return out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, max_wait_ms));
  while (true) {
    natsMsg* raw = nullptr;
    const natsStatus s = natsSubscription_NextMsg(&raw, sub_.get(), 5);
    if (s == NATS_OK) {
      NatsMsgPtr msg(raw);
      if (PullStatus(raw) == nullptr) out.emplace_back(msg.release(), conn_);
      continue;
    }
    // An earlier pull's 503, which nats.c takes itself: the deliveries
    // queued behind it are still to be handed back.
    if (s == NATS_NO_RESPONDERS) continue;
    // NATS_TIMEOUT: nothing queued now; anything else: the drain has
    // completed and closed the subscription. Interrupted while offline:
    // nothing more comes.
    if (s != NATS_TIMEOUT || interrupted_offline_ ||
        natsSubscription_DrainCompletionStatus(sub_.get()) != NATS_ILLEGAL_STATE)
      break;
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
  return out;
}

namespace {

// Creates the durable consumer if missing (updating ack_wait/max_deliver if
// it exists; binding to it as it is if it cannot be updated).
Status AddDurable(jsCtx* js, const std::string& stream, const std::string& subject, const std::string& durable,
                  const ConsumerOptions& o) {
  jsConsumerConfig cc;
  jsConsumerConfig_Init(&cc);
  cc.Durable = durable.c_str();
  cc.Name = durable.c_str();
  cc.FilterSubject = subject.c_str();
  cc.AckPolicy = js_AckExplicit;
  cc.AckWait = o.ack_wait_ms * int64_t{1000000};
  cc.MaxDeliver = o.max_deliver;
  cc.MaxAckPending = o.max_ack_pending;
  cc.DeliverPolicy = js_DeliverAll;
  jsConsumerInfo* ci = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_AddConsumer(&ci, js, stream.c_str(), &cc, nullptr, &jerr);
  if (s != NATS_OK && jerr == JSConsumerNameExistErr) {
    s = js_UpdateConsumer(&ci, js, stream.c_str(), &cc, nullptr, &jerr);
  }
  if (s != NATS_OK) {
    // Existing consumer with a config we can't update (the server refuses
    // some changes): bind to it, unless it would hand out other work or
    // never redeliver.
    const Status update = FromNats(s, "update consumer " + durable, jerr);
    jsErrCode jerr2 = static_cast<jsErrCode>(0);
    s = js_GetConsumerInfo(&ci, js, stream.c_str(), durable.c_str(), nullptr, &jerr2);
    if (s != NATS_OK) return FromNats(s, "add consumer " + durable, jerr);
    const jsConsumerConfig* have = ci->Config;
    const bool usable = have != nullptr && have->FilterSubject != nullptr && subject == have->FilterSubject &&
                        have->AckPolicy == js_AckExplicit;
    jsConsumerInfo_Destroy(ci);
    if (!usable) {
      return Internal("consumer " + durable + " on stream " + stream +
                                    " exists with another filter subject or ack policy and cannot be updated (" +
                                    update.message() + "); delete it to let it be made again",
                                "consumer_mismatch");
    }
    LOG_WARN("nats", "consumer " << durable << " kept as it is: " << update.ToString());
    return Status::Ok();
  }
  jsConsumerInfo_Destroy(ci);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<PullConsumer>> PullConsumer::Create(NatsClient& client, const std::string& stream,
                                                           const std::string& subject,
                                                           const std::string& durable,
                                                           const ConsumerOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  RETURN_IF_ERROR(AddDurable(client.js(), stream, subject, durable, o));
  natsStatus s = NATS_OK;
  auto pc = std::unique_ptr<PullConsumer>(new PullConsumer());
  pc->subject_ = subject;
  pc->options_ = o;
  pc->conn_ = client.conn();
  pc->js_ = client.js();
  pc->stream_ = stream;
  pc->durable_ = durable;
  pc->next_subject_ = "$JS.API.CONSUMER.MSG.NEXT." + stream + "." + durable;
  pc->inbox_ = client.NewInbox();
  pc->wake_subject_ = pc->inbox_ + ".wake";
  natsSubscription* sub = nullptr;
  s = natsConnection_SubscribeSync(&sub, pc->conn_, (pc->inbox_ + ".*").c_str());
  if (s != NATS_OK) return FromNats(s, "subscribe for " + durable);
  pc->sub_.reset(sub);
  // Never drop a delivery for want of room: it would reach nobody until
  // AckWait. What a pull asks for bounds what can queue here.
  (void)natsSubscription_SetPendingLimits(sub, -1, -1);
  return pc;
}

Status PullConsumer::SendPull(const std::string& reply, size_t batch, int64_t wait_ms, bool no_wait) {
  // While nats.c reconnects it buffers what is published: pulls sent then
  // (one per poll) would all reach the server at once on reconnect and
  // deliver far more than this consumer asked for at any one time.
  if (natsConnection_Status(conn_) != NATS_CONN_STATUS_CONNECTED)
    return Unavailable("pull from " + durable_ + ": not connected to NATS", "nats_disconnected");
  const int64_t expires_ns = (wait_ms >= 20 ? wait_ms - 10 : wait_ms) * 1000000;
  std::string request = "{\"batch\":" + std::to_string(batch) + ",\"expires\":" + std::to_string(expires_ns);
  if (no_wait) request += ",\"no_wait\":true";
  request += "}";
  const int64_t ends_ms = SteadyNowMs() + wait_ms;
  if (ends_ms > pulls_end_ms_.load()) pulls_end_ms_ = ends_ms;  // only the fetcher thread writes it
  return FromNats(natsConnection_PublishRequest(conn_, next_subject_.c_str(), reply.c_str(), request.data(),
                                                static_cast<int>(request.size())),
                  "pull from " + durable_);
}

Result<std::vector<Delivery>> PullConsumer::Fetch(int max_msgs, int64_t max_wait_ms) {
  std::vector<Delivery> out;
  if (!sub_) return Unavailable("fetch: the subscription is closed");
  const size_t want = static_cast<size_t>(std::max(1, max_msgs));
  // Delivered already (to a pull an earlier Fetch gave up on, or while the
  // consumer was parked): these first, without a pull.
  while (out.size() < want && Undelivered() > 0) {
    natsMsg* raw = nullptr;
    const natsStatus s = natsSubscription_NextMsg(&raw, sub_.get(), 1);
    if (s == NATS_NO_RESPONDERS) continue;  // an earlier pull's 503, taken by nats.c: stale
    if (s != NATS_OK) break;
    NatsMsgPtr msg(raw);
    if (PullStatus(raw) == nullptr) out.emplace_back(msg.release(), conn_);  // stale statuses are dropped
  }
  if (!out.empty()) return out;

  // One pull, as nats.c's Fetch sends it: the server sends what it has, up
  // to the batch, and ends the pull (408) once it has sent some; with
  // nothing to send it waits for the first message until the pull expires,
  // a little before this call gives up. Each pull has its own reply
  // subject, so the statuses of earlier pulls are told apart.
  const int64_t wait_ms = std::max<int64_t>(1, max_wait_ms);
  const std::string reply = inbox_ + "." + std::to_string(++pulls_);
  bool one_shot = want > 1;
  RETURN_IF_ERROR(SendPull(reply, want, wait_ms, one_shot));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  while (out.size() < want) {
    const int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    natsMsg* raw = nullptr;
    const natsStatus s = natsSubscription_NextMsg(&raw, sub_.get(), left);
    if (s == NATS_TIMEOUT) break;
    if (s == NATS_NO_RESPONDERS) {
      // A 503 status, which nats.c takes itself (its subject, and so which
      // pull it answered, is lost with it): nobody answers for the durable,
      // or JetStream is gone. Whether the durable is there is asked, not
      // assumed (at most once a second).
      CheckGoneEvery(1000);
      if (out.empty()) return FromNats(s, "pull from " + durable_, kJetStreamNotEnabled);
      break;
    }
    if (s != NATS_OK) {
      if (out.empty()) return FromNats(s, "fetch from " + durable_);
      break;
    }
    NatsMsgPtr msg(raw);
    const char* status = PullStatus(raw);
    if (status == nullptr) {
      out.emplace_back(msg.release(), conn_);
      // A plain pull stays open for its whole batch: return what has come
      // (the rest queues here for the next call).
      if (!one_shot && Undelivered() == 0) break;
      continue;
    }
    const char* subject = natsMsg_GetSubject(raw);
    if (subject != nullptr && wake_subject_ == subject) break;  // Wake
    if (subject == nullptr || reply != subject) continue;       // an earlier pull's status
    if (std::strcmp(status, "100") == 0) continue;              // heartbeat
    const char* description = nullptr;
    (void)natsMsgHeader_Get(raw, "Description", &description);
    if (std::strcmp(status, "408") == 0 && description != nullptr && std::strcmp(description, "Requests Pending") == 0 &&
        out.empty() && one_shot) {
      // Other pulls already ask for more than is waiting, and the server
      // refuses a no_wait pull at once: wait in line with a plain one
      // instead of pulling again at once (a spin).
      one_shot = false;
      RETURN_IF_ERROR(SendPull(reply, want, std::max<int64_t>(1, left), false));
      continue;
    }
    // 404 / 408: the pull has ended.
    if (std::strcmp(status, "404") == 0 || std::strcmp(status, "408") == 0) break;
    const std::string why = std::string("pull from ") + durable_ + " refused: " + status + " " +
                            (description != nullptr ? description : "");
    // Nobody answers for the durable (503), or it was deleted under the
    // pull (409 Consumer Deleted): an operator or a stream reset removed
    // it. Put it back (at most once a second), so the model is served
    // again instead of refused at every pull until the worker restarts.
    const bool gone = std::strcmp(status, "503") == 0 ||
                      (std::strcmp(status, "409") == 0 && description != nullptr &&
                       std::strcmp(description, "Consumer Deleted") == 0);
    if (gone && SteadyNowMs() - recreated_ms_ >= 1000) RecreateIfGone(why);
    if (out.empty()) return std::strcmp(status, "503") == 0 ? Unavailable(why, "jetstream_unavailable") : Unavailable(why);
    break;
  }
  // Pulls to a deleted durable are answered by nobody, and nats-server
  // sends no status for them: they look like an idle model's.
  if (out.empty()) CheckGoneEvery(options_.existence_check_ms);
  return out;
}

void PullConsumer::CheckGoneEvery(int64_t every_ms) {
  const int64_t now = SteadyNowMs();
  if (now - checked_ms_ < every_ms) return;
  checked_ms_ = now;
  RecreateIfGone("");
}

void PullConsumer::RecreateIfGone(const std::string& why) {
  if (why.empty()) {  // not known to be gone: ask
    jsConsumerInfo* ci = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    const natsStatus s = js_GetConsumerInfo(&ci, js_, stream_.c_str(), durable_.c_str(), nullptr, &jerr);
    if (s == NATS_OK) jsConsumerInfo_Destroy(ci);
    if (!(s == NATS_NOT_FOUND || jerr == JSConsumerNotFoundErr)) return;  // there, or NATS cannot tell now
  }
  recreated_ms_ = SteadyNowMs();
  const Status added = AddDurable(js_, stream_, subject_, durable_, options_);
  LOG_WARN("nats", "consumer " << durable_ << " is gone" << (why.empty() ? "" : " (" + why + ")") << "; "
                               << (added.ok() ? "created it again" : "creating it again: " + added.ToString()));
}

int64_t PullConsumer::PullLeftMs() const { return std::max<int64_t>(0, pulls_end_ms_.load() - SteadyNowMs()); }

int PullConsumer::Undelivered() {
  int msgs = 0, bytes = 0;
  if (!sub_ || natsSubscription_GetPending(sub_.get(), &msgs, &bytes) != NATS_OK) return 0;
  return msgs;
}

namespace {

Result<uint64_t> ConsumerNumPending(natsConnection* conn, jsCtx* js, const std::string& stream,
                                    const std::string& durable, int64_t timeout_ms) {
  if (conn != nullptr && natsConnection_Status(conn) != NATS_CONN_STATUS_CONNECTED)
    return Unavailable("not connected to NATS", "nats_disconnected");
  jsOptions o;
  jsOptions_Init(&o);
  if (timeout_ms > 0) o.Wait = timeout_ms;
  jsConsumerInfo* ci = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetConsumerInfo(&ci, js, stream.c_str(), durable.c_str(), timeout_ms > 0 ? &o : nullptr, &jerr);
  if (s != NATS_OK) return FromNats(s, "consumer info", jerr);
  uint64_t n = ci->NumPending;
  jsConsumerInfo_Destroy(ci);
  return n;
}

}  // namespace

Result<uint64_t> PullConsumer::NumPending(int64_t timeout_ms) {
  return ConsumerNumPending(conn_, js_, stream_, durable_, timeout_ms);
}

Result<uint64_t> NatsClient::ConsumerPending(const std::string& stream, const std::string& durable,
                                             int64_t timeout_ms) {
  return ConsumerNumPending(conn(), js(), stream, durable, timeout_ms);
}

// ----- KV -------------------------------------------------------------------------

Result<std::unique_ptr<KvBucket>> KvBucket::Open(NatsClient& client, const std::string& bucket,
                                                 int64_t ttl_ms) {
  kvStore* kv = nullptr;
  natsStatus s = js_KeyValue(&kv, client.js(), bucket.c_str());
  if (s == NATS_NOT_FOUND) {
    kvConfig cfg;
    kvConfig_Init(&cfg);
    cfg.Bucket = bucket.c_str();
    cfg.History = 1;
    cfg.TTL = ttl_ms * int64_t{1000000};
    cfg.StorageType = js_FileStorage;
    s = js_CreateKeyValue(&kv, client.js(), &cfg);
    if (s != NATS_OK) {
      const Status created = FromNats(s, "create kv bucket " + bucket);
      s = js_KeyValue(&kv, client.js(), bucket.c_str());  // lost a race to another creator?
      if (s != NATS_OK) return created;  // no: the creation's own error says why
    }
  }
  if (s != NATS_OK) return FromNats(s, "kv bucket " + bucket, s == NATS_NO_RESPONDERS ? kJetStreamNotEnabled : 0);
  ASSIGN_OR_RETURN(auto b, Wrap(client, kv, bucket));
  if (ttl_ms > 0 && b->ttl_ms_ == 0) {
    return Internal("kv bucket " + bucket + " keeps entries forever, but its entries must expire after " +
                        std::to_string(ttl_ms) + " ms; delete the bucket (nats kv del " + bucket +
                        ") to let it be made again",
                    "kv_bucket_mismatch");
  }
  if (ttl_ms != b->ttl_ms_) {
    LOG_WARN("nats", "kv bucket " << bucket << " keeps entries for " << b->ttl_ms_ << " ms, not the " << ttl_ms
                                  << " ms asked for: its creator chose that");
  }
  return b;
}

Result<std::unique_ptr<KvBucket>> KvBucket::Bind(NatsClient& client, const std::string& bucket) {
  kvStore* kv = nullptr;
  natsStatus s = js_KeyValue(&kv, client.js(), bucket.c_str());
  if (s == NATS_NOT_FOUND) return NotFound("kv bucket " + bucket + " does not exist yet");
  if (s != NATS_OK) return FromNats(s, "kv bucket " + bucket, s == NATS_NO_RESPONDERS ? kJetStreamNotEnabled : 0);
  return Wrap(client, kv, bucket);
}

Result<std::unique_ptr<KvBucket>> KvBucket::Wrap(NatsClient& client, kvStore* kv, const std::string& bucket) {
  auto b = std::unique_ptr<KvBucket>(new KvBucket());
  b->kv_.reset(kv);
  b->js_ = client.js();
  b->timeout_ms_ = client.options().js_api_timeout_ms;
  kvStatus* status = nullptr;
  const natsStatus s = kvStore_Status(&status, kv);
  if (s != NATS_OK) return FromNats(s, "kv bucket " + bucket + " status");
  b->ttl_ms_ = kvStatus_TTL(status) / 1000000;
  kvStatus_Destroy(status);
  return b;
}

Status KvBucket::Put(const std::string& key, std::string_view value) {
  uint64_t rev = 0;
  return FromNats(kvStore_Put(&rev, kv_.get(), key.c_str(), value.data(), static_cast<int>(value.size())),
                  "kv put " + key);
}

Result<std::string> KvBucket::Get(const std::string& key) {
  ASSIGN_OR_RETURN(auto entry, GetRevision(key));
  return std::move(entry.first);
}

Result<std::pair<std::string, uint64_t>> KvBucket::GetRevision(const std::string& key) {
  kvEntry* e = nullptr;
  natsStatus s = kvStore_Get(&e, kv_.get(), key.c_str());
  if (s != NATS_OK) return FromNats(s, "kv get " + key);
  std::pair<std::string, uint64_t> out(std::string(static_cast<const char*>(kvEntry_Value(e)), kvEntry_ValueLen(e)),
                                       kvEntry_Revision(e));
  kvEntry_Destroy(e);
  return out;
}

namespace {

// A conditional KV write refused because the key changed: the server's
// "wrong last sequence".
bool WrongLastSequence(natsStatus s) {
  const char* text = nats_GetLastError(nullptr);
  return s == NATS_ERR && text != nullptr && std::string_view(text).find("wrong last sequence") != std::string_view::npos;
}

}  // namespace

Result<bool> KvBucket::Create(const std::string& key, std::string_view value) {
  uint64_t rev = 0;
  natsStatus s = kvStore_Create(&rev, kv_.get(), key.c_str(), value.data(), static_cast<int>(value.size()));
  if (s == NATS_OK) return true;
  if (WrongLastSequence(s)) return false;  // an existing key
  return FromNats(s, "kv create " + key);
}

Result<bool> KvBucket::Update(const std::string& key, std::string_view value, uint64_t revision) {
  uint64_t rev = 0;
  natsStatus s =
      kvStore_Update(&rev, kv_.get(), key.c_str(), value.data(), static_cast<int>(value.size()), revision);
  if (s == NATS_OK) return true;
  if (WrongLastSequence(s)) return false;
  return FromNats(s, "kv update " + key);
}

Status KvBucket::Delete(const std::string& key) {
  return FromNats(kvStore_Delete(kv_.get(), key.c_str()), "kv delete " + key);
}

Result<bool> KvBucket::DeleteAtRevision(const std::string& key, uint64_t revision) {
  // What kvStore_Delete publishes (a "DEL" marker on the key's subject),
  // with the stream's check that the subject's last message is `revision`.
  const std::string subject = std::string("$KV.") + kvStore_Bucket(kv_.get()) + "." + key;
  natsMsg* raw = nullptr;
  natsStatus s = natsMsg_Create(&raw, subject.c_str(), nullptr, nullptr, 0);
  if (s != NATS_OK) return FromNats(s, "kv delete " + key);
  NatsMsgPtr msg(raw);
  natsMsgHeader_Set(raw, "KV-Operation", "DEL");
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.ExpectLastSubjectSeq = revision;
  po.MaxWait = timeout_ms_;
  jsPubAck* ack = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  s = js_PublishMsg(&ack, js_, raw, &po, &jerr);
  if (s == NATS_OK) {
    jsPubAck_Destroy(ack);
    return true;
  }
  if (jerr == JSStreamWrongLastSequenceErr || WrongLastSequence(s)) return false;
  return FromNats(s, "kv delete " + key, jerr);
}

Status KvBucket::ForEachLive(bool with_values, const std::function<void(kvEntry*)>& visit) {
  // A watcher over the bucket's last value per key, read until its
  // "initial values done" marker under one deadline for the whole listing.
  // Not kvStore_Keys: nats.c 3.4 takes the time since the listing began off
  // its timeout once per key, so a listing of a few hundred keys timed out
  // falsely. Delete markers are skipped here, not by the watcher, which
  // does the same per skipped marker within one kvWatcher_Next.
  kvWatchOptions o;
  kvWatchOptions_Init(&o);
  o.MetaOnly = !with_values;
  const int64_t deadline = nats_Now() + timeout_ms_;
  kvWatcher* raw = nullptr;
  natsStatus s = kvStore_WatchAll(&raw, kv_.get(), &o);
  if (s != NATS_OK) return FromNats(s, "kv list");
  std::unique_ptr<kvWatcher, decltype(&kvWatcher_Destroy)> watcher(raw, &kvWatcher_Destroy);
  for (;;) {
    const int64_t left = deadline - nats_Now();
    if (left <= 0) return FromNats(NATS_TIMEOUT, "kv list");
    kvEntry* e = nullptr;
    s = kvWatcher_Next(&e, watcher.get(), left);
    if (s != NATS_OK) return FromNats(s, "kv list");
    if (e == nullptr) return Status::Ok();  // every key's last value seen
    std::unique_ptr<kvEntry, decltype(&kvEntry_Destroy)> entry(e, &kvEntry_Destroy);
    const kvOperation op = kvEntry_Operation(e);
    if (op != kvOp_Delete && op != kvOp_Purge) visit(e);
  }
}

Result<std::vector<std::pair<std::string, std::string>>> KvBucket::Entries() {
  std::vector<std::pair<std::string, std::string>> out;
  RETURN_IF_ERROR(ForEachLive(true, [&](kvEntry* e) {
    out.emplace_back(kvEntry_Key(e), std::string(static_cast<const char*>(kvEntry_Value(e)),
                                                 static_cast<size_t>(std::max(kvEntry_ValueLen(e), 0))));
  }));
  std::sort(out.begin(), out.end());
  return out;
}

Result<std::vector<std::string>> KvBucket::Keys() {
  std::vector<std::string> out;
  RETURN_IF_ERROR(ForEachLive(false, [&](kvEntry* e) { out.emplace_back(kvEntry_Key(e)); }));
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace shoal
