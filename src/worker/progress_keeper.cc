#include "worker/progress_keeper.h"

#include <chrono>

#include "queue/nats_client.h"

namespace shoal {

ProgressKeeper::ProgressKeeper(NatsClient* client, int64_t interval_ms)
    : client_(client), interval_ms_(interval_ms < 1 ? 1 : interval_ms), thread_([this] { Loop(); }) {}

ProgressKeeper::~ProgressKeeper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

ProgressKeeper::Watch::~Watch() {
  if (keeper_ != nullptr) keeper_->Stop(id_);
}

ProgressKeeper::Watch& ProgressKeeper::Watch::operator=(Watch&& o) noexcept {
  if (this != &o) {
    if (keeper_ != nullptr) keeper_->Stop(id_);
    keeper_ = o.keeper_;
    id_ = o.id_;
    o.keeper_ = nullptr;
  }
  return *this;
}

ProgressKeeper::Watch ProgressKeeper::Start(std::vector<std::string> ack_subjects) {
  std::erase_if(ack_subjects, [](const std::string& s) { return s.empty(); });
  if (ack_subjects.empty()) return Watch();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  watched_.emplace(id, std::move(ack_subjects));
  return Watch(this, id);
}

void ProgressKeeper::Watch::Finish() {
  if (keeper_ == nullptr) return;
  keeper_->Stop(id_);
  // A round that copied its subjects before they were dropped may be
  // sending their notes now: wait for that round to end.
  std::lock_guard<std::mutex> published(keeper_->publish_mu_);
  keeper_ = nullptr;
}

void ProgressKeeper::Stop(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  watched_.erase(id);
}

uint64_t ProgressKeeper::notes_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return notes_sent_;
}

void ProgressKeeper::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  // A watch is noted only once it has lived a whole interval: short
  // batches, the usual case, cost nothing.
  std::map<uint64_t, bool> seen;
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(interval_ms_), [this] { return stop_; });
    if (stop_) break;
    std::map<uint64_t, bool> now_seen;
    std::vector<std::string> due;
    for (const auto& [id, subjects] : watched_) {
      now_seen[id] = true;
      if (seen.count(id)) due.insert(due.end(), subjects.begin(), subjects.end());
    }
    seen = std::move(now_seen);
    if (due.empty()) continue;
    lock.unlock();
    uint64_t sent = 0;
    {
      std::lock_guard<std::mutex> publishing(publish_mu_);
      for (const auto& subject : due)
        if (client_->Publish(subject, "+WPI").ok()) ++sent;
    }
    lock.lock();
    notes_sent_ += sent;
  }
}

}  // namespace shoal
