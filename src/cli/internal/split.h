// Comma (or other) separated lists on the command line.
#pragma once

#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace shoal::cli {

// Items between `sep`s, trimmed of spaces ("a, b" is a and b). Empty items
// are kept (a trailing separator gives one), for the caller to refuse or
// drop.
inline std::vector<std::string> SplitList(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);) {
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    out.push_back(item);
  }
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

// SplitList without the empty items.
inline std::vector<std::string> SplitNonEmpty(const std::string& s, char sep) {
  std::vector<std::string> out;
  for (std::string& item : SplitList(s, sep))
    if (!item.empty()) out.push_back(std::move(item));
  return out;
}

}  // namespace shoal::cli
