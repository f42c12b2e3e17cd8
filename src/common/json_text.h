// JSON text that Shoal writes. nlohmann's plain dump() throws on a string
// that is not UTF-8, and Shoal's JSON often quotes bytes it did not choose
// (a client's text, a parser's excerpt, a runtime's error message): on a
// NATS callback or an I/O thread that throw ended the process. DumpJson
// writes U+FFFD for each such byte instead.
#pragma once

#include <string>

namespace shoal {

// `Json` is nlohmann::json or nlohmann::ordered_json; compact output unless
// `indent` >= 0 (spaces per level).
template <typename Json>
std::string DumpJson(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, Json::error_handler_t::replace);
}

}  // namespace shoal
