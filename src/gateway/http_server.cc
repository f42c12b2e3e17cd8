#include "gateway/http_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "common/json_text.h"
#include "common/log.h"

namespace shoal {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using beast::error_code;

namespace {

// After an error response the server stops reading the request; closing
// with unread bytes in the socket would send RST and could destroy the
// response before the client reads it. So it half-closes and drains for up
// to this long first.
constexpr int64_t kLingerMs = 2000;
constexpr int64_t kAcceptRetryMs = 50;
// Connections past max_connections answered 503 at once (each holds its
// descriptor while the answer drains); more are closed unanswered.
constexpr int kMaxRefusing = 64;

// A request body read into a std::string. Beast's string_body reserves a
// body's whole Content-Length once the headers are read: address space
// only, but as much as a client declares (a limit on address space, or
// strict overcommit, then fails that reserve). This one reserves at most
// kFirstReserve at first, and the rest of the declared length once that
// much has come: a client that declares a large body and trickles it holds
// little, and a large upload is copied once, within its first MiB. A
// chunked body grows as std::string does.
struct ArrivingBody {
  using value_type = std::string;
  static constexpr std::uint64_t kFirstReserve = std::uint64_t{1} << 20;

  class reader {
   public:
    template <bool isRequest, class Fields>
    reader(http::header<isRequest, Fields>&, value_type& body) : body_(body) {}

    void init(const boost::optional<std::uint64_t>& length, error_code& ec) {
      declared_ = length.value_or(0);
      if (declared_ > 0) body_.reserve(static_cast<size_t>(std::min(declared_, kFirstReserve)));
      ec = {};
    }

    template <class ConstBufferSequence>
    size_t put(const ConstBufferSequence& buffers, error_code& ec) {
      const size_t extra = beast::buffer_bytes(buffers);
      if (extra > body_.max_size() - body_.size()) {
        ec = http::error::buffer_overflow;
        return 0;
      }
      if (body_.size() + extra > body_.capacity() && body_.size() + extra <= declared_)
        body_.reserve(static_cast<size_t>(declared_));
      for (const auto b : beast::buffers_range_ref(buffers))
        body_.append(static_cast<const char*>(b.data()), b.size());
      ec = {};
      return extra;
    }

    void finish(error_code& ec) { ec = {}; }

   private:
    value_type& body_;
    std::uint64_t declared_ = 0;  // its Content-Length; 0 when chunked
  };
};

// The OpenAI error shape the rest of the gateway answers with.
std::string ErrorBody(const Status& status) {
  nlohmann::ordered_json j;
  j["error"] = {{"message", status.message()},
                {"type", ErrorTypeFor(status.code())},
                {"param", nullptr},
                {"code", status.ReasonOrDefault()}};
  // Messages may quote client bytes or exception text.
  return DumpJson(j);
}

HttpResponse ErrorResponse(const Status& status) {
  HttpResponse r;
  r.status = HttpStatusFor(status.code());
  r.body = ErrorBody(status);
  return r;
}

HttpResponse InternalError(std::string message) {
  return ErrorResponse(Internal(std::move(message)));
}

void ToLower(std::string& s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
}

// The origin form (path and query) of a request target. A target in
// absolute form ("http://host:port/path?query", what a client sends to a
// proxy; RFC 9112 3.2.2 has servers accept it) loses its scheme and
// authority; "http://host" alone is "/".
std::string OriginForm(std::string_view target) {
  const size_t scheme_end = target.find("://");
  if (scheme_end == std::string_view::npos || target.substr(0, 1) == "/") return std::string(target);
  std::string scheme(target.substr(0, scheme_end));
  ToLower(scheme);
  if (scheme != "http" && scheme != "https") return std::string(target);
  const size_t rest = target.find_first_of("/?", scheme_end + 3);
  if (rest == std::string_view::npos) return "/";
  return (target[rest] == '?' ? "/" : "") + std::string(target.substr(rest));
}

// Closed by Stop() before the io_context goes away. Responders hold it so a
// call from a foreign thread never touches a dead io_context.
struct Gate {
  std::mutex mu;
  bool open = true;  // guarded by mu
};

}  // namespace

class HttpServer::Impl {
 public:
  class Connection;
  class Reply;

  Impl(const HttpServerOptions& options, HttpHandler handler)
      : options_(options),
        handler_(std::move(handler)),
        gate_(std::make_shared<Gate>()),
        ioc_(options.threads),
        acceptor_(net::make_strand(ioc_)),
        accept_retry_(acceptor_.get_executor()) {}

