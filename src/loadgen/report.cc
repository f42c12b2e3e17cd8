#include "loadgen/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/json_text.h"

namespace shoal::loadgen {
namespace {

using nlohmann::json;

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // x, y
};

// A shaded stretch of the x axis (a phase's measured window).
struct Band {
  double x0 = 0, x1 = 0;
  std::string label;
};

struct Chart {
  std::vector<Band> bands;
  std::string title;
  std::string x_label;
  std::string y_label;
  std::vector<Series> series;
  bool y_from_zero = true;
  double y_max_at_least = 0;
};

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Fmt(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-3)) {
    std::snprintf(buf, sizeof buf, "%.3g", v);
  } else if (a >= 100 || v == std::floor(v)) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.3g", v);
  }
  return buf;
}

// A "nice" tick step (1, 2 or 5 × 10^k) giving about `n` ticks over `span`.
double NiceStep(double span, int n) {
  if (span <= 0) return 1;
  const double raw = span / n;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * mag) return m * mag;
  }
  return 10 * mag;
}

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string Render(const Chart& c) {
  const double W = 760, H = 440, L = 80, R = 190, T = 50, B = 60;
  const double pw = W - L - R, ph = H - T - B;
  double x0 = 0, x1 = 1, y0 = 0, y1 = c.y_max_at_least;
  bool any = false;
  for (const auto& s : c.series) {
    for (const auto& [x, y] : s.points) {
      if (!any) {
        x0 = x1 = x;
        if (!c.y_from_zero) y0 = y;
        any = true;
      }
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  }
  if (x0 > 0 && x0 < (x1 - x0)) x0 = 0;  // start the load axis at 0 when close
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  const double xs = NiceStep(x1 - x0, 6), ys = NiceStep(y1 - y0, 5);
  x0 = std::floor(x0 / xs) * xs;
  x1 = std::ceil(x1 / xs) * xs;
  y0 = std::floor(y0 / ys) * ys;
  y1 = std::ceil(y1 / ys) * ys;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return T + ph - (y - y0) / (y1 - y0) * ph; };

  std::string o;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                "font-family=\"sans-serif\" font-size=\"12\">\n",
                W, H, W, H);
  o += buf;
  o += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::snprintf(buf, sizeof buf, "<text x=\"%.0f\" y=\"28\" font-size=\"16\" text-anchor=\"middle\">", L + pw / 2);
  o += buf + Escape(c.title) + "</text>\n";
  // Phases under the grid.
  for (const Band& b : c.bands) {
    const double bx0 = std::clamp(px(b.x0), L, L + pw), bx1 = std::clamp(px(b.x1), L, L + pw);
    std::snprintf(buf, sizeof buf,
                  "<g class=\"phase\"><rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                  "fill=\"#f0f0f0\"/><text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"middle\">",
                  bx0, T, std::max(0.0, bx1 - bx0), ph, (bx0 + bx1) / 2, T + 12);
    o += buf + Escape(b.label) + "</text></g>\n";
  }
  // Grid and ticks.
  for (double y = y0; y <= y1 + ys / 2; y += ys) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">",
                  L, py(y), L + pw, py(y), L - 6, py(y) + 4);
    o += buf + Fmt(y) + "</text>\n";
  }
  for (double x = x0; x <= x1 + xs / 2; x += xs) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">",
                  px(x), T, px(x), T + ph, px(x), T + ph + 18);
    o += buf + Fmt(x) + "</text>\n";
  }
  std::snprintf(buf, sizeof buf,
                "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333\"/>\n", L, T,
                pw, ph);
  o += buf;
  std::snprintf(buf, sizeof buf, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", L + pw / 2, H - 14);
  o += buf + Escape(c.x_label) + "</text>\n";
  std::snprintf(buf, sizeof buf,
                "<text x=\"18\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 18 %.1f)\">", T + ph / 2,
                T + ph / 2);
  o += buf + Escape(c.y_label) + "</text>\n";
  // Series and legend.
  for (size_t i = 0; i < c.series.size(); ++i) {
    const Series& s = c.series[i];
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    o += "<g class=\"series\" data-name=\"" + Escape(s.name) + "\">\n";
    if (s.points.size() > 1) {
      o += "<polyline fill=\"none\" stroke=\"" + std::string(color) + "\" stroke-width=\"2\" points=\"";
      for (const auto& [x, y] : s.points) {
        std::snprintf(buf, sizeof buf, "%.1f,%.1f ", px(x), py(y));
        o += buf;
      }
      o += "\"/>\n";
    }
    if (s.points.size() <= 60) {
      for (const auto& [x, y] : s.points) {
        std::snprintf(buf, sizeof buf, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>", px(x), py(y), color);
        o += buf;
      }
      o += "\n";
    }
    o += "</g>\n";
    const double ly = T + 10 + 18 * static_cast<double>(i);
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\">",
                  L + pw + 12, ly, L + pw + 32, ly, color, L + pw + 38, ly + 4);
    o += buf + Escape(s.name) + "</text>\n";
  }
  if (!any) {
    std::snprintf(buf, sizeof buf, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">no data</text>\n", L + pw / 2,
                  T + ph / 2);
    o += buf;
  }
  o += "</svg>\n";
  return o;
}

