// Finding a program on a PATH-style list of directories.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

namespace shoal {

// The first executable `name` (not a directory) in the ':'-separated
// `dirs`, as execvp searches: an empty entry is the working directory.
// Relative entries are taken from `cwd` when it is given. Empty when none.
inline std::string SearchPath(std::string_view dirs, const std::string& name, const std::string& cwd = "") {
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string_view::npos) end = dirs.size();
    std::filesystem::path full = std::filesystem::path(end > start ? dirs.substr(start, end - start) : ".") / name;
    if (full.is_relative() && !cwd.empty()) full = std::filesystem::path(cwd) / full;
    std::error_code ec;
    if (::access(full.c_str(), X_OK) == 0 && !std::filesystem::is_directory(full, ec)) return full.string();
    start = end + 1;
  }
  return "";
}

}  // namespace shoal
