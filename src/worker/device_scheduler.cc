#include "worker/device_scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

namespace shoal {

namespace {

// Real-time bound on how late a waiter notices its cancel flag: nobody
// notifies the scheduler when a flag flips.
constexpr auto kCancelPoll = std::chrono::milliseconds(20);

}  // namespace

Status DeviceSchedulerOptions::Validate() const {
  if (slots < 1) return InvalidArgument("slots must be >= 1");
  if (!(backlog_weight >= 0)) return InvalidArgument("backlog_weight must be >= 0");
  if (max_overtakes < 0) return InvalidArgument("max_overtakes must be >= 0");
  return Status::Ok();
}

DeviceScheduler::Turn::Turn(Turn&& other) noexcept
    : scheduler_(std::exchange(other.scheduler_, nullptr)), width_(other.width_) {}

DeviceScheduler::Turn& DeviceScheduler::Turn::operator=(Turn&& other) noexcept {
  if (this != &other) {
    Release();
    scheduler_ = std::exchange(other.scheduler_, nullptr);
    width_ = other.width_;
  }
  return *this;
}

void DeviceScheduler::Turn::Release() {
  if (DeviceScheduler* s = std::exchange(scheduler_, nullptr)) s->ReleaseSlots(width_);
}

DeviceScheduler::DeviceScheduler(DeviceSchedulerOptions options, const Clock* clock)
    : slots_(std::max(1, options.slots)),
      backlog_weight_(options.backlog_weight >= 0 ? options.backlog_weight : 0.0),
      max_overtakes_(std::max(0, options.max_overtakes)),
      clock_(clock != nullptr ? clock : SystemClock::Get()) {}

Result<DeviceScheduler::Turn> DeviceScheduler::Acquire(const std::string& model,
                                                       int64_t oldest_enqueued_mono_us,
                                                       int64_t backlog,
                                                       const std::atomic<bool>* cancel,
                                                       PassWidth width) {
  auto cancelled = [cancel] { return cancel != nullptr && cancel->load(); };
  const int min_width = std::clamp(width.min, 1, slots_);
  const int max_width = std::clamp(width.max, min_width, slots_);
  auto grant = [&](int w) -> Turn {
    auto it = turns_granted_.find(model);
    if (it == turns_granted_.end()) it = turns_granted_.emplace(model, 0).first;
    ++it->second;
    turns_granted_total_.fetch_add(1, std::memory_order_relaxed);
    return Turn(this, w);
  };

  std::unique_lock<std::mutex> lock(mu_);
  if (shutdown_) return Unavailable("device scheduler is shutting down", "shutting_down");
  if (cancelled()) return Unavailable("cancelled while waiting for the device", "cancelled");
  if (waiters_.empty() && running_ + min_width <= slots_) {
    const int w = running_ == 0 ? max_width : min_width;
    running_ += w;
    return grant(w);
  }

  Waiter self;
  self.width = min_width;
  self.weight =
      1.0 + backlog_weight_ * std::log2(1.0 + static_cast<double>(std::max<int64_t>(0, backlog)));
  self.oldest_enqueued_mono_us = oldest_enqueued_mono_us;
  waiters_.push_back(&self);
  // Normally a no-op (slots are handed over at release), but keeps the
  // invariant "free slots are held back only for a best waiter that does not
  // fit in them" whatever happened before.
  GrantLocked();

  while (true) {
    if (shutdown_ || cancelled()) {
      if (self.granted) {
        // Granted while we were being cancelled: the slot is ours to give
        // back, or it would leak.
        ++handed_back_;
        ReleaseSlotsLocked(self.width);
      } else {
        waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &self));
        // A wide waiter at the head may have held back narrower ones that
        // fit in the free slots.
        GrantLocked();
      }
      if (shutdown_) return Unavailable("device scheduler is shutting down", "shutting_down");
      return Unavailable("cancelled while waiting for the device", "cancelled");
    }
    if (self.granted) return grant(self.width);
    if (cancel != nullptr) {
      self.cv.wait_for(lock, kCancelPoll);
    } else {
      self.cv.wait(lock);
    }
  }
}

void DeviceScheduler::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutdown_ = true;
  for (Waiter* w : waiters_) w->cv.notify_one();
}

bool DeviceScheduler::shut_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_;
}

int DeviceScheduler::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

int DeviceScheduler::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(waiters_.size());
}

uint64_t DeviceScheduler::turns_granted(const std::string& model) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = turns_granted_.find(model);
  return it == turns_granted_.end() ? 0 : it->second;
}

uint64_t DeviceScheduler::turns_granted() const { return turns_granted_total_.load(std::memory_order_relaxed); }

void DeviceScheduler::ReleaseSlots(int width) {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseSlotsLocked(width);
}

void DeviceScheduler::ReleaseSlotsLocked(int width) {
  running_ -= width;
  GrantLocked();
}

void DeviceScheduler::GrantLocked() {
  // After Shutdown() every waiter is leaving with an error; granting would
  // only make it hand the slot back.
  if (shutdown_) return;
  while (running_ < slots_ && !waiters_.empty()) {
    const double now = static_cast<double>(clock_->NowMonoUs());
    size_t best = 0, oldest = 0;
    double best_priority = -1;
    for (size_t i = 0; i < waiters_.size(); ++i) {
      const Waiter& w = *waiters_[i];
      const double age_us =
          std::max(0.0, now - static_cast<double>(w.oldest_enqueued_mono_us));
      const double priority = age_us * w.weight;
      // Strictly greater / less: on a tie the earlier arrival (lower index)
      // keeps it.
      if (priority > best_priority) {
        best = i;
        best_priority = priority;
      }
      if (w.oldest_enqueued_mono_us < waiters_[oldest]->oldest_enqueued_mono_us) oldest = i;
    }
    if (best != oldest && waiters_[oldest]->overtaken >= max_overtakes_) best = oldest;
    Waiter* w = waiters_[best];
    // The best waiter waits for room rather than being overtaken by
    // narrower ones behind it.
    if (running_ + w->width > slots_) return;
    if (best != oldest) ++waiters_[oldest]->overtaken;
    waiters_.erase(waiters_.begin() + static_cast<std::ptrdiff_t>(best));
    w->granted = true;
    running_ += w->width;
    w->cv.notify_one();
  }
}

}  // namespace shoal
