// Minimal leveled logging to stderr, safe from any thread. Level from
// SetLogLevel() (the CLI maps --log-level / SHOAL_LOG_LEVEL onto it).
#pragma once

#include <sstream>
#include <string_view>

namespace shoal {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug|info|warn|error"; false if unknown.
bool ParseLogLevel(std::string_view text, LogLevel* out);
void LogLine(LogLevel level, std::string_view component, const std::string& message);

}  // namespace shoal

#define SHOAL_LOG(level, component, expr)                                   \
  do {                                                                      \
    if (static_cast<int>(level) >= static_cast<int>(::shoal::GetLogLevel())) { \
      std::ostringstream _shoal_os;                                         \
      _shoal_os << expr;                                                    \
      ::shoal::LogLine(level, component, _shoal_os.str());                  \
    }                                                                       \
  } while (0)
#define LOG_DEBUG(c, e) SHOAL_LOG(::shoal::LogLevel::kDebug, c, e)
#define LOG_INFO(c, e) SHOAL_LOG(::shoal::LogLevel::kInfo, c, e)
#define LOG_WARN(c, e) SHOAL_LOG(::shoal::LogLevel::kWarn, c, e)
#define LOG_ERROR(c, e) SHOAL_LOG(::shoal::LogLevel::kError, c, e)
