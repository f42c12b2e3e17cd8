#include "runtime/openai/upstream_client.h"

#include <algorithm>
#include <condition_variable>
#include <optional>
#include <thread>
#include <utility>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "runtime/runtime.h"

namespace shoal {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using beast::error_code;
using Clock = std::chrono::steady_clock;

struct UpstreamClient::Connection {
  // Each connection runs its own operations to completion on the calling
  // thread; a private io_context keeps concurrent callers apart.
  net::io_context ioc;
  beast::tcp_stream stream{ioc};
  beast::flat_buffer buffer;
  bool used = false;  // has carried a request (may have been closed since)
};

// Name resolution (getaddrinfo) cannot be cancelled or bounded, so it runs
// on a thread of its own, one at a time per client; callers wait for it only
// until their deadline. An answer is kept for kTtl; after that it is still
// used at once while a fresh resolution runs in the background (and while
// one fails), so a DNS outage or a slow resolver does not take a reachable
// upstream away, nor hold up connects.
struct UpstreamClient::Resolver {
  static constexpr std::chrono::seconds kTtl{30};
  struct Lookup {  // one resolution; outlives its thread's callers
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    error_code ec;
    tcp::resolver::results_type results;
  };

  Result<tcp::resolver::results_type> Resolve(const std::string& host, const std::string& port,
                                              Clock::time_point deadline) {
    std::shared_ptr<Lookup> lookup;
    {
      std::lock_guard<std::mutex> lock(mu);
      HarvestLocked();
      if (!last.empty() && Clock::now() - last_at < kTtl) return last;
      if (!in_flight) {
        in_flight = std::make_shared<Lookup>();
        std::thread([l = in_flight, host, port] {
          net::io_context ioc;
          tcp::resolver resolver(ioc);
          error_code ec;
          auto results = resolver.resolve(host, port, ec);
          std::lock_guard<std::mutex> done(l->mu);
          l->ec = ec;
          l->results = std::move(results);
          l->done = true;
          l->cv.notify_all();
        }).detach();
      }
      lookup = in_flight;
      if (!last.empty()) return last;  // old but known: used now, refreshed for later callers
    }
    std::unique_lock<std::mutex> wait(lookup->mu);
    const bool done = lookup->cv.wait_until(wait, deadline, [&] { return lookup->done; });
    const error_code ec = lookup->ec;
    const auto results = lookup->results;
    wait.unlock();
    std::lock_guard<std::mutex> lock(mu);
    if (done && in_flight == lookup) in_flight.reset();
    if (done && !ec && !results.empty()) {
      last = results;
      last_at = Clock::now();
      return results;
    }
    if (!last.empty()) return last;  // stale, but the best known
    if (!done) return DeadlineExceeded("cannot resolve " + host + " in time", "upstream_timeout");
    return Status(StatusCode::kBadGateway, "cannot resolve " + host + ": " + ec.message(), "upstream_error");
  }

  // Keeps the answer of a resolution that has ended since it was started
  // (nobody waited for it). Requires mu.
  void HarvestLocked() {
    if (!in_flight) return;
    std::lock_guard<std::mutex> l(in_flight->mu);
    if (!in_flight->done) return;
    if (!in_flight->ec && !in_flight->results.empty()) {
      last = in_flight->results;
      last_at = Clock::now();
    }
    in_flight.reset();
  }

