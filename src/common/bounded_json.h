// Parsing JSON that Shoal did not write (request bodies, upstream answers,
// a gateway's answers to the CLI) within bounds. nlohmann's parser builds a
// value of 16 bytes or more for every one or two bytes of text, and what
// walks a parsed document afterwards (dump, the MessagePack writer)
// recurses once per level: a deep enough document overflows the stack.
#pragma once

#include <cstdint>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace shoal {

struct JsonBounds {
  int max_depth = 64;  // arrays and objects, the root counting as one
  uint64_t max_values = uint64_t{1} << 22;  // scalars, arrays and objects at any depth
};

// Parses `text` into *out. Errors name `what` ("request body"):
// InvalidArgument "invalid_json" for text that is not JSON, InvalidArgument
// "nesting_too_deep" past max_depth, PayloadTooLarge "too_many_values" past
// max_values; the parse stops at the first bound crossed.
Status ParseBoundedJson(std::string_view text, std::string_view what, const JsonBounds& bounds,
                        nlohmann::json* out);

}  // namespace shoal
