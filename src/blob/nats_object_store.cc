#include "blob/nats_object_store.h"

#include <nats/nats.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "blob/internal/codec.h"
#include "common/clock.h"
#include "common/log.h"
#include "queue/nats_client.h"

namespace shoal {

namespace {

constexpr char kDigestPrefix[] = "SHA-256=";

bool ValidBucket(const std::string& b) {
  if (b.empty()) return false;
  return std::all_of(b.begin(), b.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
}

// First failure reported by nats.c for this Put's async chunk publishes.
struct PublishErrors {
  std::mutex mu;
  bool failed = false;
  natsStatus status = NATS_OK;
  int js_err = 0;
  std::string text;
};

void OnPublishError(jsCtx*, jsPubAckErr* pae, void* closure) {
  auto* errors = static_cast<PublishErrors*>(closure);
  std::lock_guard<std::mutex> lock(errors->mu);
  if (errors->failed) return;
  errors->failed = true;
  errors->status = pae->Err;
  errors->js_err = static_cast<int>(pae->ErrCode);
  errors->text = pae->ErrText != nullptr ? pae->ErrText : natsStatus_GetText(pae->Err);
}

Status PublishFailure(const std::string& what, natsStatus s, int js_err, const std::string& text) {
  // A bucket at its limits (discard new) refuses more: "maximum bytes
  // exceeded", "maximum messages exceeded", "maximum messages per subject
  // exceeded"; a server out of storage, "insufficient resources". Not
  // "message size exceeds maximum allowed" (the stream's max_msg_size),
  // which no waiting cures.
  if (text.find("maximum bytes") != std::string::npos || text.find("maximum messages") != std::string::npos ||
      text.find("insufficient resources") != std::string::npos) {
    return ResourceExhausted(what + ": " + text, kBlobStoreFull);
  }
  Status st = FromNats(s == NATS_OK ? NATS_ERR : s, what, js_err);
  return Status(st.code(), st.message() + (text.empty() ? "" : " (" + text + ")"), st.reason());
}

// An existing bucket's stream, made by whichever client: one whose
// settings would break the store in use (rather than at once) is refused
// at start, saying what to change. Caps options->chunk_bytes at the
// stream's max_msg_size.
Status CheckObjectStream(const jsStreamConfig& c, const std::string& stream, NatsObjectStoreOptions* options) {
  const std::string bucket = "stream " + stream + " (bucket " + options->bucket + ")";
  if (!c.AllowRollup || !c.AllowDirect)
    return InvalidArgument(bucket + " is not an object store (needs allow_rollup_hdrs and allow_direct)");
  const std::string chunks = "$O." + options->bucket + ".C.>", metas = "$O." + options->bucket + ".M.>";
  bool has_chunks = false, has_metas = false;
  for (int i = 0; i < c.SubjectsLen; ++i) {
    has_chunks |= c.Subjects[i] != nullptr && chunks == c.Subjects[i];
    has_metas |= c.Subjects[i] != nullptr && metas == c.Subjects[i];
  }
  if (!has_chunks || !has_metas)
    return InvalidArgument(bucket + " does not take the object store's subjects " + chunks + " and " + metas);
  if (c.Sealed) return InvalidArgument(bucket + " is sealed: it takes no new blobs");
  if (c.Discard == js_DiscardOld && (c.MaxBytes > 0 || c.MaxMsgs > 0))
    return InvalidArgument(bucket + " discards old messages at its limits: the server would drop chunks of blobs "
                                    "still in use (object stores discard new; delete the stream to let it be made "
                                    "again)");
  if (c.MaxMsgsPerSubject > 0)
    return InvalidArgument(bucket + " keeps at most " + std::to_string(c.MaxMsgsPerSubject) +
                           " messages per subject: a blob's chunks share one subject, so a larger blob would lose "
                           "its first chunks");
  constexpr int32_t kMinMsgSize = 4096;  // a meta message must fit
  if (c.MaxMsgSize > 0 && c.MaxMsgSize < kMinMsgSize)
    return InvalidArgument(bucket + " takes messages of at most " + std::to_string(c.MaxMsgSize) +
                           " bytes; an object store needs " + std::to_string(kMinMsgSize) + " at least");
  if (c.MaxMsgSize > 0 && options->chunk_bytes > c.MaxMsgSize) options->chunk_bytes = c.MaxMsgSize;
  return Status::Ok();
}

struct JsCtxDeleter {
  void operator()(jsCtx* js) const { jsCtx_Destroy(js); }
};

std::optional<blob_internal::Sha256Digest> ParseNatsDigest(const std::string& text) {
  if (text.rfind(kDigestPrefix, 0) != 0) return std::nullopt;
  std::string body = text.substr(std::strlen(kDigestPrefix));
  // Other clients have written hex as well as (padded or not) base64.
  if (auto hex = blob_internal::HexDecodeDigest(body)) return hex;
  auto raw = blob_internal::Base64Decode(body);
  if (!raw || raw->size() != 32) return std::nullopt;
  blob_internal::Sha256Digest d{};
  std::memcpy(d.data(), raw->data(), d.size());
  return d;
}

// Whether a meta's "nuid" can name its chunk subject: a plain token (what
// Shoal and the NATS clients write). Any client can write a meta, and one
// with "*" or ">" would make the purge of its chunks a purge of every
// object's.
bool IsChunkToken(std::string_view nuid) {
  return !nuid.empty() && nuid.size() <= 64 && std::all_of(nuid.begin(), nuid.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
  });
}

// A meta's "nuid" when it can name its chunks, else empty (no chunks Shoal
// reads or purges).
std::string MetaNuid(const nlohmann::json& meta) {
  std::string nuid = meta.value("nuid", std::string());
  return IsChunkToken(nuid) ? nuid : std::string();
}

}  // namespace

struct NatsObjectStore::Meta {
  nlohmann::json json;  // as stored: fields other clients wrote are kept on rewrite
  std::string name;
  std::string nuid;
  uint64_t size = 0;
  uint64_t chunks = 0;
  std::string digest;
  int64_t mtime_ms = 0;
  bool deleted = false;
  bool link = false;
};

// A stored message's sequence and data, from a direct get (held in the
// nats.c message) or from the leader's JSON answer (decoded into `owned`).
struct NatsObjectStore::StoredMsg {
  uint64_t seq = 0;
  NatsMsgPtr msg;
  std::string owned;
  std::string_view data() const {
    if (!msg) return owned;
    return {natsMsg_GetData(msg.get()), static_cast<size_t>(natsMsg_GetDataLength(msg.get()))};
  }
};

Status NatsObjectStoreOptions::Validate() const {
  if (!ValidBucket(bucket)) return InvalidArgument("object store bucket must match [A-Za-z0-9_-]+: \"" + bucket + "\"");
  if (chunk_bytes < 1024) return InvalidArgument("object store chunk_bytes must be >= 1024");
  if (max_age_ms < 0) return InvalidArgument("object store max_age_ms must be >= 0");
  if (replicas < 1 || replicas > 5) return InvalidArgument("object store replicas must be in [1, 5]");
  if (max_pending_chunks < 1) return InvalidArgument("object store max_pending_chunks must be >= 1");
  if (stream_read_min_chunks < 0) return InvalidArgument("object store stream_read_min_chunks must be >= 0");
  return Status::Ok();
}

NatsObjectStore::NatsObjectStore(NatsClient& client, NatsObjectStoreOptions options)
    : client_(client), options_(std::move(options)), stream_("OBJ_" + options_.bucket) {
  clock_ = options_.clock != nullptr ? options_.clock : SystemClock::Get();
}

std::string NatsObjectStore::MetaSubject(const std::string& name) const {
  return "$O." + options_.bucket + ".M." + blob_internal::Base64UrlEncode(name, /*pad=*/true);
}

std::string NatsObjectStore::ChunkSubject(const std::string& nuid) const {
  return "$O." + options_.bucket + ".C." + nuid;
}

Result<std::unique_ptr<NatsObjectStore>> NatsObjectStore::Open(NatsClient& client,
                                                               const NatsObjectStoreOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  auto store = std::unique_ptr<NatsObjectStore>(new NatsObjectStore(client, o));
  const int64_t max_payload = natsConnection_GetMaxPayload(client.conn());
  if (max_payload > 0 && store->options_.chunk_bytes > max_payload) store->options_.chunk_bytes = max_payload;

  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, client.js(), store->stream_.c_str(), nullptr, &jerr);
  if (s == NATS_NOT_FOUND) {
    const std::string chunks = "$O." + o.bucket + ".C.>";
    const std::string metas = "$O." + o.bucket + ".M.>";
    const char* subjects[] = {chunks.c_str(), metas.c_str()};
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    cfg.Name = store->stream_.c_str();
    cfg.Subjects = subjects;
    cfg.SubjectsLen = 2;
    cfg.MaxAge = o.max_age_ms * int64_t{1000000};
    cfg.MaxBytes = o.max_bytes;
    cfg.Storage = o.file_storage ? js_FileStorage : js_MemoryStorage;
    cfg.Replicas = o.replicas;
    cfg.Discard = js_DiscardNew;
    cfg.AllowRollup = true;
    cfg.AllowDirect = true;
    s = js_AddStream(&si, client.js(), &cfg, nullptr, &jerr);
    if (s != NATS_OK && jerr == JSStreamNameExistErr) {
      // Someone else created it meanwhile: check theirs below.
      s = js_GetStreamInfo(&si, client.js(), store->stream_.c_str(), nullptr, &jerr);
    }
  }
  if (s != NATS_OK) return FromNats(s, "object store stream " + store->stream_, jerr);
  std::unique_ptr<jsStreamInfo, void (*)(jsStreamInfo*)> info(si, jsStreamInfo_Destroy);
  RETURN_IF_ERROR(CheckObjectStream(*info->Config, store->stream_, &store->options_));
  return store;
}


