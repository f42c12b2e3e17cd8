#include "blob/blob_offload.h"

#include <algorithm>
#include <cstring>

#include "blob/internal/codec.h"
#include "common/log.h"

namespace shoal {

Status BlobOffloadOptions::Validate() const {
  if (threshold_bytes < 0) return InvalidArgument("blob threshold must be >= 0");
  if (threads < 1) return InvalidArgument("blob offload threads must be >= 1");
  if (max_queued_bytes < 1) return InvalidArgument("blob max queued bytes must be positive");
  if (max_fetched_bytes < 1) return InvalidArgument("blob max fetched bytes must be positive");
  if (sweep_interval_ms < 0) return InvalidArgument("blob sweep interval must be >= 0");
  if (ttl_ms < 1) return InvalidArgument("blob TTL must be positive");
  return Status::Ok();
}

Result<std::unique_ptr<BlobOffload>> BlobOffload::Create(const BlobOffloadOptions& options, NatsClient* nats,
                                                         MetricsRegistry* metrics, const Clock* clock) {
  RETURN_IF_ERROR(options.Validate());
  if (options.store_url.empty()) return InvalidArgument("blob offload needs a store URL");
  auto o = std::unique_ptr<BlobOffload>(new BlobOffload());
  o->options_ = options;
  o->metrics_ = metrics;
  ASSIGN_OR_RETURN(o->store_, OpenBlobStore(options.store_url, nats, clock));
  o->swept_ = metrics->GetCounter("shoal_blob_swept_total", "Orphan blobs removed by the TTL sweep.");
  o->fetched_ = metrics->GetCounter("shoal_blob_fetched_total", "Offloaded payloads fetched from the blob store.");
  for (int i = 0; i < options.threads; ++i) o->threads_.emplace_back([p = o.get()] { p->Loop(); });
  if (options.sweep_interval_ms > 0) o->sweeper_ = std::thread([p = o.get()] { p->SweepLoop(); });
  return o;
}

BlobOffload::~BlobOffload() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  sweep_cv_.notify_all();
  for (auto& t : threads_) t.join();
  if (sweeper_.joinable()) sweeper_.join();
}

void BlobOffload::Loop() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (tasks_.empty() && !stop_) {
        if (delete_retries_.empty()) {
          cv_.wait(lock);
          continue;
        }
        const auto due = delete_retries_.begin();
        if (due->first > std::chrono::steady_clock::now()) {
          cv_.wait_until(lock, due->first);
          continue;
        }
        auto [ref_text, attempt] = std::move(due->second);
        delete_retries_.erase(due);
        tasks_.push_back([this, ref_text = std::move(ref_text), attempt = attempt] { RunDelete(ref_text, attempt); });
      }
      if (tasks_.empty()) {  // stopping, and nothing left to do
        if (!delete_retries_.empty()) {
          LOG_WARN("blob", delete_retries_.size() << " failed delete(s) not tried again; the sweep removes them");
          delete_retries_.clear();
        }
        return;
      }
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    // A task answers its request through its callback; one that throws
    // (out of memory holding a large payload) leaves that request to its
    // deadline rather than ending the process.
    try {
      task();
    } catch (const std::exception& e) {
      LOG_ERROR("blob", "blob store task failed: " << e.what());
    }
  }
}

void BlobOffload::SweepLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    sweep_cv_.wait_for(lock, std::chrono::milliseconds(options_.sweep_interval_ms), [&] { return stop_; });
    if (stop_) return;
    lock.unlock();
    try {
      auto n = SweepNow();
      if (!n.ok()) LOG_WARN("blob", "sweep failed: " << n.status().ToString());
    } catch (const std::exception& e) {
      LOG_ERROR("blob", "sweep failed: " << e.what());
    }
    lock.lock();
  }
}

Result<size_t> BlobOffload::SweepNow() {
  ASSIGN_OR_RETURN(size_t n, store_->Sweep(options_.ttl_ms));
  swept_->Inc(static_cast<int64_t>(n));
  if (n > 0) LOG_INFO("blob", "swept " << n << " orphan blob(s) older than " << options_.ttl_ms << " ms");
  return n;
}

void BlobOffload::PutAsync(std::string data, std::string kind, std::function<void(Result<BlobRef>)> done) {
  std::vector<std::string> pieces;
  pieces.push_back(std::move(data));
  PutAsync(std::move(pieces), std::move(kind), std::move(done));
}

void BlobOffload::PutAsync(std::vector<std::string> pieces, std::string kind,
                           std::function<void(Result<BlobRef>)> done) {
  int64_t bytes = 0;
  for (const auto& p : pieces) bytes += static_cast<int64_t>(p.size());
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (queued_bytes_ > 0 && queued_bytes_ + bytes > options_.max_queued_bytes) {
      const int64_t queued = queued_bytes_;
      lock.unlock();
      done(Unavailable("the blob store is behind: " + std::to_string(queued) +
                           " bytes of payloads wait to be stored; retry shortly",
                       "blob_store_busy"));
      return;
    }
    queued_bytes_ += bytes;
    tasks_.push_back([this, bytes, pieces = std::move(pieces), kind = std::move(kind), done = std::move(done)] {
      auto ref = Put(pieces, kind);
      {
        std::lock_guard<std::mutex> lock(mu_);
        queued_bytes_ -= bytes;
      }
      done(std::move(ref));
    });
  }
  cv_.notify_one();
}

