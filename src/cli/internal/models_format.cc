#include "cli/internal/models_format.h"

#include <algorithm>
#include <cstdio>
#include <exception>

#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "common/utf8.h"

namespace shoal::cli::internal {

namespace {

using json = nlohmann::json;

// A gateway answer as JSON, discarded when it is not JSON or is nested
// deeper than 64 (quoting an answer, dump, recurses once per level: one
// nested a million deep would overflow the stack).
json ParseAnswer(std::string_view body) {
  json j;
  if (!ParseBoundedJson(body, "the answer", JsonBounds{}, &j).ok()) return json(json::value_t::discarded);
  return j;
}

Status BadAnswer(const std::string& what, const std::string& why) {
  return Status(StatusCode::kBadGateway, "unexpected " + what + " from the gateway: " + why, "bad_answer");
}

// `s` with tabs and line breaks as spaces, every other control character
// (C0, DEL, C1) as '?' and every byte
// that is not UTF-8 as U+FFFD: what reaches the terminal comes from the
// registry, which any NATS client can write, and an escape sequence in a
// worker id must not drive the terminal (a bare 0x9B is CSI to a terminal
// not in UTF-8 mode).
std::string Printable(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t cp = DecodeUtf8(s, &pos);
    if (cp == '\n' || cp == '\r' || cp == '\t') {
      out.push_back(' ');
    } else {
      AppendUtf8(IsControl(cp) ? U'?' : cp, &out);
    }
  }
  return out;
}

// Reads an optional field, tolerating null and a wrong type (the gateway is
// built in parallel; a cosmetic field must not make the command fail), as
// printable text.
std::string Str(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? Printable(it->get<std::string>()) : std::string();
}
int64_t Int(const json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<int64_t>() : fallback;
}
bool Bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// An error given as {"message":..,"code":..} or as a plain string.
std::string ErrorText(const json& e) {
  if (e.is_string()) return e.get<std::string>();  // callers pass it through OneLine
  if (!e.is_object()) return e.is_null() ? std::string() : e.dump();
  std::string msg = Str(e, "message");
  std::string code = Str(e, "code");
  if (msg.empty()) msg = e.dump();
  return code.empty() ? msg : msg + " (" + code + ")";
}

std::string PastTense(const std::string& action) {
  if (action == "load") return "loaded";
  if (action == "unload") return "unloaded";
  if (action == "pin") return "pinned";
  if (action == "unpin") return "unpinned";
  return action + "ed";
}

std::string OneLine(std::string s, size_t max_chars) {
  s = Printable(s);
  s.erase(0, std::min(s.size(), s.find_first_not_of(' ')));  // one erase: a long run of blanks is not quadratic
  while (!s.empty() && s.back() == ' ') s.pop_back();
  if (s.size() > max_chars) s = s.substr(0, max_chars) + "...";
  return s;
}

}  // namespace

bool IsModelAction(const std::string& action) {
  return action == "load" || action == "unload" || action == "pin" || action == "unpin";
}

std::string ModelsUsage() {
  return "usage: shoal models [list] [--worker ID] [--json]\n"
         "       shoal models load|unload|pin|unpin <model> [--worker ID] [--json]\n"
         "options: --gateway URL (SHOAL_GATEWAY_URL), --timeout-ms N (SHOAL_MODELS_TIMEOUT_MS)\n";
}

std::string EncodePathSegment(std::string_view segment) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(segment.size());
  for (unsigned char c : segment) {
    const bool unreserved = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                            c == '-' || c == '.' || c == '_' || c == '~';
    if (unreserved) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
    }
  }
  return out;
}

std::string FormatBytes(int64_t bytes) {
  if (bytes < 0) return "-";
  if (bytes < 1024) return std::to_string(bytes) + " B";
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes) / 1024.0;
  size_t unit = 0;
  // Move up before rounding would print "1024.0".
  while (v >= 1023.95 && unit + 1 < std::size(kUnits)) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[unit]);
  return buf;
}

std::string FormatAgo(int64_t then_unix_ms, int64_t now_unix_ms) {
  if (then_unix_ms <= 0) return "never";
  const int64_t s = (now_unix_ms - then_unix_ms) / 1000;
  if (s <= 0) return "just now";
  if (s < 60) return std::to_string(s) + "s ago";
  if (s < 3600) return std::to_string(s / 60) + "m ago";
  if (s < 86400) return std::to_string(s / 3600) + "h ago";
  return std::to_string(s / 86400) + "d ago";
}

Result<std::vector<ModelRow>> ParseModelList(std::string_view body) {
  json j = ParseAnswer(body);
  if (j.is_discarded()) return BadAnswer("model list", "not JSON: " + OneLine(std::string(body), 200));
  auto data = j.is_object() ? j.find("data") : j.end();
  if (!j.is_object() || data == j.end() || !data->is_array()) {
    return BadAnswer("model list", "no \"data\" array in " + OneLine(j.dump(), 200));
  }
  std::vector<ModelRow> out;
  for (const json& m : *data) {
    if (!m.is_object() || !m.contains("id") || !m["id"].is_string()) {
      return BadAnswer("model list", "an entry without an \"id\": " + OneLine(m.dump(), 200));
    }
    ModelRow row;
    row.id = Str(m, "id");
    row.state = Str(m, "state");
    if (auto e = m.find("error"); e != m.end()) row.error = OneLine(ErrorText(*e), 300);
    if (auto ws = m.find("workers"); ws != m.end() && ws->is_array()) {
      for (const json& w : *ws) {
        if (!w.is_object()) continue;
        WorkerModelRow wr;
        wr.worker = Str(w, "worker");
        wr.state = Str(w, "state");
        wr.pinned = Bool(w, "pinned", false);
        wr.memory_bytes = Int(w, "memory_bytes", -1);
        wr.measured_bytes = Int(w, "measured_bytes", 0);
        wr.last_used_unix_ms = Int(w, "last_used_unix_ms", 0);
        if (auto e = w.find("error"); e != w.end()) wr.error = OneLine(ErrorText(*e), 300);
        row.workers.push_back(std::move(wr));
      }
    }
    out.push_back(std::move(row));
  }
  return out;
}

