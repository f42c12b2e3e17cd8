#include "common/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace shoal {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_mu;
const char* Name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarn: return "WARN";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}
}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

bool ParseLogLevel(std::string_view t, LogLevel* out) {
  if (t == "debug") *out = LogLevel::kDebug;
  else if (t == "info") *out = LogLevel::kInfo;
  else if (t == "warn" || t == "warning") *out = LogLevel::kWarn;
  else if (t == "error") *out = LogLevel::kError;
  else return false;
  return true;
}

namespace {

// A message may quote what came from outside (a runtime's or an upstream's
// error text, a client's input): control characters are written escaped,
// so it cannot end its line and forge others, or send terminal escapes.
std::string OneLine(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  const auto hex = [&](const char* prefix, unsigned char b) {
    out += prefix;
    out += kHex[b >> 4];
    out += kHex[b & 15];
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    const auto c = static_cast<unsigned char>(ch);
    // C1 controls (U+0080..U+009F, 0xC2 0x80..0x9F in UTF-8): xterm acts
    // on them as on ESC sequences.
    if (c == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
        static_cast<unsigned char>(text[i + 1]) <= 0x9f) {
      hex("\\u00", static_cast<unsigned char>(text[++i]));
    } else if ((c >= 0x20 && c != 0x7f) || c == '\t') {
      out += ch;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      hex("\\x", c);
    }
  }
  return out;
}

}  // namespace

void LogLine(LogLevel level, std::string_view component, const std::string& message) {
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  int ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  const std::string text = OneLine(message);
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "%s.%03dZ %-5s [%.*s] %.*s\n", ts, ms, Name(level),
               static_cast<int>(component.size()), component.data(), static_cast<int>(text.size()), text.data());
}

}  // namespace shoal
