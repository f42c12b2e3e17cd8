// ByteBudget: bytes held in memory by several threads at once, under one
// limit (a worker's offloaded payloads fetched from the blob store, all
// models together). Bytes are taken before they are held and given back by
// a Hold when the holder is done with them. Takes that find no room queue,
// first come first served (a Ticket keeps the place): a large take is not
// starved by smaller ones that keep fitting beside what is held.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>

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

  // A place in the queue of takes waiting for room; leaves it when
  // destroyed (the taker gave up). Movable.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& o) noexcept : budget_(o.budget_), id_(o.id_) { o.budget_ = nullptr; }
    Ticket& operator=(Ticket&& o) noexcept {
      if (this != &o) {
        Leave();
        budget_ = o.budget_;
        id_ = o.id_;
        o.budget_ = nullptr;
      }
      return *this;
    }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { Leave(); }
    bool waiting() const { return budget_ != nullptr; }

   private:
    friend class ByteBudget;
    void Leave() {
      if (budget_ != nullptr) budget_->Leave(id_);
      budget_ = nullptr;
    }
    ByteBudget* budget_ = nullptr;
    uint64_t id_ = 0;
  };

  // Takes `bytes` when they fit beside what is held, or when nothing is
  // held (one payload larger than the limit still goes, alone), and no
  // earlier take waits; waits up to `wait_ms` for that. An empty Hold when
  // not yet: `ticket` (may be null: then none is kept) then holds this
  // take's place in the queue for the next try with it.
  Hold Take(int64_t bytes, int64_t wait_ms = 0, Ticket* ticket = nullptr) {
    // A place in another budget's line is given up first (not under this
    // budget's lock: the other's is taken).
    if (ticket != nullptr && ticket->budget_ != nullptr && ticket->budget_ != this) ticket->Leave();
    std::unique_lock<std::mutex> lock(mu_);
    const auto ours = [&] { return ticket != nullptr && ticket->budget_ == this ? ticket->id_ : uint64_t{0}; };
    const auto fits = [&] {
      const bool first = waiting_.empty() || *waiting_.begin() == ours();
      return first && (limit_ <= 0 || held_ == 0 || held_ + bytes <= limit_);
    };
    if (!fits()) {
      if (ticket != nullptr && ours() == 0) {
        ticket->budget_ = this;
        ticket->id_ = next_ticket_++;
        waiting_.insert(ticket->id_);
      }
      if (!cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), fits)) return Hold();
    }
    if (const uint64_t id = ours(); id != 0) {
      waiting_.erase(id);
      ticket->budget_ = nullptr;
      cv_.notify_all();  // the next in line may fit too
    }
    held_ += bytes;
    if (gauge_ != nullptr) gauge_->Set(static_cast<double>(held_));
    return Hold(this, bytes);
  }

 private:
  void Leave(uint64_t id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_.erase(id);
    }
    cv_.notify_all();
  }
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
  uint64_t next_ticket_ = 1;     // guarded by mu_
  std::set<uint64_t> waiting_;   // guarded by mu_: tickets of waiting takes, oldest first
};

}  // namespace shoal
