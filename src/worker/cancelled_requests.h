// The requests whose callers went away (a streamed answer whose client
// disconnected), as gateways announce them on wire::kCancelSubject: a
// runtime that can stop part-way stops their work. Remembered for a while,
// so work still queued when the notice came is not started either; bounded,
// so a flood of notices cannot grow it. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace shoal {

class CancelledRequests {
 public:
  static constexpr size_t kMaxRemembered = 65536;
  static constexpr size_t kMaxIdBytes = 256;  // longer notices are not request ids (Worker::OnCancel)
  static constexpr int64_t kRememberUs = 10LL * 60 * 1000 * 1000;  // longer than any request's deadline

  void Add(std::string_view request_id, int64_t now_mono_us) {
    if (request_id.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    ForgetOldLocked(now_mono_us);
    if (!until_.emplace(std::string(request_id), now_mono_us + kRememberUs).second) return;
    order_.emplace_back(std::string(request_id), now_mono_us + kRememberUs);
    if (order_.size() > kMaxRemembered) {
      until_.erase(order_.front().first);
      order_.pop_front();
    }
  }
  bool Contains(const std::string& request_id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return until_.count(request_id) > 0;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return until_.size();
  }

 private:
  void ForgetOldLocked(int64_t now_mono_us) {
    while (!order_.empty() && order_.front().second <= now_mono_us) {
      until_.erase(order_.front().first);
      order_.pop_front();
    }
  }

  mutable std::mutex mu_;
  std::unordered_map<std::string, int64_t> until_;      // guarded by mu_
  std::deque<std::pair<std::string, int64_t>> order_;  // guarded by mu_; oldest first
};

}  // namespace shoal
