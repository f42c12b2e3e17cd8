#include "support/fake_openai_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <mutex>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

namespace shoal::testing {

class FakeOpenAiServer::Impl {
 public:
  explicit Impl(Handler handler) : handler_(std::move(handler)), acceptor_(io_) {
    namespace asio = boost::asio;
    const asio::ip::tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), 0);
    acceptor_.open(ep.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(ep);
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~Impl() {
    stop_ = true;
    accept_thread_.join();
    // No new connections now; join without mu_, which their threads take.
    std::vector<std::shared_ptr<boost::asio::ip::tcp::socket>> sockets;
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      sockets.swap(sockets_);
      threads.swap(conn_threads_);
    }
    for (auto& s : sockets) ::shutdown(s->native_handle(), SHUT_RDWR);
    for (auto& t : threads) t.join();
  }

  int port() const { return port_; }
  std::vector<Request> requests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd p{acceptor_.native_handle(), POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      auto sock = std::make_shared<boost::asio::ip::tcp::socket>(io_);
      boost::system::error_code ec;
      acceptor_.accept(*sock, ec);
      if (ec) continue;
      sock->set_option(boost::asio::ip::tcp::no_delay(true), ec);
      std::lock_guard<std::mutex> lock(mu_);
      sockets_.push_back(sock);
      conn_threads_.emplace_back([this, sock] { Serve(*sock); });
    }
  }

  void Serve(boost::asio::ip::tcp::socket& sock) {
    namespace http = boost::beast::http;
    boost::beast::flat_buffer buf;
    for (;;) {
      http::request<http::string_body> req;
      boost::system::error_code ec;
      http::read(sock, buf, req, ec);
      if (ec) return;
      Request r{std::string(req.method_string()), std::string(req.target()), req.body(),
                std::string(req[http::field::authorization])};
      {
        std::lock_guard<std::mutex> lock(mu_);
        requests_.push_back(r);
      }
      Reply reply = handler_(r);
      const bool keep = req.keep_alive() && !reply.close;
      if (reply.delay_ms > 0 && !WaitUnlessCut(sock, reply.delay_ms)) return;
      if (!reply.interim.empty()) {
        boost::asio::write(sock, boost::asio::buffer(reply.interim), ec);
        if (ec) return;
      }
      if (!reply.events.empty()) {
        if (!WriteEvents(sock, reply, req.version(), keep) || !keep) {
          sock.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ec);
          return;
        }
        continue;
      }
      http::response<http::string_body> res{static_cast<http::status>(reply.status), req.version()};
      res.set(http::field::content_type, reply.content_type);
      res.keep_alive(keep);
      res.body() = reply.body;
      res.prepare_payload();
      http::write(sock, res, ec);
      if (ec || !keep || reply.hang_up) {
        sock.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ec);
        return;
      }
    }
  }

  // Waits `ms`, unless the client closes the connection meanwhile (counted
  // in cut_): false then.
  bool WaitUnlessCut(boost::asio::ip::tcp::socket& sock, int64_t ms) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return true;
      pollfd p{sock.native_handle(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char byte;
      const ssize_t n = ::recv(sock.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n > 0) {  // more from the client (the next request): not a close
        std::this_thread::sleep_for(left);
        return true;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (!stop_) ++cut_;
      return false;
    }
  }

  bool WriteEvents(boost::asio::ip::tcp::socket& sock, const Reply& reply, unsigned version, bool keep) {
    namespace http = boost::beast::http;
    namespace asio = boost::asio;
    http::response<http::empty_body> res{static_cast<http::status>(reply.status), version};
    res.set(http::field::content_type, "text/event-stream");
    res.keep_alive(keep);
    res.chunked(true);
    http::response_serializer<http::empty_body> sr{res};
    boost::system::error_code ec;
    http::write_header(sock, sr, ec);
    for (size_t i = 0; !ec && i < reply.events.size(); ++i) {
      if (i > 0 && reply.event_delay_ms > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(reply.event_delay_ms));
      const std::string frame = "data: " + reply.events[i] + "\n\n";
      asio::write(sock, http::make_chunk(asio::buffer(frame)), ec);
      if (ec && !stop_) ++cut_;  // the client closed the connection mid-stream
    }
    if (!ec && reply.stall_after_events) {
      char byte;
      while (!ec) sock.read_some(asio::buffer(&byte, 1), ec);  // until the client (or ~Impl) closes it
      return false;
    }
    if (!ec && reply.break_after_events) return false;  // closed, unended
    if (!ec) asio::write(sock, http::make_chunk_last(), ec);
    return !ec;
  }

  Handler handler_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread accept_thread_;

 public:
  std::atomic<int> cut_{0};

 private:
  mutable std::mutex mu_;
  std::vector<Request> requests_;                                        // guarded by mu_
  std::vector<std::shared_ptr<boost::asio::ip::tcp::socket>> sockets_;  // guarded by mu_
  std::vector<std::thread> conn_threads_;                                // guarded by mu_
};

FakeOpenAiServer::Reply FakeOpenAiServer::Embeddings(const std::string& body) {
  auto req = nlohmann::json::parse(body, nullptr, false);
  if (req.is_discarded() || !req.contains("input")) return {400, R"({"error":{"message":"bad body"}})"};
  nlohmann::json inputs = req["input"].is_array() ? req["input"] : nlohmann::json::array({req["input"]});
  nlohmann::json data = nlohmann::json::array();
  int64_t words = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string t = inputs[i].is_string() ? inputs[i].get<std::string>() : "";
    words += t.empty() ? 0 : static_cast<int64_t>(std::count(t.begin(), t.end(), ' ') + 1);
    data.push_back({{"object", "embedding"}, {"index", i}, {"embedding", {0.6, 0.8}}});
  }
  nlohmann::json out = {{"object", "list"},
                        {"data", data},
                        {"model", req.value("model", "")},
                        {"usage", {{"prompt_tokens", words}, {"total_tokens", words}}}};
  return {200, out.dump()};
}

FakeOpenAiServer::FakeOpenAiServer(Handler handler) : impl_(std::make_unique<Impl>(std::move(handler))) {}
FakeOpenAiServer::~FakeOpenAiServer() = default;
int FakeOpenAiServer::port() const { return impl_->port(); }
std::vector<FakeOpenAiServer::Request> FakeOpenAiServer::requests() const { return impl_->requests(); }

int FakeOpenAiServer::cut() const { return impl_->cut_.load(); }

}  // namespace shoal::testing