Result<NatsObjectStore::StoredMsg> NatsObjectStore::GetMsg(const std::string& subject, uint64_t seq,
                                                           bool next) {
  if (!options_.direct_reads) return GetMsgFromLeader(subject, seq, next);
  jsDirectGetMsgOptions dg;
  jsDirectGetMsgOptions_Init(&dg);
  if (next) {
    dg.Sequence = seq;
    dg.NextBySubject = subject.c_str();
  } else {
    dg.LastBySubject = subject.c_str();
  }
  natsMsg* raw = nullptr;
  natsStatus s = js_DirectGetMsg(&raw, client_.js(), stream_.c_str(), nullptr, &dg);
  if (s == NATS_NOT_FOUND) return GetMsgFromLeader(subject, seq, next);
  if (s != NATS_OK) return FromNats(s, "direct get " + subject);
  StoredMsg out;
  out.msg.reset(raw);
  const char* seq_text = nullptr;
  if (natsMsgHeader_Get(raw, "Nats-Sequence", &seq_text) != NATS_OK || seq_text == nullptr) {
    return Internal("direct get reply without Nats-Sequence");
  }
  out.seq = std::strtoull(seq_text, nullptr, 10);
  return out;
}

Result<NatsObjectStore::StoredMsg> NatsObjectStore::GetMsgFromLeader(const std::string& subject, uint64_t seq,
                                                                     bool next) {
  // STREAM.MSG.GET with next_by_subj (server 2.9+): nats.c's js_GetMsg
  // takes a sequence only.
  nlohmann::json req = next ? nlohmann::json{{"seq", seq}, {"next_by_subj", subject}}
                            : nlohmann::json{{"last_by_subj", subject}};
  ASSIGN_OR_RETURN(std::string reply, client_.Request("$JS.API.STREAM.MSG.GET." + stream_, req.dump(),
                                                      client_.options().js_api_timeout_ms));
  StoredMsg out;
  try {
    auto j = nlohmann::json::parse(reply);
    if (auto err = j.find("error"); err != j.end()) {
      const std::string text = err->value("description", std::string("error"));
      if (err->value("code", 0) == 404) return NotFound("no message on " + subject + ": " + text);
      return Internal("get message on " + subject + ": " + text);
    }
    const auto& m = j.at("message");
    out.seq = m.at("seq").get<uint64_t>();
    auto data = blob_internal::Base64Decode(m.value("data", std::string()));
    if (!data) return Internal("get message on " + subject + ": undecodable data");
    out.owned = std::move(*data);
  } catch (const std::exception& e) {
    return Internal("get message on " + subject + ": unreadable answer: " + e.what());
  }
  return out;
}