  Status Listen();
  void Start();
  bool Drain(int64_t timeout_ms);
  void Stop();
  bool draining() const { return draining_.load(std::memory_order_relaxed); }
  int port() const { return port_; }

  const HttpServerOptions& options() const { return options_; }
  // Counts `n` more bytes of request bodies arriving, unless that would
  // pass options().max_receiving_bytes. Thread-safe.
  bool ReserveReceiving(size_t n) {
    const size_t cap = std::max(options_.max_receiving_bytes, options_.max_body_bytes);
    size_t held = receiving_bytes_.load(std::memory_order_relaxed);
    do {
      if (held + n > cap) return false;
    } while (!receiving_bytes_.compare_exchange_weak(held, held + n, std::memory_order_relaxed));
    return true;
  }
  void UnreserveReceiving(size_t n) { receiving_bytes_.fetch_sub(n, std::memory_order_relaxed); }
  const HttpHandler& handler() const { return handler_; }
  const std::shared_ptr<Gate>& gate() const { return gate_; }
  void Remove(Connection* c);

 private:
  void Accept();
  void OnAccept(error_code ec, tcp::socket socket);

  const HttpServerOptions options_;
  const HttpHandler handler_;
  const std::shared_ptr<Gate> gate_;
  // Destroyed after everything that uses it; its destructor also frees
  // connections still referenced by handlers queued on it.
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  net::steady_timer accept_retry_;
  int port_ = 0;

  std::mutex mu_;
  // Live connections, so Stop() can close them; a connection removes itself
  // when it closes.
  std::unordered_map<Connection*, std::shared_ptr<Connection>> connections_;  // guarded by mu_

  std::atomic<bool> draining_{false};
  std::atomic<size_t> receiving_bytes_{0};  // see ReserveReceiving
  int refusing_ = 0;  // guarded by mu_: refused connections still sending their 503
  std::mutex stop_mu_;
  bool stopped_ = false;  // guarded by stop_mu_
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work_;
  std::vector<std::thread> threads_;
};

// One accepted socket. All of its state is touched only on its strand (the
// socket's executor), except by Stop() after the io threads are joined.
class HttpServer::Impl::Connection
    : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Impl& server, tcp::socket socket)
      : server_(server), stream_(std::move(socket)),
        executor_(stream_.get_executor()) {}

  void Start() {
    net::dispatch(stream_.get_executor(),
                  beast::bind_front_handler(&Connection::NextRequest,
                                            shared_from_this()));
  }
  void MarkRefused() { refused_ = true; }
  bool refused() const { return refused_; }
  // Answers 503 server_busy without reading a request, then half-closes
  // and drains (see kLingerMs): the server has no room for the connection.
  void Refuse() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
      self->FailRequest(503,
                        Unavailable("the gateway has as many connections open as it may; retry shortly",
                                    "server_busy"),
                        1);
    });
  }

  // Writes the answer to the current request. On the strand: from
  // Dispatch() when the handler answered inline, else posted by Reply.
  void Respond(HttpResponse response);

  // The connection's strand. Safe from any thread.
  const net::any_io_executor& executor() const { return executor_; }

  // A request of this connection's is under way: its first bytes have
  // arrived and its response is not written yet (or, closing after it, the
  // client has not yet read it and closed). Safe from any thread.
  bool busy() const { return busy_.load(std::memory_order_acquire); }

  // Only from Stop(), with no io thread running.
  void CloseNow() {
    if (body_stream_) body_stream_->Abandon();
    error_code ec;
    stream_.socket().close(ec);
  }

 private:
  void NextRequest();
  // The first bytes of a request are here: its header clock starts, and
  // the connection is busy until its answer is written.
  void BeginRequest();
  void ReadMore();
  void OnRead(error_code ec, size_t bytes);
  void Parse();
  void Dispatch();
  void OnContinueWritten(error_code ec, size_t);
  // While a dispatched request waits for its answer or streams it: notices
  // the client closing its side or the connection breaking (ClientPresence).
  void Watch();
  void OnWatch(uint64_t generation, error_code ec);
  // The answer is written whole, or all of it is being written: no more
  // watching for this request. Only while no other operation is pending on
  // the socket.
  void EndWatch();
  void OnWritten(error_code ec, size_t);
  // `retry_after_s` > 0 adds a Retry-After header.
  void FailRequest(int http_status, const Status& status, int retry_after_s = 0);
  // Counts what has arrived of the body against the server's
  // max_receiving_bytes. False, with the request answered 503, when there
  // is no room for it.
  bool ReserveBody();
  // Stops counting it (handed to the handler, refused or the connection gone).
  void ReleaseBody();
  // Streamed bodies (HttpResponse::stream), all on the strand.
  void StartStream(HttpResponse r, bool keep_alive);
  void PumpStream();
  void OnStreamWritten(error_code ec, size_t);
  void Linger();
  void OnLinger(error_code ec, size_t);
  void Close();

  Impl& server_;
  beast::tcp_stream stream_;
  const net::any_io_executor executor_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<ArrivingBody>> parser_;
  http::response<http::string_body> response_;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool head_ = false;        // a HEAD response carries no body
  bool in_request_ = false;  // bytes of the current request have arrived
  std::chrono::steady_clock::time_point request_started_;  // its first byte
  bool continue_checked_ = false;
  size_t body_reserved_ = 0;  // counted in the server's receiving bytes
  bool closing_ = false;     // the connection closes after this response
  bool refused_ = false;     // set once, under the server's mu_, before the connection starts
  bool closed_ = false;
  std::atomic<bool> busy_{false};  // see busy()
  std::shared_ptr<ClientPresence> presence_;  // the dispatched request's, until its answer is written
  bool watching_ = false;                     // an OnWatch is pending
  uint64_t watch_generation_ = 0;             // tells a cancelled OnWatch from the current one
  std::shared_ptr<HttpBodyStream> body_stream_;  // the response being streamed
  std::string stream_out_;                       // bytes being written from it
  bool stream_writing_ = false;
  bool stream_chunked_ = false;
  bool stream_ended_ = false;                    // the last chunk is being written
  char drain_[4096];
};

