#include "worker/pull_gate.h"

#include <algorithm>
#include <chrono>

namespace shoal {

int PullGate::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

int PullGate::queued_waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_waiting_;
}

bool PullGate::WaitForRoom(int64_t wait_ms, const std::atomic<bool>* stop, Puller puller) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, wait_ms));
  bool counted = false;  // this call is one of queued_waiting_
  bool room = false;
  while (!shutdown_ && !(stop != nullptr && stop->load())) {
    if (!bounded() || held_ < limit_ || (puller == Puller::kHolder && queued_waiting_ == 0)) {
      room = true;
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    if (puller == Puller::kQueued && !counted) {
      counted = true;
      ++queued_waiting_;
    }
    room_cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(20)));
  }
  // No wake-up for holders: when this call found room, they have it too
  // (Release woke them), and otherwise they see the count within 20 ms.
  if (counted) --queued_waiting_;
  return room;
}

void PullGate::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  ++held_;
}

void PullGate::Release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (held_ > 0) --held_;
  }
  room_cv_.notify_all();
}

void PullGate::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  room_cv_.notify_all();
}

}  // namespace shoal
