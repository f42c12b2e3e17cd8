// ByteBudget: bytes held in memory by several threads at once, under one
// limit (a worker's offloaded payloads fetched from the blob store, all
// models together). Bytes are taken before they are held and given back by
// a Hold when the holder is done with them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "common/metrics.h"

namespace shoal {

class ByteBudget {
 public:
  // limit <= 0: unbounded. `gauge` (may be null; outlives the budget)
  // shows the bytes held.
  explicit ByteBudget(int64_t limit = 0, Gauge* gauge = nullptr) : limit_(limit), gauge_(gauge) {}
  ByteBudget(const ByteBudget&) = delete;
  ByteBudget& operator=(const ByteBudget&) = delete;

  int64_t limit() const { return limit_; }
  int64_t held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

  // Gives its bytes back when destroyed (or on Reset). Movable.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) { o.budget_ = nullptr; }
    Hold& operator=(Hold&& o) noexcept {
      if (this != &o) {
        Reset();
        budget_ = o.budget_;
        bytes_ = o.bytes_;
        o.budget_ = nullptr;
      }
      return *this;
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { Reset(); }
    void Reset() {
      if (budget_ != nullptr) budget_->Give(bytes_);
      budget_ = nullptr;
    }
    bool held() const { return budget_ != nullptr; }

   private:
    friend class ByteBudget;
    Hold(ByteBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
    ByteBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // Takes `bytes` when they fit beside what is held, or when nothing is
  // held (one payload larger than the limit still goes, alone), waiting up
  // to `wait_ms` for room. An empty Hold when there is none yet.
  Hold Take(int64_t bytes, int64_t wait_ms = 0) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto fits = [&] { return limit_ <= 0 || held_ == 0 || held_ + bytes <= limit_; };
    if (!cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), fits)) return Hold();
    held_ += bytes;
    if (gauge_ != nullptr) gauge_->Set(static_cast<double>(held_));
    return Hold(this, bytes);
  }

 private:
  void Give(int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ -= bytes;
      if (gauge_ != nullptr) gauge_->Set(static_cast<double>(held_));
    }
    cv_.notify_all();
  }

  const int64_t limit_;
  Gauge* const gauge_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t held_ = 0;  // guarded by mu_
};

}  // namespace shoal
