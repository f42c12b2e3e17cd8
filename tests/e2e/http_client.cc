#include "e2e/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace shoal::e2e {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Per-call socket timeouts: each blocking send/recv gives up after this long.
void SetSocketTimeout(tcp::socket& socket, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

}  // namespace

std::string HttpResult::Header(const std::string& name) const {
  const std::string l = Lower(name);
  for (const auto& [k, v] : headers)
    if (k == l) return v;
  return {};
}

HttpResult Http(int port, const HttpCall& call) {
  HttpResult out;
  try {
    net::io_context ioc;
    tcp::socket socket(ioc);
    beast::error_code ec;
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)), ec);
    if (ec) {
      out.error = "connect: " + ec.message();
      return out;
    }
    SetSocketTimeout(socket, call.timeout);

    http::request<http::string_body> req{http::string_to_verb(call.method), call.target, 11};
    req.set(http::field::host, "127.0.0.1:" + std::to_string(port));
    req.set(http::field::user_agent, "shoal-e2e");
    req.keep_alive(false);
    for (const auto& [k, v] : call.headers) req.set(k, v);
    if (!call.body.empty() || call.method == "POST") {
      if (req.find(http::field::content_type) == req.end()) req.set(http::field::content_type, call.content_type);
      req.body() = call.body;
    }
    req.prepare_payload();
    // A server may answer early (413) and stop reading; still read its answer.
    http::write(socket, req, ec);
    const std::string write_error = ec ? ec.message() : "";

    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(256u << 20);
    parser.header_limit(64u << 10);
    http::read(socket, buffer, parser, ec);
    if (ec && !(ec == http::error::end_of_stream && parser.is_done())) {
      out.error = "read: " + ec.message() + (write_error.empty() ? "" : " (write: " + write_error + ")");
      return out;
    }
    auto& res = parser.get();
    out.status = static_cast<int>(res.result_int());
    for (const auto& f : res) out.headers.emplace_back(Lower(std::string(f.name_string())), std::string(f.value()));
    out.body = std::move(res.body());
    beast::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_both, ignored);
  } catch (const std::exception& e) {
    out.status = 0;
    out.error = std::string("exception: ") + e.what();
  }
  return out;
}

HttpResult HttpGet(int port, const std::string& target, std::chrono::milliseconds timeout) {
  HttpCall c;
  c.method = "GET";
  c.target = target;
  c.timeout = timeout;
  return Http(port, c);
}

HttpResult HttpPostJson(int port, const std::string& target, const std::string& body,
                        std::vector<std::pair<std::string, std::string>> headers,
                        std::chrono::milliseconds timeout) {
  HttpCall c;
  c.method = "POST";
  c.target = target;
  c.body = body;
  c.headers = std::move(headers);
  c.timeout = timeout;
  return Http(port, c);
}

int PostAndKeepOpen(int port, const std::string& target, const std::string& body, const std::string& content_type,
                    const std::vector<std::pair<std::string, std::string>>& headers) {
  std::string request = "POST " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: " + content_type +
                        "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  for (const auto& [name, value] : headers) request += name + ": " + value + "\r\n";
  request += "\r\n" + body;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return -1;
    }
    sent += static_cast<size_t>(n);
  }
  return fd;
}

}  // namespace shoal::e2e