Result<NatsObjectStore::Meta> NatsObjectStore::ReadMeta(const std::string& name, uint64_t* seq) {
  auto got = GetMsg(MetaSubject(name), 0, /*next=*/false);
  if (got.status().code() == StatusCode::kNotFound) {
    return NotFound("blob " + name + " does not exist in bucket " + options_.bucket, kBlobNotFound);
  }
  if (!got.ok()) return got.status();
  if (seq != nullptr) *seq = got->seq;
  Meta m;
  try {
    m.json = nlohmann::json::parse(got->data());
    m.name = m.json.value("name", std::string());
    m.nuid = MetaNuid(m.json);
    m.size = m.json.value("size", uint64_t{0});
    m.chunks = m.json.value("chunks", uint64_t{0});
    m.digest = m.json.value("digest", std::string());
    m.deleted = m.json.value("deleted", false);
    if (auto opts = m.json.find("options"); opts != m.json.end() && opts->is_object()) {
      auto link = opts->find("link");
      m.link = link != opts->end() && !link->is_null();
    }
    auto mtime = blob_internal::ParseRfc3339Ms(m.json.value("mtime", std::string()));
    m.mtime_ms = mtime.value_or(0);
  } catch (const std::exception& e) {
    return Internal("object meta of " + name + " is unreadable: " + e.what(), kBlobCorrupt);
  }
  return m;
}