  std::mutex mu;
  std::shared_ptr<Lookup> in_flight;       // guarded by mu
  tcp::resolver::results_type last;        // guarded by mu
  Clock::time_point last_at{};             // guarded by mu
};

namespace {

// How often a request whose caller may go away asks whether it has.
constexpr auto kCancelPollInterval = std::chrono::milliseconds(100);

// Runs one asynchronous operation on `stream` (its io_context `ioc`) until
// it completes, the stream's expiry cancels it (beast::error::timeout), or
// `cancelled` (may be empty) says the caller is gone: then the stream is
// closed (a connect does not go on to the next address), *gave_up is set
// and the result is operation_aborted.
template <typename Start>
error_code RunOp(net::io_context& ioc, beast::tcp_stream& stream, const std::function<bool()>& cancelled,
                 bool* gave_up, Start start) {
  error_code result = net::error::would_block;
  bool finished = false;
  start([&](error_code ec, auto&&...) {
    result = ec;
    finished = true;
  });
  ioc.restart();
  if (!cancelled) {
    ioc.run();
    return result;
  }
  while (!finished) {
    ioc.run_for(kCancelPollInterval);
    if (!finished && cancelled()) {
      stream.close();
      ioc.run();  // the operation ends, aborted (or done just before)
      *gave_up = true;
      return net::error::operation_aborted;
    }
  }
  return result;
}

bool IsTimeout(const error_code& ec) { return ec == beast::error::timeout; }

// The connection was closed under us before any answer: worth one retry on
// a fresh connection when it had been pooled.
bool IsStale(const error_code& ec) {
  return ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset ||
         ec == net::error::broken_pipe || ec == http::error::partial_message;
}

std::string Truncate(std::string_view s, size_t n) {
  return s.size() <= n ? std::string(s) : std::string(s.substr(0, n)) + "...";
}

}  // namespace

Status UpstreamOptions::Validate() const {
  if (base_url.empty()) return InvalidArgument("openai.base_url is required");
  if (connect_timeout_ms <= 0) return InvalidArgument("openai.connect_timeout_ms must be positive");
  if (timeout_ms <= 0) return InvalidArgument("openai.timeout_ms must be positive");
  if (max_connections < 1 || max_connections > 1024)
    return InvalidArgument("openai.max_connections must be in 1..1024");
  return Status::Ok();
}

Result<std::unique_ptr<UpstreamClient>> UpstreamClient::Create(const UpstreamOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<UpstreamClient> c(new UpstreamClient(options));
  std::string rest = options.base_url;
  const std::string scheme = "http://";
  if (rest.size() < scheme.size() || !beast::iequals(rest.substr(0, scheme.size()), scheme))
    return InvalidArgument("openai.base_url must start with http:// (https is not supported): '" +
                           options.base_url + "'");
  rest = rest.substr(scheme.size());
  // Goes into the request line and Host header as it is.
  if (std::any_of(rest.begin(), rest.end(), [](char ch) { return static_cast<unsigned char>(ch) <= 0x20 || ch == 0x7f; }))
    return InvalidArgument("openai.base_url has spaces or control characters: '" + options.base_url + "'");
  const size_t slash = rest.find('/');
  std::string authority = rest.substr(0, slash);
  c->prefix_ = slash == std::string::npos ? "" : rest.substr(slash);
  while (!c->prefix_.empty() && c->prefix_.back() == '/') c->prefix_.pop_back();
  if (authority.empty()) return InvalidArgument("openai.base_url has no host: '" + options.base_url + "'");
  if (authority.front() == '[') {  // [v6]:port
    const size_t close = authority.find(']');
    if (close == std::string::npos) return InvalidArgument("openai.base_url: bad IPv6 host");
    c->host_ = authority.substr(1, close - 1);
    c->port_ = close + 1 < authority.size() && authority[close + 1] == ':' ? authority.substr(close + 2) : "80";
  } else {
    const size_t colon = authority.rfind(':');
    c->host_ = authority.substr(0, colon);
    c->port_ = colon == std::string::npos ? "80" : authority.substr(colon + 1);
  }
  int port = 0;
  try {
    port = std::stoi(c->port_);
  } catch (...) {
    port = 0;
  }
  if (c->host_.empty() || port < 1 || port > 65535)
    return InvalidArgument("openai.base_url has a bad host or port: '" + options.base_url + "'");
  return c;
}

UpstreamClient::UpstreamClient(const UpstreamOptions& options)
    : options_(options), resolver_(std::make_unique<Resolver>()) {}
UpstreamClient::~UpstreamClient() = default;

int64_t UpstreamClient::connections_opened() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opened_;
}

std::unique_ptr<UpstreamClient::Connection> UpstreamClient::TakeIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_.empty()) return nullptr;
  auto c = std::move(idle_.back());
  idle_.pop_back();
  return c;
}

