// DeviceScheduler: shares one device (a CPU or a GPU) among the models a
// worker serves. Each model's executor takes a Turn before every forward
// pass; the passes running at once hold at most `slots` slots between them,
// and free slots go to the oldest waiting work, weighted by backlog, so a
// hot model cannot starve a cold one. Thread-safe; it has no threads of its
// own.
//
// Policy: when a slot frees up, it goes to the waiter with the highest
//   priority = age_us * (1 + backlog_weight * log2(1 + backlog)),
// age_us = now - oldest_enqueued_mono_us (clamped at 0), computed with the
// clock's time at the moment of the grant; ties go to the earliest waiter.
// The weight may let younger work overtake the oldest waiter, but at most
// `max_overtakes` times in a row; then the oldest goes next. Without that
// bound, work of a cold model could wait for ever behind a hot model in
// overload: the hot model's oldest work ages as fast as the cold one's, and
// its backlog weight (about 11 at a backlog of 1000) keeps it ahead.
// A waiter whose width does not fit in the free slots blocks the ones behind
// it (no overtaking, so a wide pass is not starved).
//
// Width: a pass asks for between `min` and `max` slots (PassWidth). It gets
// `max` when it finds the device idle (nothing running, nobody waiting) and
// `min` otherwise, including every pass that had to wait. On a CPU with one
// slot per core, a model that runs alone can use every core, while models
// that compete run side by side on one core each instead of taking turns on
// all of them. A waiter gets `min` even when it ends up alone: granting it
// `max` would make the model it waited for wait in turn, and two busy models
// would alternate wide passes (one at a time on every core) instead of
// settling side by side.
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
  int slots = 1;  // shared by the passes running at once (cores on a CPU)
  // weight = 1 + backlog_weight * log2(1 + backlog); priority = age_us * weight
  double backlog_weight = 1.0;
  // Grants in a row that may go past the oldest waiter (0: oldest first).
  int max_overtakes = 4;

  Status Validate() const;  // slots >= 1, backlog_weight >= 0, max_overtakes >= 0
};

// Slots one pass asks for: `max` when it finds the device idle, else `min`.
// Clamped to [1, slots] by Acquire; a max below min counts as min.
struct PassWidth {
  int min = 1;
  int max = 1;
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
    // Slots this turn holds (0 when !valid()).
    int width() const { return scheduler_ != nullptr ? width_ : 0; }
    // Gives the slot back (and grants it to the next waiter). Idempotent.
    void Release();

   private:
    friend class DeviceScheduler;
    Turn(DeviceScheduler* scheduler, int width) : scheduler_(scheduler), width_(width) {}
    DeviceScheduler* scheduler_ = nullptr;
    int width_ = 0;
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
  // A caller that finds `width.min` slots free and nobody waiting gets its
  // turn at once (see PassWidth for how wide).
  // Errors: Unavailable "shutting_down" once Shutdown() was called (waiters
  // are woken); Unavailable "cancelled" when `cancel` (may be null; not
  // owned, must outlive the call) is or becomes true, polled at least every
  // 20 ms of real time. A slot granted to a caller that is cancelled before
  // it wakes is handed on to the next waiter.
  Result<Turn> Acquire(const std::string& model, int64_t oldest_enqueued_mono_us, int64_t backlog,
                       const std::atomic<bool>* cancel = nullptr, PassWidth width = {});

  // Makes every waiting and later Acquire() fail with "shutting_down".
  // Turns already held stay valid until released. Idempotent; non-blocking.
  void Shutdown();
  // Whether Shutdown() was called: no pass will run again.
  bool shut_down() const;

  int slots() const { return slots_; }
  // Slots held now, including ones granted to a waiter that has not woken yet.
  int running() const;
  // Callers blocked in Acquire() that have not been granted a slot yet.
  int waiting() const;
  // Turns handed out to `model` so far (a grant handed back does not count).
  uint64_t turns_granted(const std::string& model) const;
  // The same, all models together.
  uint64_t turns_granted() const;

 private:
  friend class DeviceSchedulerTestPeer;

  // One blocked Acquire() call; lives on that caller's stack. All fields are
  // guarded by mu_.
  struct Waiter {
    double weight = 1.0;              // 1 + backlog_weight * log2(1 + backlog)
    int width = 1;                    // slots it gets: its PassWidth::min
    int64_t oldest_enqueued_mono_us = 0;
    int overtaken = 0;                // grants to younger work while it was the oldest
    bool granted = false;             // a slot is counted in running_ for it
    std::condition_variable cv;       // notified on grant and on Shutdown()
  };

  void ReleaseSlots(int width);
  // Frees `width` slots and grants free slots to the best waiters. Requires mu_.
  void ReleaseSlotsLocked(int width);
  // Grants free slots to the highest-priority waiters and wakes them.
  // Requires mu_ (waiters are notified under it: their records live on
  // their stacks and may vanish once the lock is dropped).
  void GrantLocked();

  const int slots_;
  const double backlog_weight_;
  const int max_overtakes_;
  const Clock* const clock_;

  mutable std::mutex mu_;
  int running_ = 0;                 // guarded by mu_; slots held
  bool shutdown_ = false;           // guarded by mu_
  std::vector<Waiter*> waiters_;    // guarded by mu_; not yet granted, arrival order
  uint64_t handed_back_ = 0;        // guarded by mu_; grants returned by cancelled waiters
  std::map<std::string, uint64_t, std::less<>> turns_granted_;  // guarded by mu_
  // Written under mu_, read without it (fetchers poll it while they wait
  // for room).
  std::atomic<uint64_t> turns_granted_total_{0};
};

}  // namespace shoal