Status NatsObjectStore::PublishMeta(const Meta& meta) {
  const std::string subject = MetaSubject(meta.name);
  const std::string body = meta.json.dump();
  natsMsg* raw = nullptr;
  natsStatus s = natsMsg_Create(&raw, subject.c_str(), nullptr, body.data(), static_cast<int>(body.size()));
  if (s != NATS_OK) return FromNats(s, "object meta message");
  NatsMsgPtr msg(raw);
  // Keep only the newest meta per name.
  natsMsgHeader_Set(raw, "Nats-Rollup", "sub");
  jsPubAck* ack = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  s = js_PublishMsg(&ack, client_.js(), raw, nullptr, &jerr);
  if (s != NATS_OK) {
    const char* last = nats_GetLastError(nullptr);
    return PublishFailure("publish object meta " + meta.name, s, jerr, last != nullptr ? last : "");
  }
  jsPubAck_Destroy(ack);
  return Status::Ok();
}

Status NatsObjectStore::PurgeSubject(const std::string& subject, uint64_t below_seq) {
  jsOptions o;
  jsOptions_Init(&o);
  o.Stream.Purge.Subject = subject.c_str();
  o.Stream.Purge.Sequence = below_seq;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  return FromNats(js_PurgeStream(client_.js(), stream_.c_str(), &o, &jerr), "purge " + subject, jerr);
}