void BlobOffload::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void BlobOffload::DeleteAsync(std::string ref_text) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back([this, ref_text = std::move(ref_text)] { RunDelete(ref_text, 1); });
  }
  cv_.notify_one();
}

void BlobOffload::RunDelete(const std::string& ref_text, int attempt) {
  constexpr int kTries = 5;
  Status st = Delete(ref_text);
  if (st.ok()) return;
  // A reference that cannot name a blob here will not on the next try.
  if (attempt >= kTries || st.code() == StatusCode::kInvalidArgument) {
    LOG_WARN("blob", "delete of " << ref_text << " failed (try " << attempt << "): " << st.ToString()
                                  << "; left for the sweep");
    return;
  }
  const auto delay = std::chrono::seconds(int64_t{1} << (attempt - 1));
  LOG_WARN("blob", "delete of " << ref_text << " failed: " << st.ToString() << "; trying again in " << delay.count()
                                << " s");
  {
    std::lock_guard<std::mutex> lock(mu_);
    delete_retries_.emplace(std::chrono::steady_clock::now() + delay, std::make_pair(ref_text, attempt + 1));
  }
  cv_.notify_one();
}

void BlobOffload::CountPut(const std::string& kind, size_t bytes) {
  metrics_->GetCounter("shoal_blob_offloaded_total", "Payloads moved through the blob store.", {{"kind", kind}})->Inc();
  metrics_->GetCounter("shoal_blob_offloaded_bytes_total", "Bytes moved through the blob store.", {{"kind", kind}})
      ->Inc(static_cast<int64_t>(bytes));
}

std::string BlobOffload::NewName(const std::string& kind) { return kind + "-" + blob_internal::RandomId(); }

bool BlobOffload::IsKind(std::string_view ref_text, const std::string& kind) {
  auto ref = ParseBlobRef(ref_text);
  return ref.ok() && ref->name.size() > kind.size() && ref->name.compare(0, kind.size(), kind) == 0 &&
         ref->name[kind.size()] == '-';
}

Result<BlobRef> BlobOffload::Put(std::string_view data, const std::string& kind) {
  auto ref = store_->Put(data, NewName(kind), /*fresh_name=*/true);
  if (ref.ok()) CountPut(kind, data.size());
  return ref;
}

Result<BlobRef> BlobOffload::Put(const std::vector<std::string>& pieces, const std::string& kind) {
  size_t total = 0;
  for (const auto& p : pieces) total += p.size();
  size_t piece = 0, offset = 0;
  auto ref = store_->PutFrom([&](char* buffer, size_t capacity) -> Result<size_t> {
    size_t n = 0;
    while (n < capacity && piece < pieces.size()) {
      const std::string& p = pieces[piece];
      const size_t take = std::min(capacity - n, p.size() - offset);
      std::memcpy(buffer + n, p.data() + offset, take);
      n += take;
      offset += take;
      if (offset == p.size()) {
        ++piece;
        offset = 0;
      }
    }
    return n;
  }, NewName(kind), /*fresh_name=*/true);
  if (ref.ok()) CountPut(kind, total);
  return ref;
}

Status BlobOffload::PutFailure(const Status& put, const std::string& what) {
  if (put.code() == StatusCode::kResourceExhausted)
    return ResourceExhausted("cannot store " + what + ": " + put.message(),
                             put.reason().empty() ? std::string(kBlobStoreFull) : put.reason());
  return Unavailable("cannot store " + what + ": " + put.message(),
                     put.reason() == "blob_store_busy" ? put.reason() : "blob_store_unavailable");
}

Result<std::string> BlobOffload::Fetch(std::string_view ref_text) {
  auto ref = ParseBlobRef(ref_text);
  if (!ref.ok()) return Status(StatusCode::kBadGateway, "payload reference: " + ref.status().message(), ref.status().reason());
  auto data = store_->Get(*ref);
  if (!data.ok()) {
    const Status& st = data.status();
    // What the payload or its reference is (absent, damaged, another
    // store's) is final: 502 with the store's reason. Anything else (no
    // answer in time, a leaderless stream, a read error) says nothing about
    // the payload: the next try may get it.
    const bool about_the_blob = st.code() == StatusCode::kNotFound || st.reason() == kBlobNotFound ||
                                st.reason() == kBlobCorrupt || st.reason() == kBlobRefInvalid ||
                                st.reason() == kBlobStoreMismatch;
    if (!about_the_blob)
      return Unavailable("the blob store did not deliver offloaded payload " + ref->name + ": " + st.message(),
                         "blob_store_unavailable");
    return Status(StatusCode::kBadGateway, "offloaded payload " + ref->name + ": " + st.message(),
                  st.reason().empty() ? std::string(kBlobNotFound) : st.reason());
  }
  fetched_->Inc();
  return data;
}

Status BlobOffload::Delete(std::string_view ref_text) {
  ASSIGN_OR_RETURN(BlobRef ref, ParseBlobRef(ref_text));
  // Another store's reference names nothing here: a blob of this store
  // that happens to have the same name is not its to delete.
  RETURN_IF_ERROR(store_->CheckRef(ref));
  return store_->Delete(ref.name);
}

}  // namespace shoal
