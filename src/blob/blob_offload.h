// BlobOffload: moves payloads too large for a queue message through a blob
// store. The gateway offloads encoded work messages above a threshold (the
// message then carries only the reference, header Shoal-Payload-Ref, and an
// empty body), deletes them once the request is answered and sweeps orphans
// on a timer; the worker fetches referenced payloads before decoding and
// offloads large replies the same way. Puts and deletes the gateway asks for
// run on the offload's own threads, never on the caller's (an event loop).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "blob/blob_store.h"
#include "common/metrics.h"
#include "common/status.h"

namespace shoal {

struct BlobOffloadOptions {
  // Store URL (see OpenBlobStore); empty: offload is off.
  std::string store_url;
  // Payloads (encoded work messages and replies) larger than this go to
  // the store. NATS' default max_payload is 1 MiB.
  int64_t threshold_bytes = int64_t{1} << 20;
  // Threads for asynchronous puts and deletes.
  int threads = 2;
  // Payload bytes waiting for (or in) an asynchronous put, all together. A
  // PutAsync past it is refused at once (Unavailable "blob_store_busy"), so
  // a store slower than the uploads cannot make them pile up in memory; a
  // payload larger than this is still taken when no other waits.
  int64_t max_queued_bytes = int64_t{1} << 30;
  // Workers: payloads fetched from the store and not yet answered, all
  // models together. A pulled message whose payload does not fit waits
  // (pulled, its progress noted) until room frees; a payload larger than
  // this is still fetched when no other is held.
  int64_t max_fetched_bytes = int64_t{1} << 30;
  // Sweep(ttl_ms) every sweep_interval_ms; 0: no sweeping (workers).
  int64_t sweep_interval_ms = 0;
  // Blobs older than this are orphans; far above the longest deadline.
  int64_t ttl_ms = int64_t{3600} * 1000;
  Status Validate() const;
};

class BlobOffload {
 public:
  // Opens the store; `nats` (for nats:// stores) and `metrics` must outlive
  // the offload. Starts the threads (and the sweeper when asked).
  static Result<std::unique_ptr<BlobOffload>> Create(const BlobOffloadOptions& options, NatsClient* nats,
                                                     MetricsRegistry* metrics, const Clock* clock = nullptr);
  // Finishes queued puts and deletes, then joins every thread.
  ~BlobOffload();
  BlobOffload(const BlobOffload&) = delete;
  BlobOffload& operator=(const BlobOffload&) = delete;

  bool ShouldOffload(size_t bytes) const { return static_cast<int64_t>(bytes) > options_.threshold_bytes; }

  // Stores `data` on an offload thread and calls `done` there with the
  // reference. Never blocks the caller. `kind` labels the metric
  // ("request" | "reply"). Past max_queued_bytes, `done` gets Unavailable
  // "blob_store_busy" at once, on the caller's thread.
  void PutAsync(std::string data, std::string kind, std::function<void(Result<BlobRef>)> done);
  // The same for a payload in pieces: the blob is their bytes in order,
  // streamed to the store without joining them first.
  void PutAsync(std::vector<std::string> pieces, std::string kind, std::function<void(Result<BlobRef>)> done);
  // Runs `task` on an offload thread (blocking store calls of a caller that
  // must not block, e.g. fetching a reply on a NATS callback thread).
  void Post(std::function<void()> task);
  // Deletes the blob on an offload thread. A delete that fails (the store
  // not answering) is tried again after 1, 2, 4 and 8 s, then left to the
  // sweep; so are retries still due when the offload is destroyed.
  void DeleteAsync(std::string ref_text);

  // Blocking forms for callers on their own threads (the worker). A blob's
  // name starts with its kind and '-' ("reply-…"), so what is whose can be
  // told from a reference (see IsKind).
  Result<BlobRef> Put(std::string_view data, const std::string& kind);
  Result<BlobRef> Put(const std::vector<std::string>& pieces, const std::string& kind);
  // What a caller hears when a put of its payload (`what`: "the request
  // payload", "the result") failed: 429 blob_store_full when the store is
  // full, 503 blob_store_busy when too much waits to be stored, else 503
  // blob_store_unavailable (the next try may get through).
  static Status PutFailure(const Status& put, const std::string& what);
  // Fetches and verifies the payload of a reference's text. Errors keep the
  // store's reason (blob_not_found, blob_corrupt, blob_ref_invalid,
  // blob_store_mismatch) with code BadGateway: a missing or tampered payload
  // is a failure inside the cluster, not the client's. A store that does
  // not answer in time (a timeout, a lost connection) is Unavailable
  // "blob_store_unavailable": worth another try.
  Result<std::string> Fetch(std::string_view ref_text);
  Status Delete(std::string_view ref_text);

  // Whether `ref_text` names a blob Put stored as `kind`.
  static bool IsKind(std::string_view ref_text, const std::string& kind);

  // One sweep now; returns how many blobs it removed.
  Result<size_t> SweepNow();

  BlobStore* store() const { return store_.get(); }
  const BlobOffloadOptions& options() const { return options_; }

 private:
  BlobOffload() = default;
  static std::string NewName(const std::string& kind);
  void Loop();
  void SweepLoop();
  // Deletes `ref_text`, the `attempt`-th try; schedules the next on failure.
  void RunDelete(const std::string& ref_text, int attempt);
  void CountPut(const std::string& kind, size_t bytes);

  BlobOffloadOptions options_;
  std::unique_ptr<BlobStore> store_;
  MetricsRegistry* metrics_ = nullptr;

  std::mutex mu_;  // guards tasks_, stop_
  std::condition_variable cv_;        // the task threads wait here
  // The sweeper waits on its own: a task's notify_one must never wake it
  // (it would go back to sleep and the task would wait for the next one).
  std::condition_variable sweep_cv_;
  std::deque<std::function<void()>> tasks_;
  // Deletes to try again (guarded by mu_): when, the reference, which try.
  std::multimap<std::chrono::steady_clock::time_point, std::pair<std::string, int>> delete_retries_;
  int64_t queued_bytes_ = 0;  // guarded by mu_: see max_queued_bytes
  bool stop_ = false;
  std::vector<std::thread> threads_;
  std::thread sweeper_;

  Counter* swept_ = nullptr;
  Counter* fetched_ = nullptr;
};

}  // namespace shoal