std::string LoadAxis(const BenchReport& r) {
  bool open = false, closed = false;
  for (const auto& p : r.phases) (p.mode == "open" ? open : closed) = true;
  if (open && !closed) return "offered load (requests/s)";
  if (closed && !open) return "concurrent clients";
  return "offered load (requests/s) or clients";
}

// Phases in order of load, for lines that go left to right.
std::vector<const PhaseReport*> ByLoad(const BenchReport& r) {
  std::vector<const PhaseReport*> out;
  for (const auto& p : r.phases) out.push_back(&p);
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->Load() < b->Load(); });
  return out;
}

std::string StatusKey(int status) {
  return status == 0 ? "transport" : status == kUnansweredStatus ? "unanswered" : std::to_string(status);
}

}  // namespace

PhaseReport SummarizePhase(const std::string& mode, double offered_rate, int clients, const LoadResult& r,
                           const std::vector<std::string>& models, int inputs_per_request) {
  PhaseReport p;
  p.mode = mode;
  p.offered_rate = offered_rate;
  p.clients = clients;
  p.window_s = r.window_s;
  p.completed = r.completed;
  p.errors = r.errors;
  p.dropped = r.dropped;
  p.sent = mode == "open" ? r.due : r.completed + r.errors;
  for (const auto& [status, n] : r.errors_by_status) p.errors_by_status[StatusKey(status)] += n;
  p.requests_per_s = r.RequestsPerS();
  p.inputs_per_s = p.requests_per_s * inputs_per_request;
  p.prompt_tokens_per_s = r.TokensPerS();
  p.p50_ms = r.PercentileMs(50);
  p.p90_ms = r.PercentileMs(90);
  p.p99_ms = r.PercentileMs(99);
  p.max_ms = r.latencies_ms.empty() ? 0 : r.latencies_ms.back();
  p.mean_ms = r.latencies_ms.empty()
                  ? 0
                  : std::accumulate(r.latencies_ms.begin(), r.latencies_ms.end(), 0.0) /
                        static_cast<double>(r.latencies_ms.size());
  for (size_t i = 0; i < models.size(); ++i) {
    PhaseReport::ModelCounts m;
    m.model = models[i];
    if (i < r.per_tag.size()) {
      m.completed = r.per_tag[i].completed;
      m.errors = r.per_tag[i].errors;
    }
    p.per_model.push_back(m);
  }
  p.first_error = r.first_error;
  return p;
}

std::string ReportJson(const BenchReport& r) {
  json phases = json::array();
  for (const auto& p : r.phases) {
    json per_model = json::object();
    for (const auto& m : p.per_model) per_model[m.model] = {{"completed", m.completed}, {"errors", m.errors}};
    json ph = {
        {"mode", p.mode},
        {"window_s", p.window_s},
        {"start_s", p.start_s},
        {"end_s", p.end_s},
        {"sent", p.sent},
        {"completed", p.completed},
        {"errors", p.errors},
        {"dropped", p.dropped},
        {"errors_by_status", p.errors_by_status},
        {"throughput", {{"requests_per_s", p.requests_per_s},
                        {"inputs_per_s", p.inputs_per_s},
                        {"prompt_tokens_per_s", p.prompt_tokens_per_s}}},
        {"latency_ms",
         {{"p50", p.p50_ms}, {"p90", p.p90_ms}, {"p99", p.p99_ms}, {"max", p.max_ms}, {"mean", p.mean_ms}}},
        {"per_model", per_model},
    };
    if (p.mode == "open") {
      ph["offered_rate"] = p.offered_rate;
    } else {
      ph["clients"] = p.clients;
    }
    if (!p.mean_utilisation.empty()) ph["mean_utilisation"] = p.mean_utilisation;
    if (!p.first_error.empty()) ph["first_error"] = p.first_error;
    phases.push_back(std::move(ph));
  }
  json out = {
      {"tool", "shoal bench"},
      {"target", r.target},
      {"path", r.path},
      {"started_utc", r.started_utc},
      {"settings", r.settings},
      {"phases", phases},
  };
  if (r.utilisation_available) {
    json workers = json::object();
    for (const auto& [id, points] : r.utilisation) {
      json pts = json::array();
      for (const auto& pt : points) pts.push_back({{"t_s", pt.t_s}, {"utilisation", pt.utilisation}});
      workers[id] = pts;
    }
    out["utilisation"] = {{"source", "GET /v1/workers"}, {"workers", workers}};
  }
  // Error texts quote the target's answers, which need not be UTF-8.
  return DumpJson(out, 2) + "\n";
}

