// HttpServer: the gateway's asynchronous HTTP/1.1 listener. It owns the
// socket, the io threads and the connections, parses requests into
// HttpRequest and hands each one to a single HttpHandler; routing, JSON and
// everything OpenAI-shaped live in the handler, not here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "gateway/http.h"

namespace shoal {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // address or resolvable name to bind
  int port = 0;                    // 0 = pick a free port; see port()
  int threads = 2;                 // io threads sharing one io_context
  // A larger body is answered 413 and the connection closed.
  size_t max_body_bytes = size_t{256} << 20;
  // Request bodies still arriving, all connections together: what has
  // come of each so far counts until it is handed to the handler. A request
  // that would pass this is answered 503 "server_busy" (Retry-After: 1) and
  // its connection closed, so many uploads at once cannot hold memory
  // without bound. A body's declared Content-Length is not reserved until
  // its first MiB has come: a client that declares a large body and
  // trickles it holds only what it sent (at most 1 MiB of address space
  // more). A value under max_body_bytes counts as max_body_bytes.
  size_t max_receiving_bytes = size_t{1} << 30;
  // Open connections, idle ones included. One more is answered 503
  // "server_busy" (Retry-After: 1) and closed at once, so idle connections
  // cannot use up the process's file descriptors (which NATS and the blob
  // store need too).
  int max_connections = 4096;
  // How long a keep-alive connection may wait for the first byte of its
  // next request.
  int64_t idle_timeout_ms = 60000;
  // Once a request has started: how long its request line and headers may
  // take in all, and its body per read (a slow upload that keeps sending
  // goes on). Also bounds writing each response.
  int64_t read_timeout_ms = 30000;
  // A request the handler answers later (or streams) learns when its client
  // leaves (HttpRequest::client): its connection is watched until the
  // answer is written. false: HttpRequest::client is null and nothing is
  // watched, for clients or proxies that close their sending side once the
  // request is sent and still read the answer (which would look gone).
  bool watch_clients = true;
  // Called for each request the server answers itself, without the handler
  // (503 server_busy, 413 over max_body_bytes, 431, 400 malformed_request,
  // 400/501 unsupported_transfer_encoding), and for each connection past
  // max_connections closed unanswered (503 server_busy), with the status
  // and error code: for the caller's metrics. On an io thread; must not
  // block. May be empty.
  std::function<void(int status, std::string_view code)> on_refused;

  Status Validate() const;
};

// Serves HTTP/1.1 (keep-alive) and HTTP/1.0. One request is in flight per
// connection; requests on different connections run concurrently on the io
// threads. The handler runs on an io thread and must not block it: long work
// keeps the HttpResponder and calls it later from any thread, exactly once.
// A responder dropped without being called answers 500; one called after its
// connection closed or after Stop() does nothing.
class HttpServer {
 public:
  // Binds, listens and starts the io threads; returns once the server
  // accepts connections. Fails with kInvalidArgument for bad options and
  // kUnavailable when the address cannot be bound (the message says why).
  static Result<std::unique_ptr<HttpServer>> Create(
      const HttpServerOptions& options, HttpHandler handler);

  // Binds and listens on options' address once and closes it again, so a
  // program can fail before it starts anything else: the errors Create
  // would give now. (Another process may still take the address between
  // the two.)
  static Status CheckAddress(const HttpServerOptions& options);

  ~HttpServer();  // calls Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port (the one chosen when options.port was 0). Thread-safe.
  int port() const;

  // Stops accepting and waits, up to `timeout_ms`, until no request is in
  // flight: every request already handed to the handler has had its
  // response written (the caller makes its handlers answer, e.g. with 503).
  // Responses written meanwhile close their connections. Requests that
  // arrive on open connections meanwhile are still handled. Returns whether
  // none was left in flight. Must not be called from an io thread.
  bool Drain(int64_t timeout_ms);

  // Stops accepting, closes every connection (responses still pending are
  // dropped) and joins the io threads. Blocks only for that join. Idempotent
  // and thread-safe, but must not be called from the handler or any other
  // code running on an io thread.
  void Stop();

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal
