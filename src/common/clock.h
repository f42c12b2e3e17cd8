// Clock: the time source injected into batching and deadline logic so tests
// can drive time by hand (FakeClock) instead of sleeping.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace shoal {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic microseconds, for intervals.
  virtual int64_t NowMonoUs() const = 0;
  // Wall-clock milliseconds since the Unix epoch, for deadlines that cross
  // processes and machines.
  virtual int64_t NowUnixMs() const = 0;
};

class SystemClock final : public Clock {
 public:
  int64_t NowMonoUs() const override {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  int64_t NowUnixMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch()).count();
  }
  static SystemClock* Get() {
    static SystemClock clock;
    return &clock;
  }
};

// Manually advanced clock for tests. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(int64_t start_unix_ms = 1'700'000'000'000) : unix_ms_(start_unix_ms) {}
  int64_t NowMonoUs() const override { return mono_us_.load(); }
  int64_t NowUnixMs() const override { return unix_ms_.load() + mono_us_.load() / 1000; }
  void AdvanceUs(int64_t us) { mono_us_ += us; }
  // A step of the wall clock alone (NTP, a resumed VM): monotonic time goes on.
  void StepWallMs(int64_t ms) { unix_ms_ += ms; }

 private:
  std::atomic<int64_t> mono_us_{0};
  std::atomic<int64_t> unix_ms_;
};

}  // namespace shoal
