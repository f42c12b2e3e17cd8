#include "common/bounded_json.h"

#include <string>

#include <nlohmann/json.hpp>

namespace shoal {
namespace {

// Thrown from the parser's callback to stop it.
struct StopParse {
  Status status;
};

}  // namespace

Status ParseBoundedJson(std::string_view text, std::string_view what, const JsonBounds& bounds,
                        nlohmann::json* out) {
  using nlohmann::json;
  const std::string name(what);
  try {
    uint64_t values = 0;
    int depth = 0;
    *out = json::parse(text, [&](int, json::parse_event_t event, json&) {
      switch (event) {
        case json::parse_event_t::object_start:
        case json::parse_event_t::array_start:
          if (++depth > bounds.max_depth)
            throw StopParse{InvalidArgument(name + " nests JSON arrays and objects more than " +
                                                std::to_string(bounds.max_depth) + " deep",
                                            "nesting_too_deep")};
          [[fallthrough]];
        case json::parse_event_t::value:
          if (++values > bounds.max_values)
            throw StopParse{Status(StatusCode::kPayloadTooLarge,
                                   name + " has more than " + std::to_string(bounds.max_values) + " JSON values",
                                   "too_many_values")};
          break;
        case json::parse_event_t::object_end:
        case json::parse_event_t::array_end:
          --depth;
          break;
        case json::parse_event_t::key:
          break;
      }
      return true;
    });
  } catch (const StopParse& stop) {
    return stop.status;
  } catch (const json::exception& e) {
    return InvalidArgument(name + " is not valid JSON: " + e.what(), "invalid_json");
  }
  return Status::Ok();
}

}  // namespace shoal
