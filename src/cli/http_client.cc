#include "cli/http_client.h"

#include <algorithm>
#include <cctype>
#include <exception>
#include <utility>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace shoal::cli {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

constexpr uint64_t kMaxBodyBytes = uint64_t{64} << 20;
constexpr uint32_t kMaxHeaderBytes = 64u << 10;

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

Status BadUrl(const std::string& url, const std::string& why) {
  return InvalidArgument("bad gateway URL '" + url + "': " + why + " (expected http://host:port[/prefix])",
                         "bad_url");
}

// One request in flight: every step runs on `ioc` in this thread, so the
// handlers may refer to the members directly.
struct Exchange {
  net::io_context ioc;
  tcp::resolver resolver{ioc};
  beast::tcp_stream stream{ioc};
  net::steady_timer deadline{ioc};
  http::request<http::string_body> req;
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;

  bool timed_out = false;
  bool finished = false;
  Status failure;            // set when a step failed
  std::string write_error;   // a failed send still reads an early answer

  void Finish(Status s = Status::Ok()) {
    if (finished) return;
    finished = true;
    failure = std::move(s);
    deadline.cancel();
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.close();
  }
};

}  // namespace

std::string HttpUrl::ToString() const {
  const std::string h = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return "http://" + h + ":" + std::to_string(port) + prefix;
}

Result<HttpUrl> ParseHttpUrl(const std::string& url) {
  if (url.empty()) return BadUrl(url, "empty");
  for (unsigned char c : url) {
    if (c <= 0x20 || c >= 0x7f) return BadUrl(url, "contains whitespace or non-ASCII characters");
  }
  const size_t sep = url.find("://");
  if (sep == std::string::npos) return BadUrl(url, "no scheme");
  const std::string scheme = Lower(url.substr(0, sep));
  if (scheme == "https") return BadUrl(url, "https is not supported, use http://");
  if (scheme != "http") return BadUrl(url, "unsupported scheme '" + scheme + "'");

  const std::string rest = url.substr(sep + 3);
  if (rest.find_first_of("?#") != std::string::npos) return BadUrl(url, "a query or fragment is not allowed");
  const size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  std::string path = slash == std::string::npos ? "" : rest.substr(slash);
  if (authority.find('@') != std::string::npos) return BadUrl(url, "user info is not supported");

  HttpUrl out;
  std::string port_text;
  bool has_port = false;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == std::string::npos) return BadUrl(url, "unclosed '[' in the host");
    out.host = authority.substr(1, close - 1);
    const std::string after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return BadUrl(url, "unexpected text after ']'");
      has_port = true;
      port_text = after.substr(1);
    }
  } else {
    const size_t colon = authority.find(':');
    if (colon != std::string::npos && authority.find(':', colon + 1) != std::string::npos) {
      return BadUrl(url, "an IPv6 host goes in brackets, e.g. http://[::1]:8080");
    }
    out.host = authority.substr(0, colon);
    if (colon != std::string::npos) {
      has_port = true;
      port_text = authority.substr(colon + 1);
    }
  }
  if (out.host.empty()) return BadUrl(url, "no host");
  if (has_port) {
    if (port_text.empty() || port_text.size() > 5 ||
        !std::all_of(port_text.begin(), port_text.end(), [](unsigned char c) { return std::isdigit(c); })) {
      return BadUrl(url, "port '" + port_text + "' is not a number");
    }
    out.port = std::stoi(port_text);
    if (out.port < 1 || out.port > 65535) return BadUrl(url, "port " + port_text + " is outside 1..65535");
  }
  while (!path.empty() && path.back() == '/') path.pop_back();
  out.prefix = path;
  return out;
}

Result<HttpClient> HttpClient::Create(const std::string& base_url, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) return InvalidArgument("timeout must be positive, got " + std::to_string(timeout.count()) + " ms");
  // Beast's timer counts in nanoseconds: far larger values wrap and fire at once.
  if (timeout > kMaxTimeout)
    return InvalidArgument("timeout must be at most " + std::to_string(kMaxTimeout.count()) + " ms (a day), got " +
                           std::to_string(timeout.count()) + " ms");
  ASSIGN_OR_RETURN(HttpUrl url, ParseHttpUrl(base_url));
  return HttpClient(std::move(url), timeout);
}