void UpstreamClient::ReturnIdle(std::unique_ptr<Connection> c) {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<int>(idle_.size()) < options_.max_connections) idle_.push_back(std::move(c));
}

Result<UpstreamReply> UpstreamClient::Post(const std::string& path, const std::string& json_body,
                                           const UpstreamDataFn& on_data, const std::function<bool()>& cancelled) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  const std::string target = prefix_ + path;
  for (int attempt = 0;; ++attempt) {
    std::unique_ptr<Connection> c = attempt == 0 ? TakeIdle() : nullptr;
    if (!c) c = std::make_unique<Connection>();
    bool retryable = false, reusable = false;
    auto r = Attempt(*c, target, json_body, on_data, cancelled, deadline, &retryable, &reusable);
    if (!r.ok() && retryable && attempt == 0) continue;
    if (r.ok() && reusable) ReturnIdle(std::move(c));
    return r;
  }
}

Result<UpstreamReply> UpstreamClient::Attempt(Connection& c, const std::string& target, const std::string& body,
                                              const UpstreamDataFn& on_data, const std::function<bool()>& cancelled,
                                              Clock::time_point deadline, bool* retryable, bool* reusable) {
  const std::string where = "upstream " + options_.base_url;
  bool gave_up = false;  // the caller went away (see RunOp)
  auto run = [&](auto start) { return RunOp(c.ioc, c.stream, cancelled, &gave_up, std::move(start)); };
  auto fail = [&](const error_code& ec, const std::string& what) -> Status {
    if (gave_up) {
      *retryable = false;
      return Cancelled();
    }
    if (IsTimeout(ec))
      return DeadlineExceeded(where + " did not answer within " + std::to_string(options_.timeout_ms) + " ms",
                              "upstream_timeout");
    return Status(StatusCode::kBadGateway, where + ": " + what + ": " + ec.message(), "upstream_error");
  };
  const bool pooled = c.used;
  if (!pooled) {
    const auto connect_deadline =
        std::min(deadline, Clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms));
    auto endpoints = resolver_->Resolve(host_, port_, connect_deadline);
    if (!endpoints.ok()) return Status(endpoints.status().code(), where + ": " + endpoints.status().message(),
                                       endpoints.status().reason());
    error_code ec;
    c.stream.expires_at(connect_deadline);
    ec = run([&](auto handler) { c.stream.async_connect(*endpoints, std::move(handler)); });
    if (ec) {
      if (IsTimeout(ec))
        return DeadlineExceeded(where + ": connect timed out", "upstream_timeout");
      return fail(ec, "cannot connect");
    }
    error_code ignored;
    c.stream.socket().set_option(tcp::no_delay(true), ignored);
    std::lock_guard<std::mutex> lock(mu_);
    ++opened_;
  }
  c.used = true;

  http::request<http::string_body> req{http::verb::post, target, 11};
  // An IPv6 address in brackets (RFC 7230).
  req.set(http::field::host, (host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_) + ":" + port_);
  req.set(http::field::user_agent, "shoal");
  req.set(http::field::content_type, "application/json");
  req.set(http::field::accept, on_data ? "text/event-stream, application/json" : "application/json");
  if (!options_.api_key.empty()) req.set(http::field::authorization, "Bearer " + options_.api_key);
  req.keep_alive(true);
  req.body() = body;
  req.prepare_payload();

  c.stream.expires_at(deadline);
  error_code ec = run([&](auto handler) { http::async_write(c.stream, req, std::move(handler)); });
  if (ec) {
    *retryable = pooled && !IsTimeout(ec);
    return fail(ec, "cannot send the request");
  }
  // Interim answers (100 Continue, 103 Early Hints) come before the real
  // one: each is read whole and skipped. Taken as the answer, the real one
  // would stay in the socket and answer the next request on this
  // connection.
  std::optional<http::response_parser<http::string_body>> parsed;
  for (int interim = 0;; ++interim) {
    parsed.emplace();
    parsed->body_limit(options_.max_response_bytes);
    ec = run([&](auto handler) { http::async_read_header(c.stream, c.buffer, *parsed, std::move(handler)); });
    if (ec) {
      *retryable = pooled && interim == 0 && IsStale(ec);
      return fail(ec, "no answer");
    }
    const unsigned status = parsed->get().result_int();
    if (status < 100 || status >= 200 || status == 101) break;
    if (interim == kMaxInterimAnswers)
      return Status(StatusCode::kBadGateway, where + " sent more than " + std::to_string(kMaxInterimAnswers) +
                                                 " interim (1xx) answers",
                    "upstream_error");
  }
  http::response_parser<http::string_body>& parser = *parsed;
  UpstreamReply reply;
  reply.status = static_cast<int>(parser.get().result_int());
  reply.content_type = std::string(parser.get()[http::field::content_type]);
  const bool streamed = on_data && reply.status / 100 == 2 &&
                        reply.content_type.find("text/event-stream") != std::string::npos;
  if (streamed) {
    bool ended = false;
    while (!parser.is_done()) {
      ec = run([&](auto handler) { http::async_read_some(c.stream, c.buffer, parser, std::move(handler)); });
      if (ec && ended) return reply;  // complete, but the connection is not reusable
      if (ec) {
        Status broke = fail(ec, "the stream broke");
        if (gave_up || broke.code() == StatusCode::kDeadlineExceeded) return broke;
        reply.broken = std::move(broke);  // a finish_reason may have come (see UpstreamReply)
        return reply;
      }
      std::string& got = parser.get().body();
      if (!got.empty() && !ended) {
        const StreamStep step = on_data(got);
        if (step == StreamStep::kAbandon) return reply;  // not reusable
        if (step == StreamStep::kEnded) {
          ended = true;
          c.stream.expires_at(std::min(deadline, Clock::now() + std::chrono::milliseconds(kDrainAfterEndMs)));
        }
      }
      got.clear();
    }
  } else {
    ec = run([&](auto handler) { http::async_read(c.stream, c.buffer, parser, std::move(handler)); });
    if (ec) return fail(ec, "the answer broke off");
    reply.body = std::move(parser.get().body());
  }
  // Only a connection with nothing left over may serve the next request.
  *reusable = parser.get().keep_alive() && parser.is_done() && c.buffer.size() == 0 && reply.status != 101;
  return reply;
}

