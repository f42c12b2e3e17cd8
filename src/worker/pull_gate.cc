#include "worker/pull_gate.h"

#include <algorithm>
#include <chrono>

namespace shoal {

int PullGate::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

bool PullGate::WaitForRoom(int64_t wait_ms, const std::atomic<bool>* stop, Puller puller) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, wait_ms));
  const int room = puller == Puller::kStarved ? limit_ + 1 : limit_;
  while (!shutdown_ && !(stop != nullptr && stop->load())) {
    if (!bounded() || puller == Puller::kHolder || held_ < room) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    room_cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(20)));
  }
  return false;
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