Result<HttpReply> HttpClient::Send(const std::string& method, const std::string& path, const std::string& body) const {
  const std::string where = url_.ToString();
  if (path.empty() || path.front() != '/') return InvalidArgument("request path must start with '/': '" + path + "'");
  const http::verb verb = http::string_to_verb(method);
  if (verb == http::verb::unknown) return InvalidArgument("unknown HTTP method '" + method + "'");

  // Boost throws on allocation failure and a few misuse cases; this is the
  // edge where that becomes a Status.
  try {
    Exchange x;
    x.parser.body_limit(kMaxBodyBytes);
    x.parser.header_limit(kMaxHeaderBytes);
    x.req = http::request<http::string_body>(verb, url_.prefix + path, 11);
    const std::string host = url_.host.find(':') != std::string::npos ? "[" + url_.host + "]" : url_.host;
    x.req.set(http::field::host, host + ":" + std::to_string(url_.port));
    x.req.set(http::field::user_agent, "shoal-cli");
    x.req.set(http::field::accept, "application/json");
    x.req.keep_alive(false);
    for (const auto& [name, value] : headers_) x.req.set(name, value);
    if (!body.empty() || verb == http::verb::post) {
      x.req.set(http::field::content_type, "application/json");
      x.req.body() = body;
    }
    x.req.prepare_payload();

    x.deadline.expires_after(timeout_);
    x.deadline.async_wait([&x, &where, this](beast::error_code ec) {
      if (ec || x.finished) return;
      x.timed_out = true;
      x.resolver.cancel();
      x.Finish(DeadlineExceeded("no answer from " + where + " within " + std::to_string(timeout_.count()) + " ms",
                                "timeout"));
    });

    auto on_read = [&x, &where](beast::error_code ec, size_t) {
      if (x.finished) return;
      if (ec && !(ec == http::error::end_of_stream && x.parser.is_done())) {
        std::string msg = "connection to " + where + " failed while reading the answer: " + ec.message();
        if (!x.write_error.empty()) msg += " (sending: " + x.write_error + ")";
        x.Finish(Unavailable(std::move(msg), "connection_failed"));
        return;
      }
      x.Finish();
    };
    auto on_write = [&x, on_read](beast::error_code ec, size_t) {
      if (x.finished) return;
      // A server may answer early (413) and stop reading; read its answer.
      if (ec) x.write_error = ec.message();
      http::async_read(x.stream, x.buffer, x.parser, on_read);
    };
    auto on_connect = [&x, &where, on_write](beast::error_code ec, const tcp::endpoint&) {
      if (x.finished) return;
      if (ec) {
        const bool refused = ec == net::error::connection_refused;
        x.Finish(Unavailable("cannot connect to the gateway at " + where + ": " + ec.message(),
                             refused ? "connection_refused" : "connect_failed"));
        return;
      }
      http::async_write(x.stream, x.req, on_write);
    };
    auto on_resolve = [&x, &where, on_connect, this](beast::error_code ec, tcp::resolver::results_type results) {
      if (x.finished) return;
      if (ec) {
        x.Finish(Unavailable("cannot resolve host '" + url_.host + "' of " + where + ": " + ec.message(),
                             "resolve_failed"));
        return;
      }
      x.stream.async_connect(results, on_connect);
    };
    x.resolver.async_resolve(url_.host, std::to_string(url_.port), tcp::resolver::numeric_service, on_resolve);
    // Returns once every step and the deadline timer have completed. A DNS
    // lookup stuck inside getaddrinfo can hold it past the deadline.
    x.ioc.run();

    if (!x.finished) return Internal("request to " + where + " ended without an answer");
    if (!x.failure.ok()) return x.failure;
    auto& res = x.parser.get();
    HttpReply out;
    out.status = static_cast<int>(res.result_int());
    if (auto it = res.find(http::field::content_type); it != res.end()) out.content_type = std::string(it->value());
    out.body = std::move(res.body());
    return out;
  } catch (const std::exception& e) {
    return Internal("request to " + where + " failed: " + e.what());
  } catch (...) {
    return Internal("request to " + where + " failed with an unknown exception");
  }
}

}  // namespace shoal::cli