namespace {

// Set on an io thread while it runs the handler for one request: a response
// given before the handler returns is handed back here instead of being
// posted, which saves a lock and a trip through the strand's queue.
struct InlineReply {
  const void* reply = nullptr;  // the Reply being dispatched
  std::optional<HttpResponse>* response = nullptr;
};
thread_local InlineReply t_inline;

}  // namespace

// State shared by the copies of one HttpResponder.
class HttpServer::Impl::Reply {
 public:
  Reply(std::weak_ptr<Connection> connection, std::shared_ptr<Gate> gate)
      : connection_(std::move(connection)), gate_(std::move(gate)) {}

  ~Reply() {
    if (!done_.load(std::memory_order_acquire))
      Deliver(InternalError("the request was dropped without a response"));
  }

  void Send(HttpResponse response) {
    if (done_.exchange(true, std::memory_order_acq_rel)) return;
    Deliver(std::move(response));
  }

 private:
  void Deliver(HttpResponse response) {
    if (t_inline.reply == this) {
      *t_inline.response = std::move(response);
      return;
    }
    std::lock_guard<std::mutex> lock(gate_->mu);
    if (!gate_->open) return;
    std::shared_ptr<Connection> c = connection_.lock();
    if (!c) return;
    const net::any_io_executor& ex = c->executor();
    net::post(ex, [c = std::move(c), r = std::move(response)]() mutable {
      c->Respond(std::move(r));
    });
  }

  const std::weak_ptr<Connection> connection_;
  const std::shared_ptr<Gate> gate_;
  std::atomic<bool> done_{false};
};

void HttpServer::Impl::Connection::NextRequest() {
  busy_.store(false, std::memory_order_release);
  parser_.emplace();
  parser_->body_limit(static_cast<std::uint64_t>(server_.options().max_body_bytes));
  parser_->eager(true);
  in_request_ = false;
  continue_checked_ = false;
  // A pipelining client may already have sent the next request.
  if (buffer_.size() > 0) {
    BeginRequest();
    Parse();
  } else {
    ReadMore();
  }
}

void HttpServer::Impl::Connection::BeginRequest() {
  request_started_ = std::chrono::steady_clock::now();
  in_request_ = true;
  busy_.store(true, std::memory_order_release);
}

void HttpServer::Impl::Connection::ReadMore() {
  const auto& o = server_.options();
  if (in_request_ && !parser_->is_header_done()) {
    // The request line and headers have read_timeout_ms from their first
    // byte, however slowly they trickle in; the body, that long per read.
    stream_.expires_at(request_started_ + std::chrono::milliseconds(o.read_timeout_ms));
  } else {
    stream_.expires_after(std::chrono::milliseconds(in_request_ ? o.read_timeout_ms : o.idle_timeout_ms));
  }
  stream_.async_read_some(
      buffer_.prepare(beast::read_size(buffer_, 65536)),
      beast::bind_front_handler(&Connection::OnRead, shared_from_this()));
}

