// NatsObjectStore: blobs in a NATS JetStream object store bucket, the
// cluster's store. nats.c 3.4 has no object-store API, so this implements the
// documented layout (ADR-20, as nats.go and nats.js write it) over plain
// JetStream: stream OBJ_<bucket>; an object's chunks on $O.<bucket>.C.<nuid>;
// its JSON meta (rolled up per subject) on $O.<bucket>.M.<base64url(name)>.
// Blobs written here are readable by other NATS clients and the reverse.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "blob/blob_store.h"

namespace shoal {

struct NatsObjectStoreOptions {
  std::string bucket = "SHOAL_BLOBS";  // [A-Za-z0-9_-]+
  int64_t chunk_bytes = 128 * 1024;    // capped at the server's max payload
  // Stream limits used when this store creates the bucket (an existing
  // bucket is used as it is): max_age_ms 0 keeps objects until deleted or
  // swept; it also expires meta, so an object simply disappears after it.
  int64_t max_age_ms = 0;
  int64_t max_bytes = -1;
  int replicas = 1;
  bool file_storage = true;
  // Reads by direct get, answered by any replica that is current (fast,
  // spreads load). A miss is retried at the stream leader, since a replica
  // can trail a write by moments. false: every read asks the leader.
  bool direct_reads = true;
  // Objects of at least this many chunks are read through an ordered
  // consumer (pushed by the stream leader, flow-controlled; ~3x the
  // throughput of one direct get per chunk on big objects); smaller ones by
  // direct gets (no consumer to set up). 0: always the consumer.
  int stream_read_min_chunks = 2;
  // Async chunk publishes in flight per Put.
  int max_pending_chunks = 32;
  const Clock* clock = nullptr;  // null: the system clock
  Status Validate() const;
};

class NatsObjectStore final : public BlobStore {
 public:
  // Binds to the bucket, creating its stream when missing. `client` must
  // outlive the store.
  static Result<std::unique_ptr<NatsObjectStore>> Open(NatsClient& client,
                                                       const NatsObjectStoreOptions& options);

  std::string_view scheme() const override { return "nats-os"; }
  const std::string& store_id() const override { return options_.bucket; }
  Result<BlobRef> PutFrom(const BlobSource& source, const std::string& name = {}, bool fresh_name = false) override;
  Status GetTo(const BlobRef& ref, const BlobSink& sink) override;
  Result<BlobRef> Stat(const std::string& name) override;
  Status Delete(const std::string& name) override;
  Result<size_t> Sweep(int64_t older_than_ms) override;

  const std::string& stream_name() const { return stream_; }
  std::string MetaSubject(const std::string& name) const;
  std::string ChunkSubject(const std::string& nuid) const;

 private:
  struct Meta;
  struct StoredMsg;
  // The message on `subject` at or after `seq` (next=true), or the last one
  // on `subject`. NotFound when there is none.
  Result<StoredMsg> GetMsg(const std::string& subject, uint64_t seq, bool next);
  Result<StoredMsg> GetMsgFromLeader(const std::string& subject, uint64_t seq, bool next);
  // Feeds the `chunks` chunks on `subject` to `consume` in order.
  Status ReadChunksStreamed(const std::string& subject, uint64_t chunks,
                            const std::function<Status(std::string_view)>& consume,
                            const std::function<Status(uint64_t present)>& missing);
  NatsObjectStore(NatsClient& client, NatsObjectStoreOptions options);
  // The name's last meta. `seq`, when given, gets its stream sequence
  // whenever one was read, readable or not.
  Result<Meta> ReadMeta(const std::string& name, uint64_t* seq = nullptr);
  Status PublishMeta(const Meta& meta);
  // Purges `subject`; with below_seq, only its messages before that stream
  // sequence (so one stored since is kept).
  Status PurgeSubject(const std::string& subject, uint64_t below_seq = 0);

  NatsClient& client_;
  NatsObjectStoreOptions options_;
  std::string stream_;
  const Clock* clock_ = nullptr;
};

}  // namespace shoal
