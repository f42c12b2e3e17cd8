// JSON that Shoal writes and reads, made safe. DumpJson: nlohmann's plain
// dump() throws on a string that is not UTF-8, and Shoal's JSON often
// quotes bytes it did not choose (a client's text, a parser's excerpt, a
// runtime's error message): on a NATS callback or an I/O thread that throw
// ended the process. DumpJson writes U+FFFD for each such byte instead.
// IntegerAs: a JSON number as an integer type, never cut or wrapped.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace shoal {

// `v` as the integer type T when it is a JSON integer that T holds; nullopt
// for a float, another type or a value out of T's range. nlohmann's get<T>
// casts instead: 256.9 becomes 256, 4294967552 as an int 256, -1 as an
// unsigned 2^64 - 1, and a float beyond T's range is undefined behaviour.
template <typename T, typename Json>
std::optional<T> IntegerAs(const Json& v) {
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned()) {
    const auto u = v.template get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) return std::nullopt;
    return static_cast<T>(u);
  }
  const auto i = v.template get<int64_t>();
  if constexpr (std::numeric_limits<T>::is_signed) {
    if (i < std::numeric_limits<T>::min() || i > std::numeric_limits<T>::max()) return std::nullopt;
  } else {
    if (i < 0 || static_cast<uint64_t>(i) > static_cast<uint64_t>(std::numeric_limits<T>::max())) return std::nullopt;
  }
  return static_cast<T>(i);
}

// `Json` is nlohmann::json or nlohmann::ordered_json; compact output unless
// `indent` >= 0 (spaces per level).
template <typename Json>
std::string DumpJson(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, Json::error_handler_t::replace);
}

}  // namespace shoal