void HttpServer::Impl::Connection::OnRead(error_code ec, size_t bytes) {
  buffer_.commit(bytes);
  if (ec == net::error::eof && in_request_) {
    // The request may be delimited by the end of the stream.
    parser_->put_eof(ec);
    if (!ec && parser_->is_done()) {
      closing_ = true;
      return Dispatch();
    }
    if (ec == http::error::partial_message) return Close();
  }
  // Timeouts, resets, and a clean close between requests: nobody to answer.
  if (ec) return Close();
  if (!in_request_) BeginRequest();
  Parse();
}

void HttpServer::Impl::Connection::Parse() {
  for (;;) {
    error_code ec;
    size_t used = 0;
    try {
      used = parser_->put(buffer_.data(), ec);
    } catch (const std::bad_alloc&) {  // no room for the body: refused, not the end of the process
      return FailRequest(503, Unavailable("the gateway has no memory for this request's body; retry shortly",
                                          "server_busy"),
                         1);
    }
    buffer_.consume(used);
    if (ec == http::error::body_limit) {
      return FailRequest(413, Status(StatusCode::kPayloadTooLarge,
                                     "request body exceeds " +
                                         std::to_string(server_.options().max_body_bytes) +
                                         " bytes"));
    }
    if (ec == http::error::header_limit) {
      return FailRequest(431, InvalidArgument("request headers are too large",
                                              "headers_too_large"));
    }
    if (parser_->is_header_done()) {
      // Only "chunked" is decoded. A body whose length cannot be told (a
      // final coding other than chunked) is refused with 400, as RFC 9112
      // asks, and so is any other coding (501): neither is read as an empty
      // body followed by a second request.
      const auto te = parser_->get().find(http::field::transfer_encoding);
      // HTTP/1.0 has no transfer codings: whatever the framing, the
      // connection cannot be trusted after this request (RFC 9112 6.1).
      if (te != parser_->get().end() && parser_->get().version() < 11) closing_ = true;
      if (te != parser_->get().end() && !beast::iequals(te->value(), "chunked")) {
        return FailRequest(parser_->chunked() ? 501 : 400,
                           InvalidArgument("Transfer-Encoding '" + std::string(te->value()) +
                                               "' is not supported (only chunked)",
                                           "unsupported_transfer_encoding"));
      }
    }
    if (ec && ec != http::error::need_more)
      return FailRequest(400, InvalidArgument("malformed HTTP request: " + ec.message(), "malformed_request"));
    if (parser_->is_done()) return Dispatch();
    if (ec == http::error::need_more || used == 0) break;
  }
  if (!ReserveBody()) return;
  // The parser takes body bytes as they come, so what it leaves unread once
  // the headers are done is an unfinished chunk-size line or trailer: no
  // bound of its own (the body limit counts chunk data), it would grow the
  // buffer for as long as a client sends bytes without a line end.
  constexpr size_t kMaxLineBytes = 8192;  // as the request line and headers
  if (parser_->is_header_done() && buffer_.size() > kMaxLineBytes)
    return FailRequest(400, InvalidArgument("malformed HTTP request: a chunk-size line or trailer is longer than " +
                                                std::to_string(kMaxLineBytes) + " bytes",
                                            "malformed_request"));
  // curl and others wait for "100 Continue" before sending a large body.
  if (parser_->is_header_done() && !continue_checked_) {
    continue_checked_ = true;
    const auto& req = parser_->get();
    auto expect = req.find(http::field::expect);
    if (req.version() >= 11 && expect != req.end() &&
        beast::iequals(expect->value(), "100-continue")) {
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      stream_.expires_after(
          std::chrono::milliseconds(server_.options().read_timeout_ms));
      net::async_write(stream_, net::buffer(kContinue.data(), kContinue.size()),
                       beast::bind_front_handler(&Connection::OnContinueWritten,
                                                 shared_from_this()));
      return;
    }
  }
  ReadMore();
}

void HttpServer::Impl::Connection::OnContinueWritten(error_code ec, size_t) {
  if (ec) return Close();
  ReadMore();
}

