#include "common/status.h"

namespace shoal {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kPayloadTooLarge: return "payload_too_large";
    case StatusCode::kUnprocessable: return "unprocessable_input";
    case StatusCode::kResourceExhausted: return "resource_exhausted";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kDeadlineExceeded: return "deadline_exceeded";
    case StatusCode::kInternal: return "internal_error";
    case StatusCode::kBadGateway: return "bad_gateway";
    case StatusCode::kMethodNotAllowed: return "method_not_allowed";
    case StatusCode::kUnsupportedMedia: return "unsupported_media_type";
  }
  return "unknown";
}

StatusCode ParseStatusCode(std::string_view name) {
  for (int i = 0; i <= static_cast<int>(StatusCode::kUnsupportedMedia); ++i) {
    auto c = static_cast<StatusCode>(i);
    if (StatusCodeName(c) == name) return c;
  }
  return StatusCode::kInternal;
}

StatusCode ParseFailureCode(std::string_view name) {
  const StatusCode c = ParseStatusCode(name);
  return c == StatusCode::kOk ? StatusCode::kInternal : c;
}

int HttpStatusFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kPayloadTooLarge: return 413;
    case StatusCode::kUnprocessable: return 422;
    case StatusCode::kResourceExhausted: return 429;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    case StatusCode::kInternal: return 500;
    case StatusCode::kBadGateway: return 502;
    case StatusCode::kMethodNotAllowed: return 405;
    case StatusCode::kUnsupportedMedia: return 415;
  }
  return 500;
}

std::string_view ErrorTypeFor(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kPayloadTooLarge:
    case StatusCode::kUnprocessable:
    case StatusCode::kMethodNotAllowed:
    case StatusCode::kUnsupportedMedia:
      return "invalid_request_error";
    case StatusCode::kResourceExhausted: return "rate_limit_error";
    case StatusCode::kUnavailable: return "service_unavailable_error";
    case StatusCode::kDeadlineExceeded: return "timeout_error";
    default: return "server_error";
  }
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

}  // namespace shoal