std::string ThroughputSvg(const BenchReport& r) {
  Chart c;
  c.title = "Throughput against offered load";
  c.x_label = LoadAxis(r);
  c.y_label = "completed requests/s";
  Series achieved{"achieved", {}};
  Series offered{"offered", {}};
  for (const PhaseReport* p : ByLoad(r)) {
    achieved.points.push_back({p->Load(), p->requests_per_s});
    if (p->mode == "open") offered.points.push_back({p->Load(), p->offered_rate});
  }
  c.series.push_back(std::move(achieved));
  if (!offered.points.empty()) c.series.push_back(std::move(offered));
  return Render(c);
}

std::string LatencySvg(const BenchReport& r) {
  Chart c;
  c.title = "Latency against load";
  c.x_label = LoadAxis(r);
  c.y_label = "latency (ms)";
  Series p50{"p50", {}}, p99{"p99", {}};
  for (const PhaseReport* p : ByLoad(r)) {
    if (p->completed == 0) continue;
    p50.points.push_back({p->Load(), p->p50_ms});
    p99.points.push_back({p->Load(), p->p99_ms});
  }
  c.series.push_back(std::move(p50));
  c.series.push_back(std::move(p99));
  return Render(c);
}

std::string UtilisationSvg(const BenchReport& r) {
  if (!r.utilisation_available || r.utilisation.empty()) return "";
  Chart c;
  c.title = "Per-worker utilisation over time";
  c.x_label = "time since start (s)";
  c.y_label = "utilisation (busy / slots)";
  c.y_max_at_least = 1.0;
  for (const auto& p : r.phases) {
    std::ostringstream label;
    if (p.mode == "open") {
      label << p.offered_rate << "/s";
    } else {
      label << p.clients << " clients";
    }
    c.bands.push_back({p.start_s, p.end_s, label.str()});
  }
  for (const auto& [id, points] : r.utilisation) {
    Series s{id, {}};
    for (const auto& pt : points) s.points.push_back({pt.t_s, pt.utilisation});
    c.series.push_back(std::move(s));
  }
  return Render(c);
}

Status PrepareReportDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Unavailable("cannot create " + dir + ": " + ec.message());
  const std::string probe = (std::filesystem::path(dir) / ".shoal-bench-probe").string();
  std::ofstream f(probe, std::ios::binary | std::ios::trunc);
  f << "probe";
  f.close();
  const bool ok = static_cast<bool>(f);
  std::filesystem::remove(probe, ec);
  if (!ok) return Unavailable("cannot write into " + dir);
  return Status::Ok();
}

Status WriteReport(const BenchReport& report, const std::string& dir, std::vector<std::string>* written) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // checked by PrepareReportDir already; made again if removed since
  if (ec) return Unavailable("cannot create " + dir + ": " + ec.message());
  auto write = [&](const std::string& name, const std::string& text) -> Status {
    const std::string path = (std::filesystem::path(dir) / name).string();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << text;
    f.close();
    if (!f) return Unavailable("cannot write " + path);
    if (written) written->push_back(path);
    return Status::Ok();
  };
  RETURN_IF_ERROR(write("results.json", ReportJson(report)));
  RETURN_IF_ERROR(write("throughput.svg", ThroughputSvg(report)));
  RETURN_IF_ERROR(write("latency.svg", LatencySvg(report)));
  const std::string util = UtilisationSvg(report);
  if (!util.empty()) {
    RETURN_IF_ERROR(write("utilisation.svg", util));
  } else {
    std::filesystem::remove(std::filesystem::path(dir) / "utilisation.svg", ec);  // an earlier run's
  }
  return Status::Ok();
}

}  // namespace shoal::loadgen
