#include "common/bounded_json.h"

#include <string>

#include <msgpack.hpp>
#include <nlohmann/json.hpp>

namespace shoal {
namespace {

// Thrown from the parser's callback to stop it.
struct StopParse {
  Status status;
};

// Walks MessagePack without building it: counts values, tracks nesting,
// and stops at the first bound crossed or at an array or map header that
// claims more elements than the data has bytes (each takes one at least),
// before msgpack-c would reserve room for them.
struct MsgpackBoundsCheck : msgpack::null_visitor {
  MsgpackBoundsCheck(std::string_view what, const JsonBounds& bounds, size_t bytes, bool binary_allowed)
      : what(what), bounds(bounds), bytes(bytes), binary_allowed(binary_allowed) {}
  const std::string what;
  const JsonBounds bounds;
  const uint64_t bytes;
  const bool binary_allowed;
  uint64_t values = 0;
  int depth = 0;
  Status status;
  bool Stop(Status s) {
    status = std::move(s);
    return false;
  }
  bool TooMany() {
    return Stop(Status(StatusCode::kPayloadTooLarge,
                       what + " has more than " + std::to_string(bounds.max_values) + " MessagePack values",
                       "too_many_values"));
  }
  bool Take() { return ++values > bounds.max_values ? TooMany() : true; }
  bool Open(uint64_t elements) {
    if (!Take()) return false;
    if (++depth > bounds.max_depth) {
      return Stop(InvalidArgument(what + " nests MessagePack arrays and objects more than " +
                                      std::to_string(bounds.max_depth) + " deep",
                                  "nesting_too_deep"));
    }
    if (elements > bytes) {
      return Stop(InvalidArgument(what + " is not valid MessagePack: a header claims " + std::to_string(elements) +
                                      " elements in " + std::to_string(bytes) + " bytes",
                                  "invalid_msgpack"));
    }
    return elements > bounds.max_values - values ? TooMany() : true;
  }
  bool visit_nil() { return Take(); }
  bool visit_boolean(bool) { return Take(); }
  bool visit_positive_integer(uint64_t) { return Take(); }
  bool visit_negative_integer(int64_t) { return Take(); }
  bool visit_float32(float) { return Take(); }
  bool visit_float64(double) { return Take(); }
  bool visit_str(const char*, uint32_t) { return Take(); }
  bool Binary(const char* kind) {
    if (binary_allowed) return Take();
    return Stop(InvalidArgument(what + " holds a MessagePack " + kind +
                                    " value, which is not taken here (it has no JSON form): send text as str",
                                "invalid_msgpack"));
  }
  bool visit_bin(const char*, uint32_t) { return Binary("bin"); }
  bool visit_ext(const char*, uint32_t) { return Binary("ext"); }
  bool start_array(uint32_t n) { return Open(n); }
  bool end_array() { return --depth, true; }
  bool start_map(uint32_t n) { return Open(uint64_t{2} * n); }
  bool end_map() { return --depth, true; }
  void parse_error(size_t, size_t) {}
  void insufficient_bytes(size_t, size_t) {}
};

}  // namespace

Status CheckBoundedMsgpack(std::string_view data, std::string_view what, const JsonBounds& bounds,
                           bool binary_allowed) {
  MsgpackBoundsCheck check(what, bounds, data.size(), binary_allowed);
  std::size_t offset = 0;
  (void)msgpack::parse(data.data(), data.size(), offset, check);  // errors: the decoder's to report
  return check.status;
}

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