bool HttpServer::Impl::Connection::ReserveBody() {
  if (!parser_->is_header_done()) return true;
  // What has arrived, not the Content-Length (see ArrivingBody): counted
  // by the declared length, a client that declared a large body and
  // trickled it held that much of the bound.
  const size_t want = parser_->get().body().size();
  if (want <= body_reserved_) return true;
  if (!server_.ReserveReceiving(want - body_reserved_)) {
    FailRequest(503,
                Unavailable("the gateway is receiving as many request bodies at once as it may hold; retry shortly",
                            "server_busy"),
                1);
    return false;
  }
  body_reserved_ = want;
  return true;
}

void HttpServer::Impl::Connection::ReleaseBody() {
  server_.UnreserveReceiving(body_reserved_);
  body_reserved_ = 0;
}

void HttpServer::Impl::Connection::Dispatch() {
  stream_.expires_never();
  ReleaseBody();  // the handler holds it now
  http::request<ArrivingBody> msg = parser_->release();
  version_ = msg.version();
  keep_alive_ = msg.keep_alive();
  head_ = msg.method() == http::verb::head;

  HttpRequest req;
  req.method = std::string(msg.method_string());
  req.target = OriginForm(std::string_view(msg.target().data(), msg.target().size()));
  size_t q = req.target.find('?');
  if (q == std::string::npos) {
    req.path = req.target;
  } else {
    req.path = req.target.substr(0, q);
    req.query = req.target.substr(q + 1);
  }
  req.headers.reserve(std::distance(msg.begin(), msg.end()));
  for (const auto& field : msg) {
    std::string name(field.name_string());
    ToLower(name);
    req.headers.emplace_back(std::move(name), std::string(field.value()));
  }
  req.body = std::move(msg.body());
  if (server_.options().watch_clients) {
    presence_ = std::make_shared<ClientPresence>();
    req.client = presence_;
  }

  std::optional<HttpResponse> response;
  {
    auto reply = std::make_shared<Reply>(weak_from_this(), server_.gate());
    const InlineReply outer = t_inline;
    t_inline = {reply.get(), &response};
    HttpResponder responder = [reply](HttpResponse r) { reply->Send(std::move(r)); };
    try {
      server_.handler()(std::move(req), std::move(responder));
    } catch (const std::exception& e) {
      reply->Send(InternalError(std::string("handler failed: ") + e.what()));
    } catch (...) {
      reply->Send(InternalError("handler failed"));
    }
    // If the handler kept no copy of the responder, this destroys the Reply
    // and its 500 lands in `response` too.
    reply.reset();
    t_inline = outer;
  }
  // An answer that comes later, or is streamed, may come after its client
  // has left.
  if (!response || response->stream) Watch();
  if (response) Respond(std::move(*response));
}

void HttpServer::Impl::Connection::Watch() {
  if (closed_ || watching_ || !presence_) return;
  watching_ = true;
  stream_.socket().async_wait(tcp::socket::wait_read,
                              beast::bind_front_handler(&Connection::OnWatch, shared_from_this(), watch_generation_));
}