Status UpstreamError(int http_status, std::string_view body) {
  std::string message;
  std::string code;
  // An error document is small; a larger body (up to max_response_bytes)
  // is read as text, not parsed into a tree many times its size.
  constexpr size_t kMaxErrorDocument = 64 * 1024;
  nlohmann::json j;
  if (body.size() <= kMaxErrorDocument) j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_object()) {
    // OpenAI {"error":{"message","code"}}; some servers put a string in
    // "error" or use {"message"} / {"detail"}.
    const nlohmann::json* e = j.contains("error") ? &j["error"] : &j;
    if (e->is_string()) {
      message = e->get<std::string>();
    } else if (e->is_object()) {
      for (const char* k : {"message", "detail"})
        if (e->contains(k) && (*e)[k].is_string()) {
          message = (*e)[k].get<std::string>();
          break;
        }
      if (e->contains("code") && (*e)["code"].is_string()) code = (*e)["code"].get<std::string>();
    }
  }
  if (message.empty()) message = Truncate(body, 500);
  const std::string m = "upstream answered " + std::to_string(http_status) + ": " + message;
  switch (http_status) {
    case 400: return InvalidArgument(m, code);
    case 404: return NotFound(m, code.empty() ? "upstream_not_found" : code);
    case 413: return Status(StatusCode::kPayloadTooLarge, m, code);
    case 422: return Unprocessable(m, code);
    case 429: return ResourceExhausted(m, code.empty() ? "upstream_busy" : code);
    case 401:
    case 403: return Status(StatusCode::kBadGateway, m, "upstream_auth");
    case 504: return DeadlineExceeded(m, "upstream_timeout");
    default: break;
  }
  if (http_status >= 400 && http_status < 500) return InvalidArgument(m, code);
  return Status(StatusCode::kBadGateway, m, "upstream_error");
}

}  // namespace shoal