Result<BlobRef> NatsObjectStore::PutFrom(const BlobSource& source, const std::string& name_in, bool fresh_name) {
  const bool new_name = name_in.empty() || fresh_name;  // no object to replace
  const std::string name = name_in.empty() ? blob_internal::RandomId() : name_in;
  RETURN_IF_ERROR(ValidateBlobName(name));
  // A named object replaces an older one: its chunks go once the new meta is
  // in. An unreadable meta is replaced too (its chunks, unknown, are left to
  // Sweep): refusing would lock the name for good.
  std::optional<Meta> old;
  if (!new_name) {
    auto m = ReadMeta(name);
    if (m.ok()) old = std::move(m).value();
    else if (m.status().code() != StatusCode::kNotFound && m.status().reason() != kBlobCorrupt) return m.status();
  }

  // A JetStream context of its own: PublishAsyncComplete waits for this
  // Put's chunks only, and errors land in this Put's record. The record
  // outlives the context unless every chunk was settled: an ack that
  // arrives after a timed-out wait may still call the error handler. It is
  // then left allocated (a few dozen bytes per such Put) rather than freed
  // under a late callback.
  bool settled = true;  // the last PublishAsyncComplete left nothing pending
  const auto free_if_settled = [&settled](PublishErrors* p) {
    if (settled) delete p;
  };
  // Declared before the context, so destroyed after it.
  std::unique_ptr<PublishErrors, decltype(free_if_settled)> errors_owner(new PublishErrors, free_if_settled);
  PublishErrors& errors = *errors_owner;
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = client_.options().js_api_timeout_ms;
  jo.PublishAsync.MaxPending = options_.max_pending_chunks;
  jo.PublishAsync.StallWait = client_.options().js_api_timeout_ms;
  jo.PublishAsync.ErrHandler = OnPublishError;
  jo.PublishAsync.ErrHandlerClosure = &errors;
  jsCtx* js_raw = nullptr;
  natsStatus s = natsConnection_JetStream(&js_raw, client_.conn(), &jo);
  if (s != NATS_OK) return FromNats(s, "jetstream context");
  std::unique_ptr<jsCtx, JsCtxDeleter> js(js_raw);

  const std::string nuid = blob_internal::RandomId();
  const std::string chunk_subject = ChunkSubject(nuid);
  auto fail = [&](Status st) {
    // Wait out chunks still in flight before purging them (errors ignored).
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MaxWait = client_.options().js_api_timeout_ms;
    settled = js_PublishAsyncComplete(js.get(), &po) == NATS_OK;
    (void)PurgeSubject(chunk_subject);
    return st;
  };

  blob_internal::Sha256 sha;
  const size_t chunk_bytes = static_cast<size_t>(options_.chunk_bytes);
  std::string buf(chunk_bytes, '\0');
  uint64_t size = 0, chunks = 0;
  bool end = false;
  while (!end) {
    size_t filled = 0;
    while (filled < chunk_bytes) {
      auto n = source(buf.data() + filled, chunk_bytes - filled);
      if (!n.ok()) return fail(n.status());
      if (*n == 0) {
        end = true;
        break;
      }
      filled += *n;
    }
    if (filled == 0) break;
    {
      std::lock_guard<std::mutex> lock(errors.mu);
      if (errors.failed) break;
    }
    sha.Update(std::string_view(buf.data(), filled));
    s = js_PublishAsync(js.get(), chunk_subject.c_str(), buf.data(), static_cast<int>(filled), nullptr);
    if (s != NATS_OK) return fail(FromNats(s, "publish chunk of " + name));
    size += filled;
    ++chunks;
  }
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.MaxWait = client_.options().js_api_timeout_ms;
  s = js_PublishAsyncComplete(js.get(), &po);
  settled = s == NATS_OK;
  {
    std::lock_guard<std::mutex> lock(errors.mu);
    if (errors.failed) {
      return fail(PublishFailure("store chunks of " + name, errors.status, errors.js_err, errors.text));
    }
  }
  if (s != NATS_OK) return fail(FromNats(s, "store chunks of " + name));

  BlobRef ref;
  ref.scheme = "nats-os";
  ref.store = options_.bucket;
  ref.name = name;
  ref.size = size;
  ref.sha256 = sha.Final();

  Meta meta;
  meta.name = name;
  meta.json = {
      {"name", name},
      {"description", ""},
      {"options", {{"max_chunk_size", options_.chunk_bytes}}},
      {"bucket", options_.bucket},
      {"nuid", nuid},
      {"size", size},
      {"mtime", blob_internal::FormatRfc3339Ms(clock_->NowUnixMs())},
      {"chunks", chunks},
      {"digest", kDigestPrefix + blob_internal::Base64UrlEncode(
                     std::string_view(reinterpret_cast<const char*>(ref.sha256.data()), ref.sha256.size()),
                     /*pad=*/true)},
      {"deleted", false},
  };
  if (Status st = PublishMeta(meta); !st.ok()) {
    // Refused by the server: not stored, its chunks go. After a timeout or a
    // lost connection it may be stored all the same (nats.c sends what it
    // buffered once it reconnects): stored now, the Put succeeded; else its
    // chunks stay for Sweep, never purged under a meta that may yet land.
    if (st.code() != StatusCode::kDeadlineExceeded && st.code() != StatusCode::kUnavailable) return fail(st);
    auto now = ReadMeta(name);
    if (!now.ok() || now->nuid != nuid) return st;
    LOG_INFO("blob", "object meta of " << name << " was stored after all (" << st.ToString() << ")");
  }
  if (old && !old->nuid.empty() && old->nuid != nuid) {
    // The new object is live; a failed clean-up only leaves chunks for Sweep.
    (void)PurgeSubject(ChunkSubject(old->nuid));
  }
  return ref;
}

