#include "loadgen/utilisation.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace shoal::loadgen {

Result<std::vector<WorkerBusy>> ParseWorkers(const std::string& body) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("workers: the answer is not JSON");
  if (!j.is_object() || !j.contains("data") || !j["data"].is_array()) {
    return InvalidArgument("workers: the answer has no \"data\" list");
  }
  std::vector<WorkerBusy> out;
  for (const auto& w : j["data"]) {
    if (!w.is_object()) continue;
    const auto id = w.find("id");
    const auto busy = w.find("busy_seconds");
    if (id == w.end() || !id->is_string() || busy == w.end() || !busy->is_number()) continue;
    WorkerBusy b;
    b.id = id->get<std::string>();
    b.busy_seconds = busy->get<double>();
    const auto slots = w.find("device_slots");
    if (slots != w.end() && slots->is_number_integer() && slots->get<int64_t>() > 0) {
      b.device_slots = static_cast<int>(slots->get<int64_t>());
    }
    out.push_back(std::move(b));
  }
  return out;
}

std::map<std::string, double> Utilisation(const std::vector<WorkerBusy>& before, const std::vector<WorkerBusy>& after,
                                          double dt_s) {
  std::map<std::string, double> out;
  if (dt_s <= 0) return out;
  std::map<std::string, const WorkerBusy*> prev;
  for (const auto& w : before) prev[w.id] = &w;
  for (const auto& w : after) {
    const auto it = prev.find(w.id);
    if (it == prev.end()) continue;
    const double busy = w.busy_seconds - it->second->busy_seconds;
    if (busy < 0) continue;
    out[w.id] = std::clamp(busy / (dt_s * std::max(1, w.device_slots)), 0.0, 1.0);
  }
  return out;
}

void UtilisationTracker::Add(double t_s, std::vector<WorkerBusy> sample) {
  if (!samples_.empty()) {
    const Sample& last = samples_.back();
    const double mid = (last.t_s + t_s) / 2;
    for (const auto& [id, u] : Utilisation(last.workers, sample, t_s - last.t_s)) {
      series_[id].push_back({mid, u});
    }
  }
  samples_.push_back({t_s, std::move(sample)});
}

std::map<std::string, double> UtilisationTracker::MeanOver(double t0_s, double t1_s) const {
  const Sample* first = nullptr;
  const Sample* last = nullptr;
  for (const auto& s : samples_) {
    if (s.t_s < t0_s || s.t_s > t1_s) continue;
    if (!first) first = &s;
    last = &s;
  }
  if (!first || first == last) return {};
  return Utilisation(first->workers, last->workers, last->t_s - first->t_s);
}

}  // namespace shoal::loadgen