void HttpServer::Impl::Connection::OnWatch(uint64_t generation, error_code ec) {
  if (generation != watch_generation_) return;  // cancelled by EndWatch
  watching_ = false;
  if (closed_ || !presence_) return;
  if (!ec) {
    // Readable: the end of the stream, a broken connection, or the bytes of
    // a next request (pipelined), which stay for the parser.
    char byte;
    const ssize_t n = ::recv(stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return;  // the client is there; it is not watched further
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Watch();
  }
  presence_->MarkGone();
}

void HttpServer::Impl::Connection::EndWatch() {
  presence_.reset();
  if (!watching_) return;
  watching_ = false;
  ++watch_generation_;
  // Nothing else is pending on the socket now (no write started yet, or
  // the last one done; the next read not started): this cancels the wait
  // alone.
  error_code ignored;
  stream_.socket().cancel(ignored);
}

void HttpServer::Impl::Connection::Respond(HttpResponse r) {
  if (closed_) return;
  // 1xx is no final answer; Beast refuses (throws on) a body with 204 or
  // 304, which would end the process from an io thread.
  if (r.status < 200 || r.status > 999 || ((r.status == 204 || r.status == 304) && !r.body.empty())) {
    r = InternalError("handler returned HTTP status " + std::to_string(r.status) +
                      (r.body.empty() ? "" : " with a body"));
  }
  response_ = {};
  response_.version(version_);
  response_.result(static_cast<unsigned>(r.status));
  response_.set(http::field::server, "shoal");
  if (!r.content_type.empty())
    response_.set(http::field::content_type, std::move(r.content_type));
  // A draining server closes each connection after its response.
  bool keep_alive = keep_alive_ && !closing_ && !server_.draining();
  for (auto& [name, value] : r.headers) {
    if (beast::iequals(name, "connection") && beast::iequals(value, "close")) {
      keep_alive = false;
      continue;
    }
    response_.insert(name, std::move(value));
  }
  if (r.stream && !head_) {
    // HTTP/1.0 has no chunked encoding: the end of the body is the close.
    if (version_ < 11) keep_alive = false;
    closing_ = !keep_alive;
    return StartStream(std::move(r), keep_alive);
  }
  response_.keep_alive(keep_alive);
  closing_ = !keep_alive;
  // The whole answer is on its way: a client that reads it and closes
  // before the write completes here has not left early.
  EndWatch();
  response_.body() = std::move(r.body);
  response_.prepare_payload();
  if (head_) response_.body().clear();  // keeps the Content-Length

  stream_.expires_after(
      std::chrono::milliseconds(server_.options().read_timeout_ms));
  http::async_write(stream_, response_,
                    beast::bind_front_handler(&Connection::OnWritten,
                                              shared_from_this()));
}

void HttpServer::Impl::Connection::OnWritten(error_code ec, size_t) {
  if (ec) return Close();
  EndWatch();
  // A draining server closes after every response, also where the client
  // may have sent more (pipelined): closing with unread bytes would reset
  // the connection, which can destroy the response before the client reads
  // it. Lingering reads them until the client closes (Drain waits for it).
  if (closing_ && server_.draining()) return Linger();
  if (closing_) {
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    return Close();
  }
  response_ = {};
  NextRequest();
}

void HttpServer::Impl::Connection::StartStream(HttpResponse r, bool keep_alive) {
  response_.keep_alive(keep_alive);
  stream_chunked_ = version_ >= 11;
  if (stream_chunked_) response_.chunked(true);
  response_.set(http::field::cache_control, "no-cache");
  std::ostringstream head;
  head << response_.base();
  response_ = {};
  stream_out_ = head.str();
  stream_ended_ = false;
  body_stream_ = std::move(r.stream);
  // Wake-ups come from producer threads; like a Reply they go through the
  // gate so none touches the io_context after Stop().
  std::weak_ptr<Connection> weak = weak_from_this();
  std::shared_ptr<Gate> gate = server_.gate();
  body_stream_->SetWake([weak, gate] {
    std::lock_guard<std::mutex> lock(gate->mu);
    if (!gate->open) return;
    std::shared_ptr<Connection> c = weak.lock();
    if (!c) return;
    const net::any_io_executor& ex = c->executor();
    net::post(ex, [c = std::move(c)] { c->PumpStream(); });
  });
  stream_writing_ = true;
  stream_.expires_after(std::chrono::milliseconds(server_.options().read_timeout_ms));
  net::async_write(stream_, net::buffer(stream_out_),
                   beast::bind_front_handler(&Connection::OnStreamWritten, shared_from_this()));
}

// Writes whatever the producer has queued, or the end of the body.
void HttpServer::Impl::Connection::PumpStream() {
  if (closed_ || !body_stream_ || stream_writing_ || stream_ended_) return;
  bool closed = false;
  std::string data = body_stream_->Take(&closed);
  stream_out_.clear();
  if (!data.empty()) {
    if (stream_chunked_) {
      char size[20];
      std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
      stream_out_ = size;
      stream_out_ += data;
      stream_out_ += "\r\n";
    } else {
      stream_out_ = std::move(data);
    }
  }
  if (closed) {
    stream_ended_ = true;
    if (stream_chunked_) stream_out_ += "0\r\n\r\n";
    EndWatch();  // as for a whole answer (see Respond)
  }
  if (stream_out_.empty()) {
    if (!stream_ended_) return;  // nothing yet: the next Write() wakes us
    return OnStreamWritten({}, 0);
  }
  stream_writing_ = true;
  stream_.expires_after(std::chrono::milliseconds(server_.options().read_timeout_ms));
  net::async_write(stream_, net::buffer(stream_out_),
                   beast::bind_front_handler(&Connection::OnStreamWritten, shared_from_this()));
}

void HttpServer::Impl::Connection::OnStreamWritten(error_code ec, size_t) {
  stream_writing_ = false;
  if (ec) return Close();
  if (!stream_ended_) {
    stream_.expires_never();  // waiting for the producer is not the client's fault
    return PumpStream();
  }
  body_stream_->SetWake(nullptr);
  body_stream_.reset();
  stream_out_.clear();
  OnWritten({}, 0);
}

// Answers the request with an error and closes without trusting the rest
// of the stream.
void HttpServer::Impl::Connection::FailRequest(int http_status, const Status& status, int retry_after_s) {
  if (const auto& count = server_.options().on_refused) count(http_status, status.ReasonOrDefault());
  closing_ = true;
  ReleaseBody();  // what has come is dropped with the connection
  response_ = {};
  response_.version(11);
  response_.result(static_cast<unsigned>(http_status));
  response_.set(http::field::server, "shoal");
  response_.set(http::field::content_type, "application/json");
  if (retry_after_s > 0) response_.set(http::field::retry_after, std::to_string(retry_after_s));
  response_.keep_alive(false);
  response_.body() = ErrorBody(status);
  response_.prepare_payload();
  stream_.expires_after(
      std::chrono::milliseconds(server_.options().read_timeout_ms));
  http::async_write(stream_, response_, [self = shared_from_this()](error_code ec, size_t) {
    if (ec) return self->Close();
    self->Linger();
  });
}

void HttpServer::Impl::Connection::Linger() {
  error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  stream_.expires_after(std::chrono::milliseconds(
      std::min(kLingerMs, server_.options().read_timeout_ms)));
  stream_.async_read_some(
      net::buffer(drain_),
      beast::bind_front_handler(&Connection::OnLinger, shared_from_this()));
}

void HttpServer::Impl::Connection::OnLinger(error_code ec, size_t) {
  if (ec) return Close();
  stream_.async_read_some(
      net::buffer(drain_),
      beast::bind_front_handler(&Connection::OnLinger, shared_from_this()));
}

void HttpServer::Impl::Connection::Close() {
  if (closed_) return;
  closed_ = true;
  ReleaseBody();
  // Closed before its answer was written whole.
  if (presence_) presence_->MarkGone();
  presence_.reset();
  if (body_stream_) {
    body_stream_->Abandon();
    body_stream_.reset();
  }
  error_code ignored;
  stream_.socket().close(ignored);
  busy_.store(false, std::memory_order_release);
  server_.Remove(this);
}

namespace {

// Resolves options.host, then opens, binds and listens `acceptor` on it;
// `*port` gets the bound port.
Status OpenListener(net::io_context& ioc, tcp::acceptor& acceptor, const HttpServerOptions& options, int* port) {
  error_code ec;
  tcp::endpoint endpoint;
  net::ip::address address = net::ip::make_address(options.host, ec);
  if (!ec) {
    endpoint = tcp::endpoint(address, static_cast<unsigned short>(options.port));
  } else {
    tcp::resolver resolver(ioc);
    auto results = resolver.resolve(options.host, std::to_string(options.port),
                                    tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      return Unavailable("cannot resolve HTTP host '" + options.host +
                         "': " + (ec ? ec.message() : "no addresses"));
    }
    endpoint = results.begin()->endpoint();
  }
  const std::string where =
      options.host + ":" + std::to_string(options.port);
  auto fail = [&](const char* what) {
    error_code ignored;
    acceptor.close(ignored);
    return Unavailable(std::string("cannot ") + what + " HTTP address " + where +
                       ": " + ec.message());
  };
  if (acceptor.open(endpoint.protocol(), ec)) return fail("open");
  if (acceptor.set_option(net::socket_base::reuse_address(true), ec))
    return fail("configure");
  if (acceptor.bind(endpoint, ec)) return fail("bind");
  if (acceptor.listen(net::socket_base::max_listen_connections, ec))
    return fail("listen on");
  *port = acceptor.local_endpoint(ec).port();
  if (ec) return fail("query");
  return Status::Ok();
}

}  // namespace

Status HttpServer::Impl::Listen() { return OpenListener(ioc_, acceptor_, options_, &port_); }

void HttpServer::Impl::Start() {
  work_.emplace(ioc_.get_executor());
  Accept();
  threads_.reserve(options_.threads);
  for (int i = 0; i < options_.threads; ++i)
    threads_.emplace_back([this] { ioc_.run(); });
}

void HttpServer::Impl::Accept() {
  acceptor_.async_accept(
      net::make_strand(ioc_),
      beast::bind_front_handler(&Impl::OnAccept, this));
}

void HttpServer::Impl::OnAccept(error_code ec, tcp::socket socket) {
  if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
  if (ec) {
    // Typically out of file descriptors; retrying at once would spin.
    LOG_WARN("http", "accept failed: " << ec.message());
    accept_retry_.expires_after(std::chrono::milliseconds(kAcceptRetryMs));
    accept_retry_.async_wait([this](error_code ec) {
      if (!ec) Accept();
    });
    return;
  }
  error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  auto c = std::make_shared<Connection>(*this, std::move(socket));
  enum { kServe, kRefuse, kDrop } what = kServe;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (connections_.size() - static_cast<size_t>(refusing_) >= static_cast<size_t>(options_.max_connections)) {
      // Refused ones hold their descriptor while the 503 goes out and the
      // socket drains (seconds): a few at a time; past that, closed at once.
      what = refusing_ < kMaxRefusing ? kRefuse : kDrop;
    }
    if (what == kRefuse) {
      ++refusing_;
      c->MarkRefused();
    }
    if (what != kDrop) connections_.emplace(c.get(), c);
  }
  // Closed unanswered, but counted as refused all the same.
  if (what == kDrop && options_.on_refused) options_.on_refused(503, "server_busy");
  if (what == kServe) c->Start();
  if (what == kRefuse) c->Refuse();
  Accept();
}

