// NATS and JetStream access for Shoal: RAII over nats.c handles, the work
// stream's set-up, pull consumers (the worker's QueueClient), messages with
// ack/nak/term, and KV buckets for the registry and the model catalog.
// Nothing here knows about models or HTTP.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

// nats.c types, kept opaque here so users of this header need no nats.h.
typedef struct __natsConnection natsConnection;
typedef struct __natsMsg natsMsg;
typedef struct __natsSubscription natsSubscription;
typedef struct __jsCtx jsCtx;
typedef struct __kvStore kvStore;
typedef struct __kvEntry kvEntry;

namespace shoal {

struct NatsDeleter {
  void operator()(natsConnection* p) const;
  void operator()(natsMsg* p) const;
  void operator()(natsSubscription* p) const;
  void operator()(jsCtx* p) const;
  void operator()(kvStore* p) const;
};
using NatsConnectionPtr = std::unique_ptr<natsConnection, NatsDeleter>;
using NatsMsgPtr = std::unique_ptr<natsMsg, NatsDeleter>;
using NatsSubscriptionPtr = std::unique_ptr<natsSubscription, NatsDeleter>;
using JsCtxPtr = std::unique_ptr<jsCtx, NatsDeleter>;
using KvStorePtr = std::unique_ptr<kvStore, NatsDeleter>;

struct NatsOptions {
  std::string url = "nats://127.0.0.1:4222";
  std::string name = "shoal";
  // Flush every publish at once: replies and acks must not sit in a buffer.
  bool send_asap = true;
  int64_t connect_timeout_ms = 2000;
  int64_t js_api_timeout_ms = 5000;
  // Keep reconnecting forever (a NATS restart must not kill gateways/workers).
  bool retry_forever = true;
  // A write the link has not taken within this long fails the connection,
  // and nats.c reconnects. With none, a server that stops reading (frozen,
  // or cut off without a reset) blocks a publish inside send() while it
  // holds the connection's lock, and with it every NATS call of the
  // process, until TCP gives up (many minutes); with it, for this long.
  int64_t write_deadline_ms = 10000;
  // A server that has not answered ping_max_out pings, sent every
  // ping_interval_ms, is taken as gone and reconnected to (nats.c's
  // defaults, 2 minutes x 2, leave a half-open connection looking alive for
  // minutes while pulls, acks and replies vanish).
  int64_t ping_interval_ms = 10000;
  int ping_max_out = 3;
  Status Validate() const;
};

// Message handler for core-NATS subscriptions: runs on nats.c's delivery
// thread and takes ownership of the message.
using NatsMsgHandler = void (*)(natsConnection*, natsSubscription*, natsMsg*, void*);

// An asynchronous core-NATS subscription (NatsClient::Subscribe). The
// destructor drains it while connected (the server stops sending, the
// messages nats.c has already received still go to the handler, for up to
// kMaxWaitMs / 2; disconnected, it unsubscribes), then waits until the
// handler has returned for good, so whatever the handler's closure points
// to may be freed right after. It waits at most kMaxWaitMs in all and then
// logs and goes on (never a hang). Must not be destroyed from inside its
// own handler, nor outlive its NatsClient.
class Subscription {
 public:
  static constexpr int64_t kMaxWaitMs = 5000;
  ~Subscription();
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;
  natsSubscription* get() const { return sub_; }

 private:
  friend class NatsClient;
  struct Done;
  Subscription(natsSubscription* sub, natsConnection* conn, Done* done) : sub_(sub), conn_(conn), done_(done) {}
  natsSubscription* sub_;
  natsConnection* conn_;  // the client's; outlives the subscription
  Done* done_;  // set by nats.c once the handler is finished; freed by the destructor
};
using SubscriptionPtr = std::unique_ptr<Subscription>;

// Whether a message can be published to `subject`: 1 to kMaxPublishSubject
// bytes of tokens joined by '.', none empty and none a wildcard ('*', '>'),
// with no blank or control byte. nats.c writes the subject into the
// protocol line as it is: with blanks it goes to another subject or makes
// nats-server close the connection (and drop every ack, reply and pull in
// flight on it), as does a line past the server's 4 KiB.
inline constexpr size_t kMaxPublishSubject = 1024;
bool IsPublishableSubject(std::string_view subject);

// One connection plus its JetStream context. Thread-safe (nats.c is).
class NatsClient {
 public:
  static Result<std::unique_ptr<NatsClient>> Connect(const NatsOptions& options);
  ~NatsClient();

  natsConnection* conn() const { return conn_.get(); }
  jsCtx* js() const { return js_.get(); }
  bool IsConnected() const;
  const NatsOptions& options() const { return options_; }

