// Shoal's own HTTP request/response structs. Route handlers take and return
// these, never the HTTP library's types, so routes are unit-tested without
// sockets and the server library can change without touching them.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shoal {

// Whether the client that sent a request is still there to read its answer.
// The server marks it gone when the client closes its side of the
// connection, or the connection breaks, before the whole answer is written
// (not when more bytes arrive: a client that sent its next request already
// is noticed leaving only once its answer is written). A handler whose
// answer takes long can stop work nobody will read. Thread-safe.
class ClientPresence {
 public:
  // `on_gone` runs once when the client is gone, on the thread that
  // noticed: an io thread, which it must not block (at once, on this
  // thread, when the client is gone already). A later call replaces it, an
  // empty one clears it; once the client is gone, it returns only after a
  // callback still running has returned, so what that callback uses can be
  // freed afterwards. It must not call OnGone.
  void OnGone(std::function<void()> on_gone) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!gone_) {
        on_gone_ = std::move(on_gone);
        return;
      }
      ran_cv_.wait(lock, [&] { return !running_; });
    }
    if (on_gone) on_gone();
  }
  bool gone() const {
    std::lock_guard<std::mutex> lock(mu_);
    return gone_;
  }
  // The server's side. Idempotent.
  void MarkGone() {
    std::function<void()> f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_) return;
      gone_ = true;
      f = std::move(on_gone_);
      on_gone_ = nullptr;
      running_ = static_cast<bool>(f);
    }
    if (!f) return;
    f();
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    ran_cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable ran_cv_;  // running_ went false
  bool gone_ = false;               // guarded by mu_
  bool running_ = false;            // guarded by mu_: MarkGone is running the callback
  std::function<void()> on_gone_;  // guarded by mu_
};

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // request target: path plus query (an absolute-form target without scheme and host)
  std::string path;    // target without the query string, not decoded
  std::string query;   // after '?', without it; empty if none
  // Header names lower-cased; values as received.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // Set by the server (null in route unit tests that make no one).
  std::shared_ptr<ClientPresence> client;

  // First header with this lower-case name, or empty.
  std::string_view Header(std::string_view lower_name) const {
    for (const auto& [k, v] : headers)
      if (k == lower_name) return v;
    return {};
  }
};

// A response body sent while it is produced (server-sent events). The
// handler makes one, sets HttpResponse::stream and responds: the status and
// headers go out at once, then every Write() as it arrives (chunked on
// HTTP/1.1, close-delimited on HTTP/1.0), and Close() ends the body.
// Without a server attached (route unit tests) writes just accumulate for
// Take(). Thread-safe.
class HttpBodyStream {
 public:
  // Queues `bytes` for the client; never blocks. False once the client is
  // gone (the producer may stop) or after Close().
  bool Write(std::string bytes) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_ || closed_) return false;
      pending_ += bytes;
      wake = wake_;
    }
    if (wake) wake();
    return true;
  }
  // Ends the body after what was written. Idempotent.
  void Close() {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      wake = wake_;
    }
    if (wake) wake();
  }
  bool gone() const {
    std::lock_guard<std::mutex> lock(mu_);
    return gone_;
  }

  // The server's side: `wake` is called (from any thread, without locks)
  // whenever there is something new to Take().
  void SetWake(std::function<void()> wake) {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = std::move(wake);
  }
  // Moves out what was written so far; *closed: Close() was called, so
  // nothing will follow what is returned now.
  std::string Take(bool* closed) {
    std::lock_guard<std::mutex> lock(mu_);
    *closed = closed_;
    std::string out = std::move(pending_);
    pending_.clear();
    return out;
  }
  // The client went away: later writes fail and are dropped.
  void Abandon() {
    std::lock_guard<std::mutex> lock(mu_);
    gone_ = true;
    wake_ = nullptr;
    pending_.clear();
  }

 private:
  mutable std::mutex mu_;
  std::string pending_;         // guarded by mu_
  bool closed_ = false;         // guarded by mu_
  bool gone_ = false;           // guarded by mu_
  std::function<void()> wake_;  // guarded by mu_
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
  // The OpenAI error code of an error body ("model_not_found"); not sent,
  // kept so metrics need not parse the body again.
  std::string error_code;
  // Set: the body is streamed from here and `body` is ignored.
  std::shared_ptr<HttpBodyStream> stream;
};

// Completes one request. Call exactly once, from any thread.
using HttpResponder = std::function<void(HttpResponse)>;
// Handles one request; may respond inline or later from another thread.
using HttpHandler = std::function<void(HttpRequest&&, HttpResponder)>;

}  // namespace shoal
