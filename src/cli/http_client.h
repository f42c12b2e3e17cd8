// HttpClient: the small blocking HTTP/1.1 client the `shoal` command-line
// tools use to talk to a gateway (`shoal models`). Plain http:// only, one
// connection per request, a whole-request deadline; never throws.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace shoal::cli {

// A parsed base URL: http://host[:port][/prefix].
struct HttpUrl {
  std::string host;    // name or IP literal, IPv6 without brackets
  int port = 80;
  std::string prefix;  // "" or "/path" without a trailing slash
  // Back to text ("http://127.0.0.1:8080/prefix"), for messages.
  std::string ToString() const;
};

// Accepts http://host[:port][/prefix]; the scheme is case-insensitive and
// IPv6 hosts go in brackets. InvalidArgument for https:// (not supported),
// any other scheme, a missing scheme, user info, a query or fragment, an
// empty host or a port outside 1..65535.
Result<HttpUrl> ParseHttpUrl(const std::string& url);

// What came back: any HTTP status, 4xx/5xx included.
struct HttpReply {
  int status = 0;
  std::string body;
  std::string content_type;
};

class HttpClient {
 public:
  static constexpr std::chrono::milliseconds kMaxTimeout{int64_t{24} * 3600 * 1000};
  // Parses `base_url` (see ParseHttpUrl); `timeout` bounds each whole
  // request: resolve, connect, send and read together (1 ms to a day).
  static Result<HttpClient> Create(const std::string& base_url, std::chrono::milliseconds timeout);

  // Sends one request to prefix + `path` (already percent-encoded, starting
  // with '/') on a fresh connection and reads the whole answer. A non-empty
  // body, or any POST, goes as application/json. Blocks up to the timeout.
  // Unavailable when the host cannot be resolved or reached or the
  // connection breaks, DeadlineExceeded when the timeout passes. Never
  // throws. Thread-safe: calls share no state.
  Result<HttpReply> Send(const std::string& method, const std::string& path, const std::string& body = {}) const;
  Result<HttpReply> Get(const std::string& path) const { return Send("GET", path); }
  Result<HttpReply> Post(const std::string& path, const std::string& body) const { return Send("POST", path, body); }

  // Adds a header sent with every request (e.g. Authorization). Call before
  // sharing the client between threads.
  void SetHeader(std::string name, std::string value) { headers_.emplace_back(std::move(name), std::move(value)); }

  const HttpUrl& url() const { return url_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  HttpClient(HttpUrl url, std::chrono::milliseconds timeout) : url_(std::move(url)), timeout_(timeout) {}

  HttpUrl url_;
  std::chrono::milliseconds timeout_;
  std::vector<std::pair<std::string, std::string>> headers_;
};

}  // namespace shoal::cli
