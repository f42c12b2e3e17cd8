#include "worker/consumer_park.h"

#include <algorithm>
#include <vector>

#include "common/log.h"
#include "worker/model_server.h"

namespace shoal {

ConsumerPark::ConsumerPark(ConsumerParkOptions options) : o_(std::move(options)) {
  closer_ = std::thread([this] { Loop(); });
}

ConsumerPark::~ConsumerPark() { CloseAll(); }

void ConsumerPark::Park(const std::string& model, std::unique_ptr<PullConsumer> consumer, int64_t hand_pull_left_ms) {
  if (!consumer) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      const int64_t left = std::max<int64_t>({0, hand_pull_left_ms, consumer->PullLeftMs()});
      const auto at = std::chrono::steady_clock::now() + std::chrono::milliseconds(left + o_.margin_ms);
      parked_.emplace(model, Entry{std::move(consumer), at});
      cv_.notify_all();
      return;
    }
  }
  // Closed for good already (the worker is gone from the queue's point of
  // view): close it now.
  Close(model, *consumer);
}

std::unique_ptr<PullConsumer> ConsumerPark::Take(const std::string& model) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = parked_.find(model);
  if (it == parked_.end()) return nullptr;
  auto consumer = std::move(it->second.consumer);
  parked_.erase(it);
  return consumer;
}

size_t ConsumerPark::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return parked_.size();
}

void ConsumerPark::CloseAll() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return parked_.empty(); });
    stop_ = true;
    cv_.notify_all();
  }
  if (closer_.joinable()) closer_.join();
}

void ConsumerPark::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (parked_.empty()) {
      cv_.notify_all();  // CloseAll waits for this
      cv_.wait(lock, [this] { return stop_ || !parked_.empty(); });
      continue;
    }
    auto next = std::min_element(parked_.begin(), parked_.end(),
                                 [](const auto& a, const auto& b) { return a.second.close_at < b.second.close_at; });
    if (std::chrono::steady_clock::now() < next->second.close_at) {
      const TimePoint at = next->second.close_at;
      cv_.wait_until(lock, at);  // a park, take or stop wakes it early
      continue;
    }
    const std::string model = next->first;
    auto consumer = std::move(next->second.consumer);
    parked_.erase(next);
    lock.unlock();
    Close(model, *consumer);
    consumer.reset();
    lock.lock();
  }
}

void ConsumerPark::Close(const std::string& model, PullConsumer& consumer) {
  consumer.Interrupt();
  std::vector<Delivery> held = consumer.TakeQueued(1000);
  if (held.empty()) return;
  Counter* handed_back = o_.metrics ? HandedBackCounter(*o_.metrics, model) : nullptr;
  for (Delivery& d : held) {
    auto headers = WorkHeadersOrSettle(d, o_.client, o_.worker_id);
    if (!headers) continue;
    if (static_cast<int64_t>(d.NumDelivered()) >= o_.max_deliver) {
      if (o_.client) PublishErrorReply(*o_.client, *headers, WorkerStopping(), o_.worker_id);
      (void)d.Term();
      continue;
    }
    (void)d.Nak();
    if (handed_back) handed_back->Inc();
  }
  LOG_DEBUG("worker", "closed the parked subscription of " << model << ", handed back " << held.size());
}

}  // namespace shoal