Status NatsObjectStore::GetTo(const BlobRef& ref, const BlobSink& sink) {
  RETURN_IF_ERROR(CheckRef(ref));
  ASSIGN_OR_RETURN(Meta meta, ReadMeta(ref.name));
  if (meta.deleted) return NotFound("blob " + ref.name + " was deleted", kBlobNotFound);
  if (meta.link) return InvalidArgument("blob " + ref.name + " is an object-store link; links are not supported");
  auto digest = ParseNatsDigest(meta.digest);
  if (!digest) return Internal("blob " + ref.name + " has an unreadable digest \"" + meta.digest + "\"", kBlobCorrupt);
  if (*digest != ref.sha256 || meta.size != ref.size) {
    return Internal("blob " + ref.name + " is not the referenced object: stored size " + std::to_string(meta.size) +
                        " and digest differ from the reference (replaced or tampered)",
                    kBlobCorrupt);
  }

  if (meta.nuid.empty() && meta.chunks > 0)
    return Internal("blob " + ref.name + " is corrupt: its meta names no chunk subject", kBlobCorrupt);
  const std::string subject = ChunkSubject(meta.nuid);
  blob_internal::Sha256 sha;
  uint64_t got = 0;
  auto consume = [&](std::string_view piece) -> Status {
    got += piece.size();
    if (got > ref.size) {
      return Internal("blob " + ref.name + " is corrupt: its chunks hold more than " + std::to_string(ref.size) +
                          " bytes",
                      kBlobCorrupt);
    }
    sha.Update(piece);
    return sink(piece);
  };
  auto missing = [&](uint64_t present) {
    return Internal("blob " + ref.name + " is corrupt: " + std::to_string(present) + " of its " +
                        std::to_string(meta.chunks) + " chunks are present",
                    kBlobCorrupt);
  };
  if (meta.chunks >= static_cast<uint64_t>(options_.stream_read_min_chunks)) {
    RETURN_IF_ERROR(ReadChunksStreamed(subject, meta.chunks, consume, missing));
  } else {
    // Sequential gets of "the next message on the chunk subject from seq":
    // no consumer to set up, and a missing chunk is an immediate 404.
    uint64_t next_seq = 1;
    for (uint64_t i = 0; i < meta.chunks; ++i) {
      auto chunk = GetMsg(subject, next_seq, /*next=*/true);
      if (chunk.status().code() == StatusCode::kNotFound) return missing(i);
      if (!chunk.ok()) return chunk.status();
      next_seq = chunk->seq + 1;
      RETURN_IF_ERROR(consume(chunk->data()));
    }
  }
  if (got != ref.size || sha.Final() != ref.sha256) {
    return Internal("blob " + ref.name + " is corrupt: the SHA-256 or size of its chunks does not match",
                    kBlobCorrupt);
  }
  return Status::Ok();
}

