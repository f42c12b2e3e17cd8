#include "loadgen/utilisation.h"

#include <algorithm>
#include <optional>

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
    const auto heartbeat = w.find("heartbeat_unix_ms");
    if (heartbeat != w.end() && heartbeat->is_number_integer()) b.heartbeat_unix_ms = heartbeat->get<int64_t>();
    const auto slots = w.find("device_slots");
    if (slots != w.end() && slots->is_number_integer() && slots->get<int64_t>() > 0) {
      b.device_slots = static_cast<int>(slots->get<int64_t>());
    }
    out.push_back(std::move(b));
  }
  return out;
}

namespace {

// One worker's utilisation between two of its entries; nullopt when they
// measured nothing between them.
std::optional<double> Between(const WorkerBusy& before, const WorkerBusy& after, double dt_s) {
  if (before.heartbeat_unix_ms > 0 && after.heartbeat_unix_ms > 0)
    dt_s = static_cast<double>(after.heartbeat_unix_ms - before.heartbeat_unix_ms) / 1000;
  const double busy = after.busy_seconds - before.busy_seconds;
  if (dt_s <= 0 || busy < 0) return std::nullopt;
  return std::clamp(busy / (dt_s * std::max(1, after.device_slots)), 0.0, 1.0);
}

}  // namespace

std::map<std::string, double> Utilisation(const std::vector<WorkerBusy>& before, const std::vector<WorkerBusy>& after,
                                          double dt_s) {
  std::map<std::string, double> out;
  if (dt_s <= 0) return out;
  std::map<std::string, const WorkerBusy*> prev;
  for (const auto& w : before) prev[w.id] = &w;
  for (const auto& w : after) {
    const auto it = prev.find(w.id);
    if (it == prev.end()) continue;
    if (auto u = Between(*it->second, w, dt_s)) out[w.id] = *u;
  }
  return out;
}

void UtilisationTracker::Add(double t_s, std::vector<WorkerBusy> sample) {
  for (WorkerBusy& w : sample) {
    std::vector<Entry>& entries = entries_[w.id];
    if (!entries.empty()) {
      const Entry& last = entries.back();
      const bool measured_anew = w.heartbeat_unix_ms <= 0 || last.busy.heartbeat_unix_ms <= 0 ||
                                 w.heartbeat_unix_ms > last.busy.heartbeat_unix_ms;
      if (!measured_anew) continue;
      if (auto u = Between(last.busy, w, t_s - last.t_s)) series_[w.id].push_back({(last.t_s + t_s) / 2, *u});
    }
    entries.push_back({t_s, std::move(w)});
  }
}

std::map<std::string, double> UtilisationTracker::MeanOver(double t0_s, double t1_s) const {
  std::map<std::string, double> out;
  for (const auto& [id, entries] : entries_) {
    // From the last entry at or before t0 (else the first after it) to the
    // last at or before t1: with a heartbeat every 2 s, a short window
    // holds fewer entries than samples.
    const Entry* first = nullptr;
    const Entry* last = nullptr;
    for (const auto& e : entries) {
      if (e.t_s > t1_s) break;
      if (e.t_s <= t0_s || first == nullptr) first = &e;
      last = &e;
    }
    if (!first || first == last || last->t_s < t0_s) continue;
    if (auto u = Between(first->busy, last->busy, last->t_s - first->t_s)) out[id] = *u;
  }
  return out;
}

}  // namespace shoal::loadgen