void HttpServer::Impl::Remove(Connection* c) {
  std::shared_ptr<Connection> last;  // released outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = connections_.find(c);
  if (it == connections_.end()) return;
  if (c->refused()) --refusing_;
  last = std::move(it->second);
  connections_.erase(it);
}

bool HttpServer::Impl::Drain(int64_t timeout_ms) {
  {
    std::lock_guard<std::mutex> stop_lock(stop_mu_);
    if (stopped_) return true;
    draining_ = true;
  }
  // The acceptor belongs to its strand while io threads run.
  net::post(acceptor_.get_executor(), [this] {
    error_code ignored;
    acceptor_.close(ignored);
    accept_retry_.cancel();
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    bool busy = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [ptr, c] : connections_)
        if (c->busy()) {
          busy = true;
          break;
        }
    }
    if (!busy) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void HttpServer::Impl::Stop() {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  {
    // From here on no responder touches the io_context.
    std::lock_guard<std::mutex> lock(gate_->mu);
    gate_->open = false;
  }
  work_.reset();
  ioc_.stop();
  for (auto& t : threads_) t.join();
  threads_.clear();
  // No io thread runs any more, so sockets can be closed from here.
  error_code ignored;
  acceptor_.close(ignored);
  accept_retry_.cancel();
  std::unordered_map<Connection*, std::shared_ptr<Connection>> connections;
  {
    std::lock_guard<std::mutex> lock(mu_);
    connections.swap(connections_);
  }
  for (auto& [ptr, c] : connections) c->CloseNow();
  // Producers still streaming into a closed connection stop at their next
  // Write(); see Connection::CloseNow.
  // Handlers still queued on ioc_ keep some connections alive; ioc_'s
  // destructor frees them.
}

Status HttpServerOptions::Validate() const {
  if (host.empty()) return InvalidArgument("http host is empty");
  if (port < 0 || port > 65535)
    return InvalidArgument("http port " + std::to_string(port) + " is not in 0..65535");
  if (threads < 1 || threads > 1024)
    return InvalidArgument("http threads must be in 1..1024, got " +
                           std::to_string(threads));
  if (max_body_bytes == 0) return InvalidArgument("http max_body_bytes must be positive");
  if (idle_timeout_ms <= 0) return InvalidArgument("http idle_timeout_ms must be positive");
  if (max_connections < 1) return InvalidArgument("http max_connections must be positive");
  if (read_timeout_ms <= 0) return InvalidArgument("http read_timeout_ms must be positive");
  return Status::Ok();
}

Result<std::unique_ptr<HttpServer>> HttpServer::Create(const HttpServerOptions& options,
                                                       HttpHandler handler) {
  RETURN_IF_ERROR(options.Validate());
  if (!handler) return InvalidArgument("http handler is empty");
  auto impl = std::make_unique<Impl>(options, std::move(handler));
  RETURN_IF_ERROR(impl->Listen());
  impl->Start();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

Status HttpServer::CheckAddress(const HttpServerOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  net::io_context ioc;
  tcp::acceptor acceptor(ioc);
  int port = 0;
  return OpenListener(ioc, acceptor, options, &port);  // closed again as it goes
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port(); }

bool HttpServer::Drain(int64_t timeout_ms) { return impl_->Drain(timeout_ms); }
void HttpServer::Stop() { impl_->Stop(); }

}  // namespace shoal
