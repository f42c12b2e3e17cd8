// UpstreamClient: the blocking HTTP/1.1 client the openai runtime uses to
// reach an OpenAI-compatible server (vLLM, SGLang, llama.cpp server, TEI,
// another Shoal gateway). Keeps a pool of keep-alive connections, retries
// once on a fresh connection when a pooled one turns out to be closed, and
// bounds every request by a deadline. Plain http:// only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace shoal {

struct UpstreamOptions {
  std::string base_url;             // http://host[:port][/prefix], e.g. http://10.0.0.5:8000/v1
  std::string api_key;              // sent as "Authorization: Bearer <key>" when set
  int64_t connect_timeout_ms = 5000;
  int64_t timeout_ms = 60000;       // one whole request (streamed ones too)
  int max_connections = 4;          // idle keep-alive connections kept
  size_t max_response_bytes = size_t{256} << 20;
  Status Validate() const;
};

// What came back: any HTTP status.
struct UpstreamReply {
  int status = 0;
  std::string content_type;
  std::string body;  // empty when the body went to a stream callback
  // Not OK: a streamed body whose connection broke before its end (the
  // callback's events say whether what came was complete).
  Status broken;
};

// What a stream callback wants next.
enum class StreamStep {
  kMore,     // keep reading
  kEnded,    // the answer is complete ([DONE]): read on only briefly, to reuse the connection
  kAbandon,  // stop now (the connection is closed)
};

// Receives a streamed (text/event-stream) body as it arrives, in pieces of
// any size.
using UpstreamDataFn = std::function<StreamStep(std::string_view bytes)>;

class UpstreamClient {
 public:
  static Result<std::unique_ptr<UpstreamClient>> Create(const UpstreamOptions& options);
  ~UpstreamClient();

  // POSTs `json_body` to prefix + `path` ("/embeddings"). With `on_data`, a
  // 2xx text/event-stream body is passed to it as it arrives instead of
  // being collected; once it answers kEnded, the rest of the body is read
  // for at most kDrainAfterEndMs to keep the connection (an upstream that
  // keeps the response open after [DONE] costs a connection, not the
  // request). Blocks up to timeout_ms. Errors: BadGateway
  // "upstream_error" when the upstream cannot be reached or the connection
  // breaks, DeadlineExceeded "upstream_timeout" when the timeout passes.
  // HTTP error statuses are returned, not turned into errors (see
  // UpstreamError). `cancelled` (may be empty), asked every 100 ms while
  // the request waits on the upstream: once it says the caller is gone, the
  // connection is closed (an OpenAI-compatible server stops generating
  // when its client leaves) and the answer is Cancelled().
  // Thread-safe: concurrent calls use different connections.
  Result<UpstreamReply> Post(const std::string& path, const std::string& json_body,
                             const UpstreamDataFn& on_data = {}, const std::function<bool()>& cancelled = {});

  static constexpr int64_t kDrainAfterEndMs = 500;
  static constexpr int kMaxInterimAnswers = 8;  // 1xx answers skipped before the real one

  // Connections opened so far (for tests of connection reuse).
  int64_t connections_opened() const;
  const std::string& base_url() const { return options_.base_url; }

 private:
  struct Connection;
  struct Resolver;  // the upstream's addresses, resolved off the caller's thread (see the .cc)
  explicit UpstreamClient(const UpstreamOptions& options);
  std::unique_ptr<Connection> TakeIdle();
  void ReturnIdle(std::unique_ptr<Connection> c);
  Result<UpstreamReply> Attempt(Connection& c, const std::string& target, const std::string& body,
                                const UpstreamDataFn& on_data, const std::function<bool()>& cancelled,
                                std::chrono::steady_clock::time_point deadline,
                                bool* retryable, bool* reusable);

  UpstreamOptions options_;
  std::string host_;
  std::string port_;
  std::string prefix_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> idle_;  // guarded by mu_
  int64_t opened_ = 0;                             // guarded by mu_
  std::unique_ptr<Resolver> resolver_;
};

// Maps an upstream HTTP error answer onto Shoal's status codes, keeping the
// upstream's message: 400 and other 4xx -> InvalidArgument, 404 NotFound,
// 413 PayloadTooLarge, 422 Unprocessable, 429 ResourceExhausted, 401/403 and
// 5xx -> BadGateway "upstream_error", 504 -> DeadlineExceeded
// "upstream_timeout".
Status UpstreamError(int http_status, std::string_view body);

}  // namespace shoal