  // The largest body a message on this connection may have, with
  // kHeaderRoom kept for its headers (the server's max_payload counts them);
  // 0 while not connected (unknown). A larger body fails to publish with
  // PayloadTooLarge "message_too_large".
  static constexpr int64_t kHeaderRoom = 4096;
  int64_t MaxBodyBytes() const;
  // Whether a body of `bytes` fits one message (true while unknown).
  bool BodyFits(size_t bytes) const {
    const int64_t max = MaxBodyBytes();
    return max <= 0 || static_cast<int64_t>(bytes) <= max;
  }
  // Core-NATS publish of a prepared message (headers allowed). Non-blocking.
  // Both refuse a subject IsPublishableSubject rejects (InvalidArgument
  // "invalid_subject") before anything is sent.
  Status PublishMsg(natsMsg* msg);
  Status Publish(std::string_view subject, std::string_view data);
  // Asynchronous subscription; `handler` owns each message it gets and
  // runs on nats.c's delivery thread. See Subscription for its end.
  Result<SubscriptionPtr> Subscribe(const std::string& subject, NatsMsgHandler handler, void* closure);
  // Messages waiting undelivered for durable consumer `durable` of
  // `stream`, from the server (as PullConsumer::NumPending, without a
  // subscription of one's own); NotFound when there is no such consumer.
  Result<uint64_t> ConsumerPending(const std::string& stream, const std::string& durable, int64_t timeout_ms = 0);
  Status Flush(int64_t timeout_ms);
  // A fresh unique inbox subject.
  std::string NewInbox();
  // Core-NATS request/reply: the reply's data. Unavailable when nobody
  // listens on `subject`, DeadlineExceeded after timeout_ms.
  Result<std::string> Request(const std::string& subject, std::string_view data, int64_t timeout_ms);
  // The same, giving up within about 100 ms once `*cancel` turns true
  // (Unavailable "cancelled").
  Result<std::string> Request(const std::string& subject, std::string_view data, int64_t timeout_ms,
                              const std::atomic<bool>& cancel);

