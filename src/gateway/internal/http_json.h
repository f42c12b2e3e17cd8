// JSON helpers shared by the gateway's route handlers: hand-written output
// for the hot paths (no DOM for a response of floats), nlohmann for input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "common/status.h"
#include "gateway/http.h"

namespace shoal::internal {

// Appends `s` as a JSON string literal (quotes and escapes included).
void AppendJsonString(std::string& out, std::string_view s);
// Appends a JSON array of n floats (NaN / Inf become 0: JSON has neither).
void AppendFloats(std::string& out, const float* v, int n);
// Appends one float, shortest round-trip form (0 for NaN / Inf).
void AppendFloat(std::string& out, float v);
// A 200-style response with a JSON body.
HttpResponse JsonResponse(int status, std::string body);
// The most values (scalars, arrays and objects, at any depth) a request
// body may hold. A decoded value costs 16 (JSON) to 24 (MessagePack) bytes
// or more, against one or two in the body: without a bound, a 64 MiB array
// of zeros took the gateway and worker to 2.4 GB.
inline constexpr uint64_t kMaxRequestValues = shoal::kMaxRequestValues;
// The deepest nesting of arrays and objects a request body may have: the
// encoders and decoders that recurse (nlohmann's MessagePack reader and
// writer, dump) would otherwise run out of stack.
inline constexpr int kMaxRequestDepth = kMaxDocumentDepth;
// Parses `text` into a JSON object. InvalidArgument "invalid_json" when it
// is not one, "nesting_too_deep" past kMaxRequestDepth; PayloadTooLarge
// "too_many_values" past kMaxRequestValues.
Status ParseJsonObject(const std::string& text, nlohmann::json* out);
// Walks a MessagePack body before it is decoded: PayloadTooLarge
// "too_many_values" past kMaxRequestValues, InvalidArgument
// "nesting_too_deep" past kMaxRequestDepth, or "invalid_msgpack" for an
// array or map that claims more elements than the body has bytes, and for
// any bin or ext value unless `binary_allowed` (a body transcoded to JSON:
// those have no JSON form, and nlohmann would spell each byte out). OK
// otherwise, also when it is malformed in another way (the decoder says
// so).
Status CheckMsgpackBody(std::string_view body, bool binary_allowed);
// Whether a media type (a Content-Type's, parameters allowed) is
// MessagePack: application/msgpack, application/x-msgpack or
// application/vnd.msgpack, in any case.
bool IsMsgpackType(std::string_view content_type);
// Whether an Accept header prefers MessagePack to JSON: it lists a
// MessagePack type with q > 0 and a q at least that of JSON (from
// application/json, else application/*, else */*; 0 when none is listed).
// No header, or one without a MessagePack type: JSON.
bool AcceptsMsgpack(std::string_view accept);
// A fresh id for a response body ("<prefix>-<32 hex digits>").
std::string ResponseId(std::string_view prefix);

}  // namespace shoal::internal