namespace {

// What it holds now; for a model not resident that was loaded there
// before, what it measured then, in parentheses.
std::string MemoryColumn(const WorkerModelRow& w) {
  if (w.memory_bytes == 0 && w.measured_bytes > 0) return "(" + FormatBytes(w.measured_bytes) + ")";
  return FormatBytes(w.memory_bytes);
}

}  // namespace

std::string RenderModelsTable(const std::vector<ModelRow>& models, int64_t now_unix_ms,
                              const std::string& worker_filter) {
  using Line = std::vector<std::string>;
  std::vector<Line> lines;
  bool any_error = false;
  auto or_dash = [](const std::string& s) { return s.empty() ? std::string("-") : s; };
  for (const ModelRow& m : models) {
    if (m.workers.empty()) {
      if (!worker_filter.empty()) continue;
      lines.push_back({m.id, or_dash(m.state), "-", "-", "-", "-", m.error});
      any_error |= !m.error.empty();
      continue;
    }
    for (const WorkerModelRow& w : m.workers) {
      if (!worker_filter.empty() && w.worker != worker_filter) continue;
      const std::string error = w.error.empty() ? m.error : w.error;
      lines.push_back({m.id, or_dash(w.state), or_dash(w.worker), w.pinned ? "yes" : "no",
                       MemoryColumn(w), FormatAgo(w.last_used_unix_ms, now_unix_ms), error});
      any_error |= !error.empty();
    }
  }
  if (lines.empty()) {
    return worker_filter.empty() ? "(no models)\n" : "(no models on worker " + worker_filter + ")\n";
  }

  Line header = {"MODEL", "STATE", "WORKER", "PINNED", "MEMORY", "LAST USED", "ERROR"};
  const size_t columns = any_error ? header.size() : header.size() - 1;
  std::vector<size_t> width(columns, 0);
  auto measure = [&](const Line& l) {
    for (size_t c = 0; c < columns; ++c) width[c] = std::max(width[c], l[c].size());
  };
  measure(header);
  for (const Line& l : lines) measure(l);

  std::string out;
  auto emit = [&](const Line& l) {
    std::string row;
    for (size_t c = 0; c < columns; ++c) {
      row += l[c];
      if (c + 1 < columns) row += std::string(width[c] - l[c].size() + 2, ' ');
    }
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  };
  emit(header);
  for (const Line& l : lines) emit(l);
  return out;
}

Result<ActionSummary> SummarizeAction(std::string_view body, const std::string& action, const std::string& model) {
  json j = ParseAnswer(body);
  if (j.is_discarded()) return BadAnswer(action + " answer", "not JSON: " + OneLine(std::string(body), 200));
  auto results = j.is_object() ? j.find("results") : j.end();
  if (!j.is_object() || results == j.end() || !results->is_array()) {
    return BadAnswer(action + " answer", "no \"results\" array in " + OneLine(j.dump(), 200));
  }
  ActionSummary out;
  for (const json& r : *results) {
    if (!r.is_object()) return BadAnswer(action + " answer", "a result that is not an object: " + OneLine(r.dump(), 200));
    std::string worker = Str(r, "worker");
    if (worker.empty()) worker = "(unknown worker)";
    auto err = r.find("error");
    const bool has_error = err != r.end() && !err->is_null();
    const bool ok = Bool(r, "ok", !has_error);
    if (ok) {
      ++out.succeeded;
      out.lines.push_back(PastTense(action) + " " + model + " on " + worker + " (ok)");
    } else {
      ++out.failed;
      const std::string why = has_error ? OneLine(ErrorText(*err), 500) : std::string("no error message");
      out.lines.push_back(action + " " + model + " failed on " + worker + ": " + why);
    }
  }
  if (out.lines.empty()) {
    // The gateway acts only where there is something to undo.
    out.nothing_to_do = action == "unload" || action == "unpin";
    out.lines.push_back(action + " " + model + ": " +
                        (action == "unload"  ? "nothing to do (no live worker has it loaded)"
                         : action == "unpin" ? "nothing to do (no live worker has it pinned)"
                                             : "no worker answered"));
  }
  return out;
}

int ActionExitCode(const ActionSummary& summary) {
  return summary.failed == 0 && (summary.succeeded > 0 || summary.nothing_to_do) ? 0 : 1;
}

std::string FormatHttpError(int http_status, std::string_view body) {
  const std::string http = "HTTP " + std::to_string(http_status);
  json j = ParseAnswer(body);
  if (!j.is_discarded() && j.is_object()) {
    if (auto e = j.find("error"); e != j.end() && (e->is_object() || e->is_string())) {
      std::string message = e->is_string() ? e->get<std::string>() : Str(*e, "message");
      std::string code;
      if (e->is_object()) {
        code = Str(*e, "code");
        if (auto c = e->find("code"); code.empty() && c != e->end() && c->is_number()) code = c->dump();
        if (code.empty()) code = Str(*e, "type");
      }
      if (message.empty()) message = "no message";
      message = OneLine(message, 500);
      return "error: " + message + " (" + (code.empty() ? http : code + ", " + http) + ")";
    }
  }
  std::string text = OneLine(std::string(body), 300);
  if (text.empty()) text = "the gateway gave no details";
  return "error: " + text + " (" + http + ")";
}

}  // namespace shoal::cli::internal
