// Status and Result<T>: the error currency at every module boundary in Shoal.
// A fixed set of codes maps one-to-one onto HTTP statuses and OpenAI error
// types, so an error raised deep in a worker reaches the caller unchanged.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace shoal {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // 400: malformed request, wrong types, empty input
  kNotFound,            // 404: unknown model or route
  kPayloadTooLarge,     // 413: body over the size limit
  kUnprocessable,       // 422: valid shape, but the model cannot take it
  kResourceExhausted,   // 429: queue full, retry later
  kUnavailable,         // 503: not ready / transient, retry later
  kDeadlineExceeded,    // 504: the request's deadline passed
  kInternal,            // 500: a bug or a failure inside a worker
  kBadGateway,          // 502: a backend (runtime, model load) failed
  kMethodNotAllowed,    // 405
  kUnsupportedMedia,    // 415
};

std::string_view StatusCodeName(StatusCode code);
// Inverse of StatusCodeName; kInternal for unknown names.
StatusCode ParseStatusCode(std::string_view name);
// The code of an error reported by name: as ParseStatusCode, but never OK
// (a report of failure whose code reads "ok", or none, is Internal).
StatusCode ParseFailureCode(std::string_view name);
int HttpStatusFor(StatusCode code);
// OpenAI error "type" for the code (invalid_request_error, server_error, ...).
std::string_view ErrorTypeFor(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, std::string reason = {})
      : code_(code), message_(std::move(message)), reason_(std::move(reason)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // Machine-readable reason, the OpenAI "code" field: "model_not_found",
  // "input_too_long", "queue_full". Empty means StatusCodeName(code()).
  const std::string& reason() const { return reason_; }
  std::string ReasonOrDefault() const {
    return reason_.empty() ? std::string(StatusCodeName(code_)) : reason_;
  }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  std::string reason_;
};

inline Status InvalidArgument(std::string m, std::string reason = {}) {
  return {StatusCode::kInvalidArgument, std::move(m), std::move(reason)};
}
inline Status NotFound(std::string m, std::string reason = {}) {
  return {StatusCode::kNotFound, std::move(m), std::move(reason)};
}
inline Status Unprocessable(std::string m, std::string reason = {}) {
  return {StatusCode::kUnprocessable, std::move(m), std::move(reason)};
}
inline Status ResourceExhausted(std::string m, std::string reason = {}) {
  return {StatusCode::kResourceExhausted, std::move(m), std::move(reason)};
}
inline Status Unavailable(std::string m, std::string reason = {}) {
  return {StatusCode::kUnavailable, std::move(m), std::move(reason)};
}
inline Status DeadlineExceeded(std::string m, std::string reason = {}) {
  return {StatusCode::kDeadlineExceeded, std::move(m), std::move(reason)};
}
inline Status Internal(std::string m, std::string reason = {}) {
  return {StatusCode::kInternal, std::move(m), std::move(reason)};
}

// Result<T>: a value or a non-OK Status (std::expected is C++23).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok());
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace shoal

#define SHOAL_CONCAT_INNER(a, b) a##b
#define SHOAL_CONCAT(a, b) SHOAL_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::shoal::Status _shoal_st = (expr);        \
    if (!_shoal_st.ok()) return _shoal_st;     \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(SHOAL_CONCAT(_shoal_res_, __LINE__), lhs, expr)
