#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "common/utf8.h"

namespace shoal {
namespace {

void AtomicAdd(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

// A label value as the text format wants it: escaped, and valid UTF-8 (a
// value from outside, such as a runtime's error code, may not be; one bad
// byte makes a Prometheus scrape of the whole page fail).
std::string Escape(const std::string& v) {
  std::string out;
  size_t pos = 0;
  while (pos < v.size()) {
    const char32_t cp = DecodeUtf8(v, &pos);
    if (cp == '\\' || cp == '"') out.push_back('\\');
    if (cp == '\n') {
      out += "\\n";
      continue;
    }
    AppendUtf8(cp, &out);
  }
  return out;
}

std::string RenderLabels(const Labels& labels) {
  if (labels.empty()) return {};
  std::string s = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) s += ',';
    s += labels[i].first + "=\"" + Escape(labels[i].second) + "\"";
  }
  return s + "}";
}

// The shortest text that reads back as `v` ("0.1", not
// "0.10000000000000001": a bucket's le label is matched as text), and the
// exposition format's spellings of infinities and NaN ("-nan" fails a
// whole scrape).
std::string Num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::string("NaN");
}

// Adds one label to an already rendered label set.
std::string WithLabel(const std::string& rendered, const std::string& k, const std::string& v) {
  std::string extra = k + "=\"" + v + "\"";
  if (rendered.empty()) return "{" + extra + "}";
  return rendered.substr(0, rendered.size() - 1) + "," + extra + "}";
}

}  // namespace

void Gauge::Add(double v) { AtomicAdd(value_, v); }

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  buckets_ = std::make_unique<std::atomic<int64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i] = 0;
}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;  // in no bucket, and it would make the sum NaN for good
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

std::vector<double> LatencyBuckets() {
  return {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30};
}

std::vector<double> SizeBuckets() {
  std::vector<double> b;
  for (double v = 1; v <= 1024; v *= 2) b.push_back(v);
  return b;
}

MetricsRegistry::MetricsRegistry(MetricsRegistry* parent, Labels const_labels)
    : parent_(parent), const_labels_(std::move(const_labels)) {}

Labels MetricsRegistry::WithConstLabels(const Labels& labels) const {
  Labels all = const_labels_;
  all.insert(all.end(), labels.begin(), labels.end());
  return all;
}

MetricsRegistry::Family& MetricsRegistry::FamilyFor(const std::string& name, const char* type,
                                                    const std::string& help) {
  auto& f = families_[name];
  if (f.type.empty()) {
    f.type = type;
    f.help = help;
  }
  return f;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const Labels& labels) {
  if (parent_ != nullptr) return parent_->GetCounter(name, help, WithConstLabels(labels));
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyFor(name, "counter", help).counters[RenderLabels(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const Labels& labels) {
  if (parent_ != nullptr) return parent_->GetGauge(name, help, WithConstLabels(labels));
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyFor(name, "gauge", help).gauges[RenderLabels(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         const Labels& labels, std::vector<double> bounds) {
  if (parent_ != nullptr) return parent_->GetHistogram(name, help, WithConstLabels(labels), std::move(bounds));
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyFor(name, "histogram", help).histograms[RenderLabels(labels)];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return slot.get();
}

void MetricsRegistry::AddRefresher(std::function<void()> fn) {
  if (parent_ != nullptr) return parent_->AddRefresher(std::move(fn));
  std::lock_guard<std::mutex> lock(mu_);
  refreshers_.push_back(std::move(fn));
}

std::string MetricsRegistry::Render() const {
  if (parent_ != nullptr) return parent_->Render();
  std::vector<std::function<void()>> refreshers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    refreshers = refreshers_;
  }
  for (auto& r : refreshers) r();  // outside the lock: refreshers may call Get*
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out += "# HELP " + name + " " + f.help + "\n# TYPE " + name + " " + f.type + "\n";
    for (const auto& [l, c] : f.counters) out += name + l + " " + std::to_string(c->Value()) + "\n";
    for (const auto& [l, g] : f.gauges) out += name + l + " " + Num(g->Value()) + "\n";
    for (const auto& [l, h] : f.histograms) {
      int64_t cum = 0;
      for (size_t i = 0; i <= h->bounds().size(); ++i) {
        cum += h->BucketCount(i);
        std::string le = i < h->bounds().size() ? Num(h->bounds()[i]) : "+Inf";
        out += name + "_bucket" + WithLabel(l, "le", le) + " " + std::to_string(cum) + "\n";
      }
      out += name + "_sum" + l + " " + Num(h->Sum()) + "\n";
      out += name + "_count" + l + " " + std::to_string(h->Count()) + "\n";
    }
  }
  return out;
}

bool ErrorCodeKeepsOwnSeries(std::string_view code) {
  static constexpr std::string_view kCodes[] = {
      "queue_full",        "deadline_exceeded", "queue_unavailable",      "server_busy",  "shutting_down",
      "model_load_failed", "model_loading",     "no_worker",              "worker_lost",  "worker_stopping",
      "blob_not_found",    "blob_corrupt",      "blob_store_unavailable", "blob_store_full", "blob_store_missing",
      "blob_store_mismatch", "blob_ref_invalid", "runtime_error",         "internal_error", "reply_failed",
      "upstream_error",    "upstream_timeout",  "upstream_busy",          "upstream_auth",  "upstream_not_found",
      "payload_too_large", "stream_interrupted", "bad_worker_reply",       "headers_too_large", "malformed_request",
      "unsupported_transfer_encoding", "invalid_msgpack", "result_too_large", "cancelled"};
  return std::find(std::begin(kCodes), std::end(kCodes), code) != std::end(kCodes);
}

ErrorCodeCounters* MetricsRegistry::GetErrorCodeCounters(const std::string& name, const std::string& help,
                                                          const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = error_codes_[name + RenderLabels(labels)];
  if (!slot) slot = std::make_unique<ErrorCodeCounters>(this, name, help, labels);
  return slot.get();
}

ErrorCodeCounters::ErrorCodeCounters(MetricsRegistry* metrics, std::string name, std::string help, Labels labels,
                                     size_t max_codes)
    : metrics_(metrics), name_(std::move(name)), help_(std::move(help)), labels_(std::move(labels)),
      max_codes_(max_codes) {}

Counter* ErrorCodeCounters::Get(std::string_view code) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = by_code_.find(code); it != by_code_.end()) return it->second;
  const bool room = by_code_.size() < max_codes_ || ErrorCodeKeepsOwnSeries(code);
  if (!room && other_ != nullptr) return other_;
  Labels labels = labels_;
  labels.emplace_back("code", room ? std::string(code) : "other");
  Counter* c = metrics_->GetCounter(name_, help_, labels);
  if (room) by_code_.emplace(code, c);
  else other_ = c;
  return c;
}

}  // namespace shoal
