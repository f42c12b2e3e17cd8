#include "common/metrics.h"

#include <gtest/gtest.h>

namespace shoal {
namespace {

TEST(Metrics, RendersPrometheusText) {
  MetricsRegistry reg;
  reg.GetCounter("shoal_requests_total", "Requests.", {{"route", "/v1/embeddings"}, {"code", "200"}})->Inc(3);
  reg.GetGauge("shoal_queue_depth", "Depth.")->Set(7);
  auto* h = reg.GetHistogram("shoal_latency_seconds", "Latency.", {{"route", "x"}}, {0.1, 1});
  h->Observe(0.05);
  h->Observe(0.5);
  h->Observe(5);
  std::string text = reg.Render();
  EXPECT_NE(text.find("# TYPE shoal_requests_total counter"), std::string::npos);
  EXPECT_NE(text.find("shoal_requests_total{route=\"/v1/embeddings\",code=\"200\"} 3"), std::string::npos);
  EXPECT_NE(text.find("shoal_queue_depth 7"), std::string::npos);
  // Bounds in their shortest form: a query selects a bucket by its le text.
  EXPECT_NE(text.find("shoal_latency_seconds_bucket{route=\"x\",le=\"0.1\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_latency_seconds_bucket{route=\"x\",le=\"+Inf\"} 3"), std::string::npos);
  EXPECT_NE(text.find("shoal_latency_seconds_count{route=\"x\"} 3"), std::string::npos);
  EXPECT_NE(text.find("shoal_latency_seconds_sum{route=\"x\"} 5.55"), std::string::npos) << text;
}

// Codes from outside are bounded: past the cap a new code counts as
// "other", except the codes operators are told to watch.
TEST(Metrics, ErrorCodeCountersAreBounded) {
  MetricsRegistry reg;
  ErrorCodeCounters errors(&reg, "shoal_x_errors_total", "X.", {{"model", "m"}}, 2);
  // The registry's are made once per family and labels (a model loaded
  // again shares its bound with its earlier loads).
  ErrorCodeCounters* shared = reg.GetErrorCodeCounters("shoal_y_errors_total", "Y.", {{"model", "m"}});
  EXPECT_EQ(reg.GetErrorCodeCounters("shoal_y_errors_total", "Y.", {{"model", "m"}}), shared);
  EXPECT_NE(reg.GetErrorCodeCounters("shoal_y_errors_total", "Y.", {{"model", "n"}}), shared);
  errors.Get("made_up_1")->Inc();
  errors.Get("made_up_2")->Inc();
  errors.Get("made_up_3")->Inc();
  errors.Get("made_up_4")->Inc();
  errors.Get("runtime_error")->Inc();
  errors.Get("made_up_1")->Inc();
  const std::string text = reg.Render();
  EXPECT_NE(text.find("shoal_x_errors_total{model=\"m\",code=\"made_up_1\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_x_errors_total{model=\"m\",code=\"other\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_x_errors_total{model=\"m\",code=\"runtime_error\"} 1"), std::string::npos) << text;
  EXPECT_EQ(text.find("made_up_3"), std::string::npos) << text;
}

// NaN is written as the exposition format spells it (a computed 0/0 printed
// "-nan", which fails the scrape of the whole page), and a NaN observation
// is dropped instead of making the histogram's sum NaN for good.
TEST(Metrics, NaNIsSpelledNaNAndNotObserved) {
  MetricsRegistry reg;
  volatile double zero = 0;
  reg.GetGauge("shoal_ratio", "Ratio.")->Set(-(zero / zero));
  auto* h = reg.GetHistogram("shoal_h_seconds", "H.", {}, {1});
  h->Observe(zero / zero);
  h->Observe(0.5);
  const std::string text = reg.Render();
  EXPECT_NE(text.find("shoal_ratio NaN\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_h_seconds_count 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_h_seconds_sum 0.5\n"), std::string::npos) << text;
}

// Label values from outside (a runtime's error code) are escaped and made
// valid UTF-8: one bad byte would fail the scrape of the whole page.
TEST(Metrics, LabelValuesAreEscapedAndValidUtf8) {
  MetricsRegistry reg;
  reg.GetCounter("c_total", "h", {{"code", "a\"b\\c\nd\xff\xc3" "e\xc3\xa9"}})->Inc();
  const std::string text = reg.Render();
  EXPECT_NE(text.find("c_total{code=\"a\\\"b\\\\c\\nd\xef\xbf\xbd\xef\xbf\xbd" "e\xc3\xa9\"} 1"), std::string::npos)
      << text;
}

TEST(Metrics, SameNameAndLabelsGiveTheSameSeries) {
  MetricsRegistry reg;
  auto* a = reg.GetCounter("c", "h", {{"k", "v"}});
  auto* b = reg.GetCounter("c", "h", {{"k", "v"}});
  auto* other = reg.GetCounter("c", "h", {{"k", "w"}});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
}

TEST(Metrics, RefreshersRunBeforeRender) {
  MetricsRegistry reg;
  auto* g = reg.GetGauge("g", "h");
  reg.AddRefresher([g] { g->Set(42); });
  EXPECT_NE(reg.Render().find("g 42"), std::string::npos);
}

// Workers sharing a process (`--sim-workers`) each count in their own
// series of the one page the process serves.
TEST(Metrics, ViewsWithConstantLabelsKeepTheirOwnSeriesOnTheParentsPage) {
  MetricsRegistry reg;
  MetricsRegistry w0(&reg, {{"worker", "w-0"}});
  MetricsRegistry w1(&reg, {{"worker", "w-1"}});
  w0.GetGauge("g", "h", {{"model", "m"}})->Set(1);
  w1.GetGauge("g", "h", {{"model", "m"}})->Set(2);
  EXPECT_NE(w0.GetGauge("g", "h", {{"model", "m"}}), w1.GetGauge("g", "h", {{"model", "m"}}));
  w1.GetHistogram("l", "h", {}, {1})->Observe(0.5);
  w1.AddRefresher([&reg] { reg.GetCounter("refreshed_total", "h")->Inc(); });
  const std::string text = w0.Render();
  EXPECT_NE(text.find("g{worker=\"w-0\",model=\"m\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("g{worker=\"w-1\",model=\"m\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("l_count{worker=\"w-1\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("refreshed_total 1"), std::string::npos) << text;
  EXPECT_EQ(text.find("# TYPE g gauge"), text.rfind("# TYPE g gauge")) << "one family, not one per view";
}

}  // namespace
}  // namespace shoal
