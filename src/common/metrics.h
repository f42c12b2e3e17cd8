// Metrics: counters, gauges and histograms rendered as Prometheus text.
// Lookup by (name, labels) takes a mutex once; keep the returned pointer and
// update it lock-free on the hot path. Pointers live as long as the registry.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shoal {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Inc(int64_t v = 1) { value_.fetch_add(v, std::memory_order_relaxed); }
  int64_t Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);
  int64_t Count() const { return count_.load(std::memory_order_relaxed); }
  double Sum() const { return sum_.load(std::memory_order_relaxed); }
  const std::vector<double>& bounds() const { return bounds_; }
  // Non-cumulative count of bucket i (i == bounds().size() is +Inf).
  int64_t BucketCount(size_t i) const { return buckets_[i].load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<int64_t>[]> buckets_;
  std::atomic<int64_t> count_{0};
  std::atomic<double> sum_{0};
};

// Latency buckets in seconds, 0.5 ms .. 30 s.
std::vector<double> LatencyBuckets();
// Power-of-two buckets 1 .. 1024, for batch sizes and token counts.
std::vector<double> SizeBuckets();

class MetricsRegistry;

// Whether an error code is one of those operations.md tells operators to
// watch: it keeps its own series however many other codes came first.
bool ErrorCodeKeepsOwnSeries(std::string_view code);

// Counters of one family labelled by error code, where codes come from
// outside (a runtime's or an upstream's own strings): past `max_codes`
// distinct codes a new one counts as code="other", except those
// ErrorCodeKeepsOwnSeries names, so a stream of made-up codes cannot grow
// the page without bound. Thread-safe; each code's counter is made once.
// Get one from MetricsRegistry::GetErrorCodeCounters, so that everything
// counting one family with the same labels (a model loaded again) shares
// its bound.
class ErrorCodeCounters {
 public:
  static constexpr size_t kDefaultMaxCodes = 128;
  ErrorCodeCounters(MetricsRegistry* metrics, std::string name, std::string help, Labels labels = {},
                    size_t max_codes = kDefaultMaxCodes);
  Counter* Get(std::string_view code);

 private:
  MetricsRegistry* const metrics_;
  const std::string name_, help_;
  const Labels labels_;
  const size_t max_codes_;
  std::mutex mu_;
  std::map<std::string, Counter*, std::less<>> by_code_;  // guarded by mu_
  Counter* other_ = nullptr;                              // guarded by mu_
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  // A view of `parent` that adds `const_labels` before the labels of every
  // metric it hands out, and renders the parent's page: several workers in
  // one process (`shoal worker --sim-workers`) each get their own series.
  MetricsRegistry(MetricsRegistry* parent, Labels const_labels);
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  Counter* GetCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram* GetHistogram(const std::string& name, const std::string& help, const Labels& labels,
                          std::vector<double> bounds);
  // The bounded error-code counters of `name` with `labels` (plus a "code"
  // label), made on first use and the same object after.
  ErrorCodeCounters* GetErrorCodeCounters(const std::string& name, const std::string& help, const Labels& labels = {});
  // Called on every render, before the text is produced; use it to refresh
  // gauges that are sampled (queue depth, workers alive).
  void AddRefresher(std::function<void()> fn);
  // Prometheus text exposition format 0.0.4.
  std::string Render() const;

 private:
  struct Family {
    std::string type;
    std::string help;
    std::map<std::string, std::unique_ptr<Counter>> counters;  // key: rendered labels
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& FamilyFor(const std::string& name, const char* type, const std::string& help);
  Labels WithConstLabels(const Labels& labels) const;

  MetricsRegistry* parent_ = nullptr;
  Labels const_labels_;

  mutable std::mutex mu_;  // guards families_, refreshers_, error_codes_
  std::map<std::string, Family> families_;
  std::vector<std::function<void()>> refreshers_;
  std::map<std::string, std::unique_ptr<ErrorCodeCounters>> error_codes_;  // key: name + rendered labels
};

}  // namespace shoal