Status NatsObjectStore::ReadChunksStreamed(const std::string& subject, uint64_t chunks,
                                           const std::function<Status(std::string_view)>& consume,
                                           const std::function<Status(uint64_t)>& missing) {
  // An ordered consumer: an ephemeral push consumer, flow-controlled, that
  // nats.c recreates on a gap; served by the stream leader. The server
  // pushes chunks without a round trip each.
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = stream_.c_str();
  so.Ordered = true;
  natsSubscription* raw_sub = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_SubscribeSync(&raw_sub, client_.js(), subject.c_str(), nullptr, &so, &jerr);
  if (s != NATS_OK) return FromNats(s, "subscribe " + subject, jerr);
  NatsSubscriptionPtr sub(raw_sub);  // unsubscribing deletes the consumer
  natsSubscription_SetPendingLimits(raw_sub, -1, -1);
  // How many chunks exist, so a missing one is an error now, not a timeout.
  jsConsumerInfo* ci = nullptr;
  s = natsSubscription_GetConsumerInfo(&ci, raw_sub, nullptr, &jerr);
  if (s != NATS_OK) return FromNats(s, "consumer info " + subject, jerr);
  const uint64_t present = ci->Delivered.Consumer + ci->NumPending;
  jsConsumerInfo_Destroy(ci);
  if (present < chunks) return missing(present);
  const int64_t timeout_ms = client_.options().js_api_timeout_ms;
  for (uint64_t i = 0; i < chunks; ++i) {
    natsMsg* raw = nullptr;
    s = natsSubscription_NextMsg(&raw, raw_sub, timeout_ms);
    if (s == NATS_TIMEOUT) {
      return DeadlineExceeded("chunk " + std::to_string(i + 1) + " of " + subject + " did not arrive within " +
                              std::to_string(timeout_ms) + " ms");
    }
    if (s != NATS_OK) return FromNats(s, "read " + subject);
    NatsMsgPtr msg(raw);
    RETURN_IF_ERROR(consume(std::string_view(natsMsg_GetData(raw), static_cast<size_t>(natsMsg_GetDataLength(raw)))));
  }
  return Status::Ok();
}

Result<BlobRef> NatsObjectStore::Stat(const std::string& name) {
  RETURN_IF_ERROR(ValidateBlobName(name));
  ASSIGN_OR_RETURN(Meta meta, ReadMeta(name));
  if (meta.deleted) return NotFound("blob " + name + " was deleted", kBlobNotFound);
  auto digest = ParseNatsDigest(meta.digest);
  if (!digest) return Internal("blob " + name + " has an unreadable digest \"" + meta.digest + "\"", kBlobCorrupt);
  BlobRef ref;
  ref.scheme = "nats-os";
  ref.store = options_.bucket;
  ref.name = name;
  ref.size = meta.size;
  ref.sha256 = *digest;
  return ref;
}

Status NatsObjectStore::Delete(const std::string& name) {
  RETURN_IF_ERROR(ValidateBlobName(name));
  uint64_t seq = 0;
  auto read = ReadMeta(name, &seq);
  // An unreadable meta goes as it is (the one read: not one a Put stored
  // since); the chunks it names, unknown, are left to Sweep.
  if (read.status().reason() == kBlobCorrupt) return PurgeSubject(MetaSubject(name), seq + 1);
  if (!read.ok()) return read.status().code() == StatusCode::kNotFound ? Status::Ok() : read.status();
  Meta meta = std::move(read).value();
  if (!meta.deleted) {
    // The object store's delete: a tombstone meta, then the chunks go.
    meta.name = name;
    meta.json["deleted"] = true;
    meta.json["size"] = 0;
    meta.json["chunks"] = 0;
    meta.json["digest"] = "";
    if (Status st = PublishMeta(meta); !st.ok()) {
      if (st.reason() != kBlobStoreFull) return st;
      // A full bucket refuses even the tombstone, and deleting is how room
      // comes back: the chunks go, then the meta read (as Sweep removes an
      // orphan), leaving no tombstone.
      if (!meta.nuid.empty()) RETURN_IF_ERROR(PurgeSubject(ChunkSubject(meta.nuid)));
      return PurgeSubject(MetaSubject(name), seq + 1);
    }
  }
  if (!meta.nuid.empty()) RETURN_IF_ERROR(PurgeSubject(ChunkSubject(meta.nuid)));
  return Status::Ok();
}

Result<size_t> NatsObjectStore::Sweep(int64_t older_than_ms) {
  const int64_t cutoff_ms = clock_->NowUnixMs() - older_than_ms;
  const std::string prefix = "$O." + options_.bucket + ".";
  size_t removed = 0;

  ASSIGN_OR_RETURN(auto metas, GetSubjectCounts(client_, stream_, prefix + "M.>"));
  std::set<std::string> live_nuids;
  for (const auto& [subject, count] : metas) {
    auto got = GetMsg(subject, 0, /*next=*/false);
    if (got.status().code() == StatusCode::kNotFound) continue;  // gone meanwhile
    if (!got.ok()) return got.status();
    std::string nuid;
    bool deleted = false;
    int64_t mtime_ms = 0;
    try {
      const nlohmann::json j = nlohmann::json::parse(got->data());
      nuid = MetaNuid(j);
      deleted = j.value("deleted", false);
      mtime_ms = blob_internal::ParseRfc3339Ms(j.value("mtime", std::string())).value_or(0);
    } catch (const std::exception&) {
      continue;  // not JSON, or fields of the wrong type (any client can write one): not ours to judge
    }
    if (mtime_ms >= cutoff_ms) {
      if (!deleted && !nuid.empty()) live_nuids.insert(nuid);
      continue;
    }
    // Old: drop the chunks, then the meta (a tombstone serves no one after
    // the TTL, so none is left). Only the meta read here: a Put of the same
    // name may have stored a new one since.
    if (!nuid.empty()) RETURN_IF_ERROR(PurgeSubject(ChunkSubject(nuid)));
    RETURN_IF_ERROR(PurgeSubject(subject, got->seq + 1));
    if (!deleted) ++removed;
  }

  // Chunks that no meta names: a Put that crashed before its meta.
  ASSIGN_OR_RETURN(auto chunk_subjects, GetSubjectCounts(client_, stream_, prefix + "C.>"));
  for (const auto& [subject, count] : chunk_subjects) {
    const std::string nuid = subject.substr(prefix.size() + 2);
    if (live_nuids.count(nuid)) continue;
    // By its newest chunk: a Put that has been uploading for longer than
    // the cutoff is still in progress.
    auto last_ms = NewestMessageUnixMs(client_, stream_, subject);
    if (!last_ms.ok()) continue;
    if (*last_ms >= cutoff_ms) continue;
    RETURN_IF_ERROR(PurgeSubject(subject));
    ++removed;
  }
  return removed;
}

}  // namespace shoal
