// Shoal's own HTTP request/response structs. Route handlers take and return
// these, never the HTTP library's types, so routes are unit-tested without
// sockets and the server library can change without touching them.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shoal {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // raw request target: path plus query
  std::string path;    // target without the query string, not decoded
  std::string query;   // after '?', without it; empty if none
  // Header names lower-cased; values as received.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;

  // First header with this lower-case name, or empty.
  std::string_view Header(std::string_view lower_name) const {
    for (const auto& [k, v] : headers)
      if (k == lower_name) return v;
    return {};
  }
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
  // The OpenAI error code of an error body ("model_not_found"); not sent,
  // kept so metrics need not parse the body again.
  std::string error_code;
};

// Completes one request. Call exactly once, from any thread.
using HttpResponder = std::function<void(HttpResponse)>;
// Handles one request; may respond inline or later from another thread.
using HttpHandler = std::function<void(HttpRequest&&, HttpResponder)>;

}  // namespace shoal
