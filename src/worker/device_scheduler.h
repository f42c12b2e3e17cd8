// DeviceScheduler: shares one device (a CPU or a GPU) among the models a
// worker serves. Each model's executor takes a Turn before every forward
// pass, so at most `slots` passes run at once, and a free slot goes to the
// oldest waiting work, weighted by backlog, so a hot model cannot starve a
// cold one. Thread-safe; it has no threads of its own.
//
// Policy: when a slot frees up, it goes to the waiter with the highest
//   priority = age_us * (1 + backlog_weight * log2(1 + backlog)),
// age_us = now - oldest_enqueued_mono_us (clamped at 0), computed with the
// clock's time at the moment of the grant; ties go to the earliest waiter.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace shoal {

struct DeviceSchedulerOptions {
  int slots = 1;  // forward passes at once on this device
  // weight = 1 + backlog_weight * log2(1 + backlog); priority = age_us * weight
  double backlog_weight = 1.0;

  Status Validate() const;  // slots >= 1, backlog_weight >= 0
};

class DeviceScheduler {
 public:
  // The right to run one forward pass. RAII: releases its slot in the
  // destructor or in Release(); movable, not copyable; empty (!valid()) when
  // default-constructed, moved from or released. Not thread-safe itself
  // (one owner). Must be released before its scheduler is destroyed.
  class Turn {
   public:
    Turn() = default;
    Turn(Turn&& other) noexcept;
    Turn& operator=(Turn&& other) noexcept;  // releases the turn it held
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    ~Turn() { Release(); }

    bool valid() const { return scheduler_ != nullptr; }
    // Gives the slot back (and grants it to the next waiter). Idempotent.
    void Release();

   private:
    friend class DeviceScheduler;
    explicit Turn(DeviceScheduler* scheduler) : scheduler_(scheduler) {}
    DeviceScheduler* scheduler_ = nullptr;
  };

  // `options` should pass Validate(); out-of-range values are clamped
  // (slots to >= 1, backlog_weight to >= 0). `clock` is not owned and must
  // outlive the scheduler; null means SystemClock::Get().
  DeviceScheduler(DeviceSchedulerOptions options, const Clock* clock);
  DeviceScheduler(const DeviceScheduler&) = delete;
  DeviceScheduler& operator=(const DeviceScheduler&) = delete;

  // Blocks until this caller may run one forward pass; no time limit of its
  // own. `oldest_enqueued_mono_us`: the clock's NowMonoUs() at which the
  // oldest row of the batch about to run started waiting; `backlog`: how much
  // more work this model has waiting (messages; negative counts as 0).
  // A caller that finds a slot free and nobody waiting gets it at once.
  // Errors: Unavailable "shutting_down" once Shutdown() was called (waiters
  // are woken); Unavailable "cancelled" when `cancel` (may be null; not
  // owned, must outlive the call) is or becomes true, polled at least every
  // 20 ms of real time. A slot granted to a caller that is cancelled before
  // it wakes is handed on to the next waiter.
  Result<Turn> Acquire(const std::string& model, int64_t oldest_enqueued_mono_us, int64_t backlog,
                       const std::atomic<bool>* cancel = nullptr);

  // Makes every waiting and later Acquire() fail with "shutting_down".
  // Turns already held stay valid until released. Idempotent; non-blocking.
  void Shutdown();

  // Slots held now, including ones granted to a waiter that has not woken yet.
  int running() const;
  // Callers blocked in Acquire() that have not been granted a slot yet.
  int waiting() const;
  // Turns handed out to `model` so far (a grant handed back does not count).
  uint64_t turns_granted(const std::string& model) const;

 private:
  friend class DeviceSchedulerTestPeer;

  // One blocked Acquire() call; lives on that caller's stack. All fields are
  // guarded by mu_.
  struct Waiter {
    double weight = 1.0;              // 1 + backlog_weight * log2(1 + backlog)
    int64_t oldest_enqueued_mono_us = 0;
    bool granted = false;             // a slot is counted in running_ for it
    std::condition_variable cv;       // notified on grant and on Shutdown()
  };

  void ReleaseSlot();
  // Frees one slot and grants free slots to the best waiters. Requires mu_.
  void ReleaseSlotLocked();
  // Grants free slots to the highest-priority waiters and wakes them.
  // Requires mu_ (waiters are notified under it: their records live on
  // their stacks and may vanish once the lock is dropped).
  void GrantLocked();

  const int slots_;
  const double backlog_weight_;
  const Clock* const clock_;

  mutable std::mutex mu_;
  int running_ = 0;                 // guarded by mu_
  bool shutdown_ = false;           // guarded by mu_
  std::vector<Waiter*> waiters_;    // guarded by mu_; not yet granted, arrival order
  uint64_t handed_back_ = 0;        // guarded by mu_; grants returned by cancelled waiters
  std::map<std::string, uint64_t, std::less<>> turns_granted_;  // guarded by mu_
};

}  // namespace shoal
