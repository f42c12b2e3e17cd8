// A tiny blocking HTTP/1.1 client for end-to-end tests: one connection per
// request, a whole-request timeout, never throws. Built on Boost.Beast.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace shoal::e2e {

struct HttpResult {
  int status = 0;       // 0: no response (see `error`)
  std::string error;    // transport error, empty when a response arrived
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;

  // First header with this name (any case), or empty.
  std::string Header(const std::string& name) const;
};

struct HttpCall {
  std::string method = "GET";
  std::string target = "/";
  std::string body;
  std::string content_type = "application/json";  // sent when body is non-empty
  std::vector<std::pair<std::string, std::string>> headers;
  std::chrono::milliseconds timeout{30000};
};

// Sends one request to 127.0.0.1:`port` and reads the response. Blocks up to
// about call.timeout. Thread-safe (no shared state).
HttpResult Http(int port, const HttpCall& call);

// Shorthands.
HttpResult HttpGet(int port, const std::string& target,
                   std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));
HttpResult HttpPostJson(int port, const std::string& target, const std::string& body,
                        std::vector<std::pair<std::string, std::string>> headers = {},
                        std::chrono::milliseconds timeout = std::chrono::milliseconds(30000));

// Sends one POST of `body` to 127.0.0.1:`port` on a raw connection and
// returns its file descriptor, for a test that reads what it wants and
// closes it (a client that leaves); -1 when it could not be sent.
int PostAndKeepOpen(int port, const std::string& target, const std::string& body,
                    const std::string& content_type = "application/json",
                    const std::vector<std::pair<std::string, std::string>>& headers = {});

}  // namespace shoal::e2e
