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

// The bounds Shoal holds documents it did not write to: request bodies at
// the gateway, upstream answers at a worker (runtime openai). JSON's map
// keys are not values; MessagePack's are (CheckBoundedMsgpack), so a
// document passed on as MessagePack may hold up to twice as many.
inline constexpr int kMaxDocumentDepth = 64;
inline constexpr uint64_t kMaxRequestValues = uint64_t{1} << 22;
inline constexpr uint64_t kMaxAnswerValues = uint64_t{1} << 25;

struct JsonBounds {
  int max_depth = kMaxDocumentDepth;         // arrays and objects, the root counting as one
  uint64_t max_values = kMaxRequestValues;  // scalars, arrays and objects at any depth
};

// The bounds for the MessagePack form of a JSON document held to
// `json_values`: MessagePack counts map keys as values, so twice as many.
constexpr JsonBounds MsgpackBoundsFor(uint64_t json_values) { return {kMaxDocumentDepth, 2 * json_values}; }

// Parses `text` into *out. Errors name `what` ("request body"):
// InvalidArgument "invalid_json" for text that is not JSON, InvalidArgument
// "nesting_too_deep" past max_depth, PayloadTooLarge "too_many_values" past
// max_values; the parse stops at the first bound crossed.
Status ParseBoundedJson(std::string_view text, std::string_view what, const JsonBounds& bounds,
                        nlohmann::json* out);

// Walks MessagePack `data` without decoding it, before a decoder that
// recurses once per level (nlohmann's, which a million nested one-element
// arrays in 1 MiB would take past the end of the stack) or reserves what a
// header claims (msgpack-c) sees it. Errors name `what`: InvalidArgument
// "nesting_too_deep" past max_depth, PayloadTooLarge "too_many_values" past
// max_values, InvalidArgument "invalid_msgpack" for an array or map that
// claims more elements than `data` has bytes, and for any bin or ext value
// unless `binary_allowed` (they have no JSON form). OK otherwise, also when
// `data` is malformed in another way: the decoder says so.
Status CheckBoundedMsgpack(std::string_view data, std::string_view what, const JsonBounds& bounds,
                           bool binary_allowed);

}  // namespace shoal
