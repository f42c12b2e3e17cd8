// Blob stores for payloads too large to travel inside a queue message: the
// gateway stores a request's payload and enqueues only a reference (BlobRef);
// the worker fetches it, and large results come back the same way. Stores:
// a local directory (`file://`, the embedded default) and the NATS JetStream
// object store (`nats-os://`, the cluster default, readable and writable by
// other NATS clients). Every read is verified against the reference's size
// and SHA-256, so a missing or tampered blob is a clear error, never wrong
// bytes handed to a model. The interface leaves room for an S3 store.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace shoal {

class Clock;
class NatsClient;

// Machine-readable reasons (Status::reason()) of blob errors.
inline constexpr char kBlobNotFound[] = "blob_not_found";        // NotFound: absent, deleted or expired
inline constexpr char kBlobCorrupt[] = "blob_corrupt";           // Internal: size/digest/chunks do not match
inline constexpr char kBlobRefInvalid[] = "blob_ref_invalid";    // InvalidArgument: unreadable reference
inline constexpr char kBlobStoreMismatch[] = "blob_store_mismatch";  // InvalidArgument: ref of another store
inline constexpr char kBlobStoreFull[] = "blob_store_full";      // ResourceExhausted: store limits reached

// Names: 1-255 characters from [A-Za-z0-9._-], the first one a letter or
// digit. That keeps names safe as file names (no '/', no "..", no hidden
// files) and inside a URL without escaping.
Status ValidateBlobName(std::string_view name);

// A store id a reference can carry (the local store's `id`): 1-255
// characters from [A-Za-z0-9_-].
bool ValidStoreId(std::string_view id);

// Where a blob lives and what it must contain. Its text form travels in the
// queue message's payload-reference header:
//   nats-os://<bucket>/<name>?size=<bytes>&sha256=<64 hex>
//   file://<store id>/<name>?size=<bytes>&sha256=<64 hex>
struct BlobRef {
  std::string scheme;  // "nats-os" or "file" (later "s3")
  std::string store;   // bucket, or the local store's id
  std::string name;
  uint64_t size = 0;
  std::array<uint8_t, 32> sha256{};

  std::string ToString() const;
  std::string Sha256Hex() const;
  bool operator==(const BlobRef&) const = default;
};

// Parses and validates a reference: InvalidArgument with kBlobRefInvalid for
// an unknown scheme, a bad name (path traversal included), size or digest.
Result<BlobRef> ParseBlobRef(std::string_view text);

// Pulls the next bytes of a blob being stored: writes at most `capacity`
// bytes into `buffer` and returns how many; 0 means the end. An error aborts
// the Put (nothing is left behind).
using BlobSource = std::function<Result<size_t>(char* buffer, size_t capacity)>;
// Receives a blob's bytes in order, in pieces of any size. The bytes are
// verified only when the whole blob has been read: if Get returns an error,
// the caller must discard what the sink received.
using BlobSink = std::function<Status(std::string_view piece)>;

// A blob store. Every method is thread-safe and blocking (file or network
// I/O): call it from a worker thread or a blocking pool, never from an event
// loop thread.
class BlobStore {
 public:
  virtual ~BlobStore() = default;

  // "file", "nats-os": the scheme of the references this store makes.
  virtual std::string_view scheme() const = 0;
  // The store part of its references (bucket or local id).
  virtual const std::string& store_id() const = 0;

  // Stores the bytes `source` yields under `name` (empty: the store makes a
  // fresh unique name) and returns the reference. A name that exists is
  // replaced. `fresh_name`: the caller made `name` unique (a random one), so
  // there is no object to replace and the store does not look for one (the
  // NATS store would spend a round trip or two on it). The bytes are
  // streamed, never held whole by the store.
  virtual Result<BlobRef> PutFrom(const BlobSource& source, const std::string& name = {},
                                  bool fresh_name = false) = 0;
  // Convenience: PutFrom over `data`.
  Result<BlobRef> Put(std::string_view data, const std::string& name = {}, bool fresh_name = false);

  // Streams the blob to `sink`, verifying chunk count, size and SHA-256
  // against `ref` (NotFound/kBlobNotFound, Internal/kBlobCorrupt).
  virtual Status GetTo(const BlobRef& ref, const BlobSink& sink) = 0;
  // Convenience: the whole blob in memory.
  Result<std::string> Get(const BlobRef& ref);

  // The reference of the blob stored under `name` now (for blobs written by
  // someone who did not hand over a reference). NotFound when absent. The
  // NATS store reads the object's meta; the local store hashes the file.
  virtual Result<BlobRef> Stat(const std::string& name) = 0;

  // Removes the blob; OK when it is already gone (deletes are retried).
  virtual Status Delete(const std::string& name) = 0;

  // Removes blobs last written more than `older_than_ms` ago by the store's
  // clock, plus leftovers of interrupted writes, and returns how many it
  // removed: the clean-up of orphans left by crashed gateways and workers.
  virtual Result<size_t> Sweep(int64_t older_than_ms) = 0;

  // InvalidArgument/kBlobStoreMismatch unless `ref` belongs to this store.
  Status CheckRef(const BlobRef& ref) const;
};

// Opens a store by URL:
//   file:///abs/dir[?id=<store id>]   a local directory (created if missing);
//                                     the id (default "local") names it in refs
//   nats://[<bucket>][?chunk_bytes=N&max_age_ms=N&replicas=N&max_bytes=N&direct_reads=0|1
//                                     &stream_read_min_chunks=N]
//   nats-os://<bucket>[?...]          the NATS object store on `nats`
//                                     (default bucket SHOAL_BLOBS; the bucket
//                                     is created when missing)
// `nats` may be null for file URLs and must outlive the store otherwise.
// `clock` (null: the system clock) dates writes and drives Sweep.
Result<std::unique_ptr<BlobStore>> OpenBlobStore(std::string_view url, NatsClient* nats,
                                                 const Clock* clock = nullptr);
// The checks OpenBlobStore makes of `url` itself (scheme, form, options),
// opening nothing.
Status CheckBlobStoreUrl(std::string_view url);

}  // namespace shoal