 private:
  NatsClient() = default;
  NatsOptions options_;
  NatsConnectionPtr conn_;
  JsCtxPtr js_;
};

// Converts a nats.c status (and optional JetStream error code) to a Status.
Status FromNats(int nats_status, const std::string& what, int js_err = 0);

// ----- The work stream -------------------------------------------------------

struct WorkStreamOptions {
  std::string name = "SHOAL_WORK";
  std::string subjects = "shoal.work.>";
  int replicas = 1;
  bool file_storage = true;
  int64_t max_msgs = 100000;
  int64_t max_bytes = int64_t{1} << 30;
  int32_t max_msg_bytes = 8 << 20;
  int64_t duplicate_window_ms = 120000;
  // The owner creates the stream or updates its config; others verify.
  bool owner = true;
  Status Validate() const;
};

// Creates (owner) or checks the work stream plus its dead-letter stream,
// which captures MaxDeliver advisories of the work consumers.
Status EnsureWorkStream(NatsClient& client, const WorkStreamOptions& options);

struct StreamState {
  uint64_t msgs = 0;
  uint64_t bytes = 0;
  int64_t consumers = 0;
};
Result<StreamState> GetStreamState(NatsClient& client, const std::string& stream);

// Messages held per subject (waiting or delivered but not yet acked) for
// the subjects matching `filter`, from one stream-info request. Subjects with
// no messages are absent.
Result<std::map<std::string, uint64_t>> GetSubjectCounts(NatsClient& client, const std::string& stream,
                                                         const std::string& filter);

// Publish time (Unix ms) of the oldest message on `subject`, by a direct get
// (the stream allows it). NotFound when the subject holds none.
Result<int64_t> OldestMessageUnixMs(NatsClient& client, const std::string& stream,
                                    const std::string& subject);
// The same for the newest message on `subject`.
Result<int64_t> NewestMessageUnixMs(NatsClient& client, const std::string& stream, const std::string& subject);

// ----- Pull consumers and deliveries ----------------------------------------

// One message delivered by a pull consumer. Exactly one of Ack/Term/Nak
// should be called; InProgress any number of times before. Thread-safe to
// call from another thread than the fetcher, once fetched.
// A core-NATS message (pushed straight to a worker, not from the stream)
// is wrapped with Core(): it has no delivery state, so Ack/Term/Nak/
// InProgress do nothing and nothing is ever redelivered.
class Delivery {
 public:
  // A message a pull consumer fetched on `conn`: its acks are published
  // there, to the message's reply subject.
  Delivery(natsMsg* msg, natsConnection* conn) : msg_(msg), conn_(conn) {}
  static Delivery Core(natsMsg* msg) {
    Delivery d(msg, nullptr);
    d.core_ = true;
    return d;
  }
  // Whether this message came outside the stream (see Core()).
  bool is_core() const { return core_; }
  std::string_view Data() const;
  // Header value or empty.
  std::string_view Header(const char* name) const;
  // Times this message has been delivered (1 on first delivery).
  uint64_t NumDelivered() const;
  // When the message was published into the stream (Unix ms); 0 if unknown.
  int64_t PublishedUnixMs() const;
  // Both of the above from one parse of the message's metadata.
  struct Info {
    uint64_t num_delivered = 1;
    int64_t published_unix_ms = 0;
  };
  Info Metadata() const;
  Status Ack();          // done; asynchronous (no round trip)
  Status Term();         // done for good; never redeliver (bad input)
  Status Nak(int64_t delay_ms = 0);  // redeliver (after delay)
  Status InProgress();   // extend the ack deadline
  // Where acks of this message go (empty for a Core() message); see
  // ProgressKeeper, which notes progress there from another thread.
  std::string AckSubject() const;
 private:
  // Publishes an acknowledgement ("+ACK", "-NAK", ...) to the reply subject.
  Status Acknowledge(std::string_view body, const char* what);
  NatsMsgPtr msg_;
  natsConnection* conn_ = nullptr;  // not owned
  bool core_ = false;
};

struct ConsumerOptions {
  int64_t ack_wait_ms = 30000;
  int max_deliver = 5;
  int max_ack_pending = 10000;
  // A consumer whose pulls keep coming back empty checks this often that
  // its durable still exists (an operator's `nats consumer rm`, a stream
  // reset), and creates it again if not.
  int64_t existence_check_ms = 30000;
  Status Validate() const;
};

// A durable pull consumer on one subject, shared by every process that
// serves it (competing consumers). Pulls are sent by hand ($JS.API.CONSUMER.
// MSG.NEXT) and answered on a plain subscription to this consumer's own
// inbox, so what waits there can be read without a new pull (see
// TakeQueued). Fetch is not thread-safe: one fetcher thread per
// PullConsumer.
class PullConsumer {
 public:
  // Creates the durable consumer if missing (updating ack_wait/max_deliver
  // if it exists) and binds a pull subscription to it.
  static Result<std::unique_ptr<PullConsumer>> Create(NatsClient& client, const std::string& stream,
                                                      const std::string& subject,
                                                      const std::string& durable,
                                                      const ConsumerOptions& options);
  // Returns up to max_msgs messages: those already delivered here first
  // (without a pull), otherwise one pull that the server answers with what
  // it has, or with the first message to arrive within max_wait_ms.
  // Timeout: an empty vector.
  Result<std::vector<Delivery>> Fetch(int max_msgs, int64_t max_wait_ms);
  // Messages waiting for this consumer (not yet delivered), from the server.
  // `timeout_ms` > 0 bounds the wait for the answer (else the client's
  // js_api_timeout_ms); Unavailable at once while disconnected.
  Result<uint64_t> NumPending(int64_t timeout_ms = 0);
  // Messages already delivered to this subscription but not yet returned by
  // a Fetch: a pull that timed out on the client can still be answered by
  // the server a moment later, and what it delivers waits here (unacked,
  // its AckWait running) until the next Fetch takes it.
  int Undelivered();
  // Ends the subscription (the durable consumer stays) without losing what
  // the server already sent: the server is told to stop delivering, a Fetch
  // blocked in another thread returns as soon as it has confirmed (one round
  // trip, not the long poll; at once when disconnected), and the messages
  // that were on their way stay queued here for TakeQueued. For shutting a
  // fetcher down.
  void Interrupt();
  // Ends a Fetch blocked in another thread at once (it returns what it has,
  // or nothing) and keeps the subscription: its pulls stay listed at the
  // server until they expire, and what the server delivers to them queues
  // here for the next Fetch or for TakeQueued after Interrupt. A Fetch that
  // starts after the wake skips it and waits its full time, so a caller
  // repeats Wake until its fetcher has gone. False when the message could
  // not be sent (disconnected: the Fetch then ends with its pull).
  bool Wake();
  // After Interrupt, once no other thread fetches: the messages delivered to
  // this subscription that no Fetch returned, waiting up to max_wait_ms for
  // the server to confirm that nothing more is coming. They are unacked: the
  // caller hands them back (Nak) or answers them; dropped, they would wait
  // out AckWait before anyone could have them again. Sends no pull.
  std::vector<Delivery> TakeQueued(int64_t max_wait_ms);
  // A subject this subscription receives on, for a pull sent by hand (each
  // Fetch's own pull is answered on a subject of its own).
  std::string Inbox() const;
  // How long until the last of the pulls this consumer sent expires at the
  // server (0: none is open). The subscription must outlive them (see
  // ConsumerPark).
  int64_t PullLeftMs() const;

 private:
  PullConsumer() = default;
  natsConnection* conn_ = nullptr;  // not owned: the NatsClient's
  jsCtx* js_ = nullptr;             // not owned: the NatsClient's
  std::string stream_;
  std::string durable_;
  std::string next_subject_;        // where pulls are sent
  std::string inbox_;               // pulls are answered on inbox_.<n>
  std::string wake_subject_;        // inbox_.wake
  NatsSubscriptionPtr sub_;         // on inbox_.*
  uint64_t pulls_ = 0;              // fetcher thread only
  std::atomic<int64_t> pulls_end_ms_{0};  // steady clock: when the last pull sent expires
  std::atomic<bool> interrupted_offline_{false};  // Interrupt() found no connection: nothing more arrives
  std::string subject_;             // what the durable filters on (to create it again)
  ConsumerOptions options_;
  int64_t recreated_ms_ = 0;        // fetcher thread only: when the durable was last created again
  int64_t checked_ms_ = 0;          // fetcher thread only: when an empty Fetch last checked that it exists
  // Creates the durable again if it no longer exists (`why` empty: asks
  // first; else known gone, for that reason).
  void RecreateIfGone(const std::string& why);
  // RecreateIfGone("") at most once every `every_ms`.
  void CheckGoneEvery(int64_t every_ms);
  Status SendPull(const std::string& reply, size_t batch, int64_t wait_ms, bool no_wait);
};

// ----- KV buckets -------------------------------------------------------------

class KvBucket {
 public:
  // Binds to the bucket, creating it when missing. ttl_ms 0: keep forever.
  // An existing bucket keeps the TTL its creator gave it (see ttl_ms()),
  // except that one keeping entries forever is refused when ttl_ms > 0:
  // entries meant to expire (a dead worker's heartbeat, a claim) never
  // would.
  static Result<std::unique_ptr<KvBucket>> Open(NatsClient& client, const std::string& bucket,
                                                int64_t ttl_ms);
  // Binds to an existing bucket only (its creator chose its TTL); NotFound
  // when it does not exist yet.
  static Result<std::unique_ptr<KvBucket>> Bind(NatsClient& client, const std::string& bucket);
  // How long the bucket keeps an entry; 0: forever.
  int64_t ttl_ms() const { return ttl_ms_; }
  Status Put(const std::string& key, std::string_view value);
  // Writes `key` only if it holds no value now: true when this call created
  // it, false when it already existed (someone else holds it).
  Result<bool> Create(const std::string& key, std::string_view value);
  // NotFound when absent.
  Result<std::string> Get(const std::string& key);
  // The value and its revision (for Update). NotFound when absent.
  Result<std::pair<std::string, uint64_t>> GetRevision(const std::string& key);
  // Writes `key` only if its latest revision is still `revision`: true when
  // written, false when someone wrote (or deleted) it since.
  Result<bool> Update(const std::string& key, std::string_view value, uint64_t revision);
  Status Delete(const std::string& key);
  // Deletes `key` only if its latest revision is still `revision`: true
  // when deleted, false when someone wrote (or deleted) it since. Unlike
  // Delete, one that times out and reaches the server later (nats.c sends
  // what it buffered once reconnected) cannot remove a value written since.
  Result<bool> DeleteAtRevision(const std::string& key, uint64_t revision);
  // All live keys (may be empty), in key order.
  Result<std::vector<std::string>> Keys();
  // Every live key with its value, in key order, read in one pass over the
  // bucket. Either all of them or an error (a view without some entries
  // would be wrong, not just old). Both read the entries within the
  // client's js_api_timeout_ms in all, however many keys there are (the
  // watcher's set-up and removal are API requests of their own).
  Result<std::vector<std::pair<std::string, std::string>>> Entries();

 private:
  KvBucket() = default;
  // Takes `kv` (owned from here on) and reads its TTL.
  static Result<std::unique_ptr<KvBucket>> Wrap(NatsClient& client, kvStore* kv, const std::string& bucket);
  // Calls `visit` with each live key's last entry (values left out unless
  // `with_values`), read within timeout_ms_ of the start.
  Status ForEachLive(bool with_values, const std::function<void(kvEntry*)>& visit);

  KvStorePtr kv_;
  jsCtx* js_ = nullptr;  // the client's
  int64_t timeout_ms_ = 5000;  // listings: the client's js_api_timeout_ms
  int64_t ttl_ms_ = 0;
};

}  // namespace shoal
