#include "gateway/http_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "support/test_env.h"

namespace shoal {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using beast::error_code;
using ::testing::HasSubstr;

using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

// A blocking HTTP client on its own io_context. Every operation gives up
// after a few seconds, so a server bug fails the test instead of hanging it.
class Client {
 public:
  explicit Client(int port) : stream_(ioc_) {
    stream_.expires_after(kTimeout);
    stream_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"),
                                  static_cast<unsigned short>(port)));
  }

  static Request Get(std::string target, unsigned version = 11) {
    Request req(http::verb::get, target, version);
    req.set(http::field::host, "127.0.0.1");
    return req;
  }

  static Request Post(std::string target, std::string body) {
    Request req(http::verb::post, target, 11);
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    req.body() = std::move(body);
    req.prepare_payload();
    return req;
  }

  error_code Write(Request req) {
    error_code result;
    stream_.expires_after(kTimeout);
    http::async_write(stream_, req, [&](error_code ec, size_t) { result = ec; });
    Run();
    return result;
  }

  error_code WriteRaw(std::string data) {
    error_code result;
    stream_.expires_after(kTimeout);
    net::async_write(stream_, net::buffer(data), [&](error_code ec, size_t) { result = ec; });
    Run();
    return result;
  }

  // Reads one response; on failure, status 0 and the error in *ec.
  Response Read(error_code* ec_out = nullptr, bool after_head = false) {
    http::response_parser<http::string_body> parser;
    parser.body_limit(boost::none);
    parser.skip(after_head);
    error_code result;
    stream_.expires_after(kTimeout);
    http::async_read(stream_, buffer_, parser, [&](error_code ec, size_t) { result = ec; });
    Run();
    if (ec_out) *ec_out = result;
    if (result) return Response();
    return parser.release();
  }

  Response RoundTrip(Request req) {
    error_code ec = Write(std::move(req));
    EXPECT_FALSE(ec) << ec.message();
    Response res = Read(&ec);
    EXPECT_FALSE(ec) << ec.message();
    return res;
  }

  // True once the server closed its side (EOF or reset); false on data or
  // timeout.
  bool PeerClosed() {
    if (buffer_.size() > 0) return false;
    char byte;
    error_code result;
    stream_.expires_after(kTimeout);
    stream_.async_read_some(net::buffer(&byte, 1),
                            [&](error_code ec, size_t) { result = ec; });
    Run();
    return result == net::error::eof || result == net::error::connection_reset;
  }

  // Closes the sending side only (the answer can still be read).
  void CloseSending() {
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  void Close() {
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

 private:
  static constexpr std::chrono::seconds kTimeout{10};

  void Run() {
    ioc_.restart();
    ioc_.run();
  }

  net::io_context ioc_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
};

// Answers with a description of the request.
void Echo(HttpRequest&& req, HttpResponder respond) {
  HttpResponse res;
  res.content_type = "text/plain";
  res.body = req.method + " " + req.path + " q=" + req.query +
             " x-test=" + std::string(req.Header("x-test")) + " body=" + req.body;
  respond(std::move(res));
}

std::unique_ptr<HttpServer> Start(HttpHandler handler, HttpServerOptions options = {}) {
  auto server = HttpServer::Create(options, std::move(handler));
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  if (!server.ok()) return nullptr;
  return std::move(server).value();
}

// Answers 200 with no body and counts the requests it was handed.
HttpHandler CountingOk(int* calls) {
  return [calls](HttpRequest&&, HttpResponder respond) {
    ++*calls;
    respond(HttpResponse{});
  };
}

nlohmann::json ErrorOf(const Response& res) {
  return nlohmann::json::parse(res.body(), nullptr, /*allow_exceptions=*/false)["error"];
}

// Responders the handler parked, for a test to complete later.
class ParkedResponders {
 public:
  void Park(HttpResponder r, std::shared_ptr<ClientPresence> client = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    parked_.push_back({std::move(r), std::move(client)});
    cv_.notify_all();
  }

  // Waits for the next parked responder; empty after 10 s. `client` (may
  // be null) gets its request's ClientPresence.
  HttpResponder Take(std::shared_ptr<ClientPresence>* client = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return !parked_.empty(); });
    if (parked_.empty()) return nullptr;
    auto [r, c] = std::move(parked_.front());
    parked_.pop_front();
    if (client) *client = std::move(c);
    return r;
  }

  HttpHandler Handler() {
    return [this](HttpRequest&& req, HttpResponder r) { Park(std::move(r), std::move(req.client)); };
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<HttpResponder, std::shared_ptr<ClientPresence>>> parked_;  // guarded by mu_
};

// A request on a new connection is still handed over and answered.
void ExpectStillServing(HttpServer& server, ParkedResponders& parked) {
  Client client(server.port());
  ASSERT_FALSE(client.Write(Client::Get("/")));
  HttpResponder respond = parked.Take();
  ASSERT_TRUE(respond);
  respond(HttpResponse{});
  EXPECT_EQ(client.Read().result_int(), 200);
}

TEST(HttpServer, ServesManyRequestsOnOneKeepAliveConnection) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  for (int i = 0; i < 100; ++i) {
    Request req = Client::Get("/v1/models?i=" + std::to_string(i));
    req.set("X-Test", "yes");
    Response res = client.RoundTrip(std::move(req));
    ASSERT_EQ(res.result_int(), 200);
    EXPECT_EQ(res.body(), "GET /v1/models q=i=" + std::to_string(i) + " x-test=yes body=");
    EXPECT_EQ(res[http::field::server], "shoal");
    EXPECT_EQ(res[http::field::content_type], "text/plain");
    EXPECT_TRUE(res.keep_alive());
  }
}

TEST(HttpServer, PassesBodyAndSetsStatusAndExtraHeaders) {
  auto server = Start([](HttpRequest&& req, HttpResponder respond) {
    HttpResponse res;
    res.status = 201;
    res.body = req.body;
    res.headers = {{"X-Request-Id", "abc"}, {"Cache-Control", "no-store"}};
    respond(std::move(res));
  });
  ASSERT_TRUE(server);
  Client client(server->port());
  Response res = client.RoundTrip(Client::Post("/v1/embeddings", R"({"input":"hi"})"));
  EXPECT_EQ(res.result_int(), 201);
  EXPECT_EQ(res.body(), R"({"input":"hi"})");
  EXPECT_EQ(res[http::field::content_type], "application/json");
  EXPECT_EQ(res["X-Request-Id"], "abc");
  EXPECT_EQ(res[http::field::cache_control], "no-store");
}

TEST(HttpServer, LowerCasesHeaderNames) {
  std::vector<std::pair<std::string, std::string>> seen;
  auto server = Start([&](HttpRequest&& req, HttpResponder respond) {
    seen = req.headers;
    respond(HttpResponse{});
  });
  ASSERT_TRUE(server);
  Client client(server->port());
  Request req = Client::Get("/");
  req.set("X-Mixed-Case", "Value");
  client.RoundTrip(std::move(req));
  EXPECT_THAT(seen, ::testing::Contains(std::pair<std::string, std::string>(
                        "x-mixed-case", "Value")));
  EXPECT_THAT(seen, ::testing::Contains(std::pair<std::string, std::string>(
                        "host", "127.0.0.1")));
}

// A target in absolute form (as sent to a proxy) reaches the handler as
// its path and query, whatever the scheme's case; "http://host" is "/".
TEST(HttpServer, AbsoluteFormTargetsArePathAndQuery) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  EXPECT_EQ(client.RoundTrip(Client::Get("http://127.0.0.1:8080/v1/models?a=b")).body(),
            "GET /v1/models q=a=b x-test= body=");
  EXPECT_EQ(client.RoundTrip(Client::Get("HTTPS://example.com")).body(), "GET / q= x-test= body=");
  EXPECT_EQ(client.RoundTrip(Client::Get("http://example.com?x=1")).body(), "GET / q=x=1 x-test= body=");
  EXPECT_EQ(client.RoundTrip(Client::Get("/p://q")).body(), "GET /p://q q= x-test= body=");
}

TEST(HttpServer, ClosesWhenTheRequestAsksTo) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  Request req = Client::Get("/");
  req.keep_alive(false);
  Response res = client.RoundTrip(std::move(req));
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_FALSE(res.keep_alive());
  EXPECT_TRUE(client.PeerClosed());
}

TEST(HttpServer, ClosesWhenTheHandlerAsksTo) {
  auto server = Start([](HttpRequest&&, HttpResponder respond) {
    HttpResponse res;
    res.headers = {{"Connection", "close"}};
    respond(std::move(res));
  });
  ASSERT_TRUE(server);
  Client client(server->port());
  Response res = client.RoundTrip(Client::Get("/"));
  EXPECT_FALSE(res.keep_alive());
  EXPECT_TRUE(client.PeerClosed());
}

TEST(HttpServer, Http10ClosesUnlessKeepAliveIsAsked) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  {
    Client client(server->port());
    Response res = client.RoundTrip(Client::Get("/a", 10));
    EXPECT_EQ(res.version(), 10u);
    EXPECT_EQ(res.body(), "GET /a q= x-test= body=");
    EXPECT_TRUE(client.PeerClosed());
  }
  {
    Client client(server->port());
    Request req = Client::Get("/b", 10);
    req.keep_alive(true);
    Response res = client.RoundTrip(req);
    EXPECT_TRUE(res.keep_alive());
    res = client.RoundTrip(req);
    EXPECT_EQ(res.result_int(), 200);
  }
}

TEST(HttpServer, AnswersPipelinedRequestsInOrder) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw(
      "GET /one HTTP/1.1\r\nHost: x\r\n\r\n"
      "POST /two HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
      "GET /three HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(client.Read().body(), "GET /one q= x-test= body=");
  EXPECT_EQ(client.Read().body(), "POST /two q= x-test= body=abc");
  EXPECT_EQ(client.Read().body(), "GET /three q= x-test= body=");
}

TEST(HttpServer, ReadsChunkedBodies) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw(
      "POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
      "3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"));
  EXPECT_EQ(client.Read().body(), "POST /c q= x-test= body=abcde");
}

TEST(HttpServer, HeadResponsesCarryNoBody) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  Request head = Client::Get("/h");
  head.method(http::verb::head);
  ASSERT_FALSE(client.Write(head));
  error_code ec;
  Response res = client.Read(&ec, /*after_head=*/true);
  ASSERT_FALSE(ec) << ec.message();
  EXPECT_EQ(res[http::field::content_length], "24");  // "HEAD /h q= x-test= body="
  EXPECT_EQ(client.RoundTrip(Client::Get("/g")).body(), "GET /g q= x-test= body=");
}

TEST(HttpServer, SendsContinueBeforeTheBodyWhenAsked) {
  auto server = Start(Echo);
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw(
      "POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"));
  EXPECT_EQ(client.Read().result_int(), 100);
  ASSERT_FALSE(client.WriteRaw("hello"));
  Response res = client.Read();
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(res.body(), "POST /e q= x-test= body=hello");
}

TEST(HttpServer, RespondsFromAnotherThreadLater) {
  ParkedResponders parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.Write(Client::Get("/slow")));
  HttpResponder respond = parked.Take();
  ASSERT_TRUE(respond);
  std::thread other([respond = std::move(respond)] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    HttpResponse res;
    res.body = "late";
    respond(std::move(res));
  });
  Response res = client.Read();
  other.join();
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(res.body(), "late");
  EXPECT_TRUE(res.keep_alive());
}

TEST(HttpServer, IgnoresASecondResponse) {
  int calls = 0;
  auto server = Start([&](HttpRequest&& req, HttpResponder respond) {
    ++calls;
    HttpResponse first;
    first.body = "first " + req.path;
    respond(std::move(first));
    HttpResponse second;
    second.body = "second " + req.path;
    respond(std::move(second));
  });
  ASSERT_TRUE(server);
  Client client(server->port());
  EXPECT_EQ(client.RoundTrip(Client::Get("/1")).body(), "first /1");
  EXPECT_EQ(client.RoundTrip(Client::Get("/2")).body(), "first /2");
  EXPECT_EQ(calls, 2);
}

TEST(HttpServer, DroppedResponderAnswers500) {
  auto server = Start([](HttpRequest&&, HttpResponder) {});
  ASSERT_TRUE(server);
  Client client(server->port());
  Response res = client.RoundTrip(Client::Get("/"));
  EXPECT_EQ(res.result_int(), 500);
  EXPECT_EQ(ErrorOf(res)["code"], "internal_error");
}

TEST(HttpServer, ResponderAfterTheClientLeftIsDropped) {
  ParkedResponders parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  {
    Client client(server->port());
    ASSERT_FALSE(client.Write(Client::Get("/")));
    HttpResponder respond = parked.Take();
    ASSERT_TRUE(respond);
    client.Close();
    respond(HttpResponse{});
  }
  ExpectStillServing(*server, parked);
}

// A client that closes the connection while its answer is awaited is gone
// at once (the handler can stop the work), not when the answer is written.
TEST(HttpServer, AClientThatLeavesBeforeItsAnswerIsGone) {
  ParkedResponders parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.Write(Client::Get("/")));
  std::shared_ptr<ClientPresence> presence;
  HttpResponder respond = parked.Take(&presence);
  ASSERT_TRUE(respond);
  ASSERT_TRUE(presence);
  std::atomic<int> told{0};
  presence->OnGone([&] { ++told; });
  EXPECT_FALSE(presence->gone());
  client.Close();
  EXPECT_TRUE(shoal::testing::Eventually([&] { return told.load() == 1; }));
  EXPECT_TRUE(presence->gone());
  presence->OnGone([&] { told += 10; });  // gone already: at once
  EXPECT_EQ(told.load(), 11);
  respond(HttpResponse{});
  ExpectStillServing(*server, parked);
}

// A client that closes its sending side once its request is sent counts
// as gone; with watch_clients off nothing is watched (the request carries
// no presence) and it gets its answer.
TEST(HttpServer, AHalfClosingClientIsGoneUnlessClientsAreNotWatched) {
  for (const bool watch : {true, false}) {
    SCOPED_TRACE(watch ? "watched" : "not watched");
    ParkedResponders parked;
    HttpServerOptions options;
    options.watch_clients = watch;
    auto server = Start(parked.Handler(), options);
    ASSERT_TRUE(server);
    Client client(server->port());
    ASSERT_FALSE(client.Write(Client::Get("/")));
    client.CloseSending();
    std::shared_ptr<ClientPresence> presence;
    HttpResponder respond = parked.Take(&presence);
    ASSERT_TRUE(respond);
    if (watch) {
      ASSERT_TRUE(presence);
      EXPECT_TRUE(shoal::testing::Eventually([&] { return presence->gone(); }));
    } else {
      EXPECT_FALSE(presence);
    }
    HttpResponse late;
    late.body = "late";
    respond(std::move(late));
    if (!watch) {
      error_code ec;
      const auto res = client.Read(&ec);
      EXPECT_FALSE(ec) << ec.message();
      EXPECT_EQ(res.body(), "late");
    }
  }
}

// A client that read its answer is never gone for that request, also when
// it closes later; its next request on the connection is served, and a
// request sent before the answer to the last one (pipelined) is no sign of
// leaving.
TEST(HttpServer, AnAnsweredOrPipeliningClientIsNotGone) {
  ParkedResponders parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  Client client(server->port());
  std::vector<std::shared_ptr<ClientPresence>> presences(4);
  for (int i = 0; i < 2; ++i) {  // one at a time on the connection
    ASSERT_FALSE(client.Write(Client::Get("/")));
    HttpResponder respond = parked.Take(&presences[i]);
    ASSERT_TRUE(respond);
    respond(HttpResponse{});
    EXPECT_EQ(client.Read().result_int(), 200);
  }
  ASSERT_FALSE(client.Write(Client::Get("/a")));
  HttpResponder first = parked.Take(&presences[2]);
  ASSERT_TRUE(first);
  // The next request arrives while the first waits for its answer: bytes
  // the server has not read yet.
  ASSERT_FALSE(client.Write(Client::Get("/b")));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // time to (wrongly) see them as a close
  EXPECT_FALSE(presences[2]->gone());
  first(HttpResponse{});
  HttpResponder second = parked.Take(&presences[3]);
  ASSERT_TRUE(second);
  second(HttpResponse{});
  EXPECT_EQ(client.Read().result_int(), 200);
  EXPECT_EQ(client.Read().result_int(), 200);
  client.Close();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (size_t i = 0; i < presences.size(); ++i) {
    ASSERT_TRUE(presences[i]) << i;
    EXPECT_FALSE(presences[i]->gone()) << "request " << i << " was answered";
  }
}

TEST(HttpServer, ResponderAfterTheServerIsGoneIsDropped) {
  ParkedResponders parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.Write(Client::Get("/")));
  HttpResponder respond = parked.Take();
  ASSERT_TRUE(respond);
  server.reset();
  EXPECT_TRUE(client.PeerClosed());
  respond(HttpResponse{});  // no effect, no crash
}

TEST(HttpServer, HandlerExceptionBecomes500) {
  auto server = Start([](HttpRequest&&, HttpResponder) -> void {
    throw std::runtime_error("boom");
  });
  ASSERT_TRUE(server);
  Client client(server->port());
  Response res = client.RoundTrip(Client::Get("/"));
  EXPECT_EQ(res.result_int(), 500);
  EXPECT_EQ(res[http::field::content_type], "application/json");
  nlohmann::json error = ErrorOf(res);
  EXPECT_EQ(error["type"], "server_error");
  EXPECT_EQ(error["code"], "internal_error");
  EXPECT_THAT(error["message"].get<std::string>(), HasSubstr("boom"));
  // The connection survives a handler failure.
  EXPECT_EQ(client.RoundTrip(Client::Get("/")).result_int(), 500);
}

// What the server refuses itself reaches on_refused (the gateway's
// metrics), with its status and code.
struct Refusals {
  std::mutex mu;
  std::vector<std::pair<int, std::string>> seen;
  void Hook(HttpServerOptions& options) {
    options.on_refused = [this](int status, std::string_view code) {
      std::lock_guard<std::mutex> lock(mu);
      seen.emplace_back(status, std::string(code));
    };
  }
  size_t Count(int status, const std::string& code) {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<size_t>(std::count(seen.begin(), seen.end(), std::make_pair(status, code)));
  }
};

TEST(HttpServer, BodyOverTheLimitIs413AndCloses) {
  int calls = 0;
  Refusals refusals;
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  refusals.Hook(options);
  auto server = Start(CountingOk(&calls), options);
  ASSERT_TRUE(server);
  {
    Client client(server->port());
    Response res = client.RoundTrip(Client::Post("/", std::string(1024, 'a')));
    EXPECT_EQ(res.result_int(), 200);
  }
  const std::string expected =
      R"({"error":{"message":"request body exceeds 1024 bytes",)"
      R"("type":"invalid_request_error","param":null,"code":"payload_too_large"}})";
  {
    Client client(server->port());
    Response res = client.RoundTrip(Client::Post("/", std::string(64 * 1024, 'a')));
    EXPECT_EQ(res.result_int(), 413);
    EXPECT_EQ(res[http::field::content_type], "application/json");
    EXPECT_EQ(res.body(), expected);
    EXPECT_FALSE(res.keep_alive());
    EXPECT_TRUE(client.PeerClosed());
  }
  {
    // Without a Content-Length the limit trips while reading chunks.
    Client client(server->port());
    ASSERT_FALSE(client.WriteRaw(
        "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        "400\r\n" + std::string(1024, 'a') + "\r\n"
        "1\r\nb\r\n0\r\n\r\n"));
    Response res = client.Read();
    EXPECT_EQ(res.result_int(), 413);
    EXPECT_EQ(res.body(), expected);
    EXPECT_TRUE(client.PeerClosed());
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(refusals.Count(413, "payload_too_large"), 2u);
}

// Bodies still arriving count against max_receiving_bytes, all connections
// together, by what has come of them, not what their headers declare, so a
// client that declares a large body and trickles it holds little. A request with no room
// left is 503 server_busy with Retry-After and closes; room comes back once
// a body is handed over or its connection goes.
TEST(HttpServer, BodiesArrivingPastTheServersBoundAre503) {
  int calls = 0;
  HttpServerOptions options;
  options.max_body_bytes = 100000;
  options.max_receiving_bytes = 150000;
  Refusals refusals;
  refusals.Hook(options);
  auto server = Start(CountingOk(&calls), options);
  ASSERT_TRUE(server);
  const auto head = [](size_t length) {
    return "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(length) + "\r\n\r\n";
  };
  auto busy = [](Client& c) {
    Response res = c.Read();
    EXPECT_EQ(res.result_int(), 503);
    EXPECT_EQ(ErrorOf(res)["code"], "server_busy");
    EXPECT_EQ(res[http::field::retry_after], "1");
    EXPECT_TRUE(c.PeerClosed());
  };
  // Lets the server read what was sent before the next connection's come.
  const auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); };

  // Two uploads that each declare the largest body and have sent 10 bytes
  // hold 10 bytes each, not 100000: both go on and are served.
  Client slow(server->port());
  ASSERT_FALSE(slow.WriteRaw(head(100000) + std::string(10, 'a')));
  settle();
  {
    Client trickle(server->port());
    ASSERT_FALSE(trickle.WriteRaw(head(100000) + std::string(10, 'b')));
    settle();
    ASSERT_FALSE(trickle.WriteRaw(std::string(99990, 'b')));
    EXPECT_EQ(trickle.Read().result_int(), 200);
  }
  // 90000 of slow's have come: at least 90000 held.
  ASSERT_FALSE(slow.WriteRaw(std::string(89990, 'a')));
  settle();
  {
    Client second(server->port());  // 61000 come: past 150000 together
    ASSERT_FALSE(second.WriteRaw(head(70000) + std::string(61000, 'c')));
    busy(second);
  }
  {
    // Chunked: counted as it comes; the second chunk passes the bound.
    Client chunked(server->port());
    ASSERT_FALSE(chunked.WriteRaw("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  "9c40\r\n" + std::string(40000, 'c') + "\r\n"));
    ASSERT_FALSE(chunked.WriteRaw("9c40\r\n" + std::string(40000, 'c') + "\r\n"));
    busy(chunked);
  }
  // The slow upload finishes: handed over, its room comes back.
  ASSERT_FALSE(slow.WriteRaw(std::string(10000, 'a')));
  EXPECT_EQ(slow.Read().result_int(), 200);
  {
    Client second(server->port());
    ASSERT_FALSE(second.WriteRaw(head(70000) + std::string(61000, 'd')));
    settle();
    ASSERT_FALSE(second.WriteRaw(std::string(9000, 'd')));
    EXPECT_EQ(second.Read().result_int(), 200);
  }
  // A connection that leaves mid-body gives its room back too.
  {
    Client leaving(server->port());
    ASSERT_FALSE(leaving.WriteRaw(head(100000) + std::string(90000, 'x')));
    settle();
    ASSERT_TRUE(shoal::testing::Eventually([&] {
      Client probe(server->port());
      probe.WriteRaw(head(70000) + std::string(61000, 'p'));
      return probe.Read().result_int() == 503;
    }));
    leaving.Close();
  }
  EXPECT_TRUE(shoal::testing::Eventually([&] {
    Client probe(server->port());
    return probe.RoundTrip(Client::Post("/", std::string(100000, 'e'))).result_int() == 200;
  }));
  EXPECT_EQ(calls, 4);
  EXPECT_GE(refusals.Count(503, "server_busy"), 3u);  // second, chunked, and the probe(s)
}

// A handler's answer HTTP cannot carry (no final status, or a body on 204
// or 304) is a 500, not an exception that ends the process.
TEST(HttpServer, AnAnswerHttpCannotCarryIs500) {
  auto server = Start([](HttpRequest&& req, HttpResponder respond) {
    HttpResponse r;
    r.status = std::stoi(req.path.substr(1, 3));
    r.body = req.path.size() > 4 ? "body" : "";
    respond(std::move(r));
  });
  ASSERT_TRUE(server);
  Client client(server->port());
  EXPECT_EQ(client.RoundTrip(Client::Get("/100")).result_int(), 500);
  EXPECT_EQ(client.RoundTrip(Client::Get("/204/b")).result_int(), 500);
  EXPECT_EQ(client.RoundTrip(Client::Get("/304/b")).result_int(), 500);
  EXPECT_EQ(client.RoundTrip(Client::Get("/204")).result_int(), 204);
  EXPECT_EQ(client.RoundTrip(Client::Get("/200/b")).result_int(), 200);
}

// A chunk-size line or a trailer that never ends is refused once it is
// longer than a header line may be, not buffered for as long as the client
// sends (the body limit counts chunk data only).
TEST(HttpServer, AnEndlessChunkSizeLineOrTrailerIs400AndCloses) {
  int calls = 0;
  auto server = Start(CountingOk(&calls));
  ASSERT_TRUE(server);
  for (const std::string& head : {std::string("1;"), std::string("1\r\nb\r\n0\r\nX-Trailer: ")}) {
    Client client(server->port());
    ASSERT_FALSE(client.WriteRaw("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + head));
    // 1 MiB without a line end, a piece at a time; the server answers and
    // closes well before all of it is sent, so later writes may fail.
    for (int i = 0; i < 16; ++i)
      if (client.WriteRaw(std::string(64 * 1024, 'a'))) break;
    Response res = client.Read();
    EXPECT_EQ(res.result_int(), 400) << head;
    EXPECT_EQ(ErrorOf(res)["code"], "malformed_request");
    EXPECT_TRUE(client.PeerClosed());
  }
  EXPECT_EQ(calls, 0);
}

TEST(HttpServer, MalformedRequestIs400AndCloses) {
  int calls = 0;
  auto server = Start(CountingOk(&calls));
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw("\x01\x02garbage \xff\xfe\r\n\r\n"));
  Response res = client.Read();
  EXPECT_EQ(res.result_int(), 400);
  EXPECT_EQ(res[http::field::content_type], "application/json");
  nlohmann::json error = ErrorOf(res);
  EXPECT_EQ(error["type"], "invalid_request_error");
  EXPECT_EQ(error["code"], "malformed_request");
  EXPECT_THAT(error["message"].get<std::string>(), HasSubstr("malformed HTTP request"));
  EXPECT_TRUE(client.PeerClosed());
  EXPECT_EQ(calls, 0);
}

// Only HTTP/1.x is served: an h2c preface or an HTTP/2.0 or 0.9 request
// line is 400, as docs/api.md says, and never reaches a handler.
TEST(HttpServer, OnlyHttp1IsServed) {
  int calls = 0;
  auto server = Start(CountingOk(&calls));
  ASSERT_TRUE(server);
  for (const std::string line : {"GET /x HTTP/2.0", "PRI * HTTP/2.0", "GET /x HTTP/0.9"}) {
    SCOPED_TRACE(line);
    Client client(server->port());
    ASSERT_FALSE(client.WriteRaw(line + "\r\nHost: a\r\n\r\n"));
    Response res = client.Read();
    EXPECT_EQ(res.result_int(), 400);
    EXPECT_EQ(res.version(), 11u);
    EXPECT_EQ(ErrorOf(res)["code"], "malformed_request");
    EXPECT_TRUE(client.PeerClosed());
  }
  EXPECT_EQ(calls, 0);
}

// A transfer coding other than chunked: the body's length cannot be told
// (400) or its coding is not decoded (501); either way the connection
// closes, and what follows is never read as another request.
TEST(HttpServer, TransferCodingsOtherThanChunkedAreRefusedAndClose) {
  int calls = 0;
  auto server = Start(CountingOk(&calls));
  ASSERT_TRUE(server);
  const std::pair<std::string, int> cases[] = {{"gzip", 400}, {"gzip, chunked", 501}};
  for (const auto& [coding, status] : cases) {
    Client client(server->port());
    ASSERT_FALSE(client.WriteRaw("POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding +
                                 "\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"));
    Response res = client.Read();
    EXPECT_EQ(res.result_int(), status) << coding;
    EXPECT_EQ(ErrorOf(res)["code"], "unsupported_transfer_encoding") << coding;
    EXPECT_FALSE(res.keep_alive());
    EXPECT_TRUE(client.PeerClosed()) << coding;
  }
  EXPECT_EQ(calls, 0);
  // Chunked still works.
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw("POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                               "2\r\nhi\r\n0\r\n\r\n"));
  EXPECT_EQ(client.Read().result_int(), 200);
  EXPECT_EQ(calls, 1);
}

TEST(HttpServer, ClosesIdleConnections) {
  HttpServerOptions options;
  options.idle_timeout_ms = 50;
  auto server = Start(Echo, options);
  ASSERT_TRUE(server);
  Client client(server->port());
  EXPECT_EQ(client.RoundTrip(Client::Get("/")).result_int(), 200);
  EXPECT_TRUE(client.PeerClosed());
}

// Past max_connections (idle ones count), a new connection is answered 503
// server_busy without its request being read, then closed; once one
// closes, there is room.
TEST(HttpServer, ConnectionsPastTheLimitAre503AndClosed) {
  HttpServerOptions options;
  options.max_connections = 2;
  int calls = 0;
  auto server = Start(CountingOk(&calls), options);
  ASSERT_TRUE(server);
  auto first = std::make_unique<Client>(server->port());
  Client second(server->port());
  EXPECT_EQ(first->RoundTrip(Client::Get("/")).result_int(), 200);
  EXPECT_EQ(second.RoundTrip(Client::Get("/")).result_int(), 200);
  Client third(server->port());
  ASSERT_FALSE(third.WriteRaw("GET / HTTP/1.1\r\nHost: x\r\n\r\n"));  // unread: the answer still arrives
  Response res = third.Read();
  EXPECT_EQ(res.result_int(), 503);
  EXPECT_EQ(res[http::field::retry_after], "1");
  EXPECT_EQ(ErrorOf(res)["code"], "server_busy");
  EXPECT_TRUE(third.PeerClosed());
  EXPECT_EQ(calls, 2);
  first.reset();
  ASSERT_TRUE(shoal::testing::Eventually([&] {
    Client next(server->port());
    return next.RoundTrip(Client::Get("/")).result_int() == 200;
  }));
}

// Refused connections hold a descriptor while their 503 drains: at most 64
// at a time are answered; more are closed unanswered.
TEST(HttpServer, OnlyAFewRefusedConnectionsAreAnsweredAtOnce) {
  HttpServerOptions options;
  options.max_connections = 1;
  auto server = Start(Echo, options);
  ASSERT_TRUE(server);
  Client held(server->port());
  EXPECT_EQ(held.RoundTrip(Client::Get("/")).result_int(), 200);
  std::vector<std::unique_ptr<Client>> refused;
  for (int i = 0; i < 80; ++i) refused.push_back(std::make_unique<Client>(server->port()));
  int answered = 0, dropped = 0;
  for (auto& c : refused) {
    error_code ec;
    Response res = c->Read(&ec);
    if (!ec && res.result_int() == 503) ++answered;
    else ++dropped;
  }
  EXPECT_GE(answered, 1);
  EXPECT_LE(answered, 64);
  EXPECT_EQ(answered + dropped, 80);
  EXPECT_GE(dropped, 16);
}

TEST(HttpServer, ClosesConnectionsThatStallMidRequest) {
  HttpServerOptions options;
  options.read_timeout_ms = 50;
  auto server = Start(Echo, options);
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw("GET / HTTP/1.1\r\nHost: x\r\n"));
  EXPECT_TRUE(client.PeerClosed());
}

// Headers trickled in a byte at a time, each well within the timeout,
// still have the timeout in all (no connection held open for ever). The
// bytes keep coming until the server closes: a per-read timeout would
// never fire.
TEST(HttpServer, HeadersHaveTheReadTimeoutInAllNotPerRead) {
  HttpServerOptions options;
  options.read_timeout_ms = 300;
  int calls = 0;
  auto server = Start(CountingOk(&calls), options);
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.WriteRaw("GET / HTTP/1.1\r\n"));
  bool closed = false;
  for (int i = 0; i < 200 && !closed; ++i) {  // up to 200 x 50 ms = 10 s
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    closed = static_cast<bool>(client.WriteRaw("X"));
  }
  EXPECT_TRUE(closed) << "a trickle of header bytes kept the connection open";
  EXPECT_EQ(calls, 0);
}

TEST(HttpServer, StopClosesOpenConnections) {
  ParkedResponders parked;
  auto server = Start([&](HttpRequest&& req, HttpResponder respond) {
    if (req.path == "/park") return parked.Park(std::move(respond));
    respond(HttpResponse{});
  });
  ASSERT_TRUE(server);
  Client idle(server->port());
  EXPECT_EQ(idle.RoundTrip(Client::Get("/")).result_int(), 200);
  Client waiting(server->port());
  ASSERT_FALSE(waiting.Write(Client::Get("/park")));
  HttpResponder pending = parked.Take();  // held, so no 500 goes out
  ASSERT_TRUE(pending);
  server->Stop();
  EXPECT_TRUE(idle.PeerClosed());
  EXPECT_TRUE(waiting.PeerClosed());
  server->Stop();  // idempotent
}

// A drain waits for the answers of requests in flight, writes them with
// "Connection: close", still serves requests on open connections, refuses
// new connections, and gives up at its bound.
TEST(HttpServer, DrainWaitsForTheAnswersInFlightThenStopCloses) {
  ParkedResponders parked;
  auto server = Start([&](HttpRequest&& req, HttpResponder respond) {
    if (req.path == "/park") return parked.Park(std::move(respond));
    respond(HttpResponse{});
  });
  ASSERT_TRUE(server);
  const int port = server->port();
  Client idle(port);
  EXPECT_EQ(idle.RoundTrip(Client::Get("/")).result_int(), 200);
  Client waiting(port);
  ASSERT_FALSE(waiting.Write(Client::Get("/park")));
  HttpResponder pending = parked.Take();
  ASSERT_TRUE(pending);
  // Nothing answers it: the drain gives up at its bound.
  EXPECT_FALSE(server->Drain(50));
  std::thread answer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    HttpResponse res;
    res.status = 503;
    res.body = "bye";
    pending(std::move(res));
  });
  EXPECT_TRUE(server->Drain(10000));
  answer.join();
  Response res = waiting.Read();
  EXPECT_EQ(res.result_int(), 503);
  EXPECT_EQ(res.body(), "bye");
  EXPECT_FALSE(res.keep_alive());
  EXPECT_TRUE(waiting.PeerClosed());
  // An open keep-alive connection is still served (and then closed).
  Response late = idle.RoundTrip(Client::Get("/"));
  EXPECT_EQ(late.result_int(), 200);
  EXPECT_FALSE(late.keep_alive());
  // No new connection is accepted.
  {
    net::io_context ioc;
    tcp::socket s(ioc);
    error_code ec;
    s.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)), ec);
    EXPECT_TRUE(ec) << "connected to a draining server";
  }
  server->Stop();
  EXPECT_TRUE(server->Drain(10));  // after Stop: nothing to wait for
}

// A request whose body is still arriving when the drain starts is waited
// for too: it is handled and answered once complete.
TEST(HttpServer, DrainWaitsForARequestStillArriving) {
  int calls = 0;
  auto server = Start(CountingOk(&calls));
  ASSERT_TRUE(server);
  Client client(server->port());
  // Accepted (a drain refuses connections not yet accepted) ...
  EXPECT_EQ(client.RoundTrip(Client::Get("/")).result_int(), 200);
  ASSERT_FALSE(client.WriteRaw("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello"));
  // ... and the server has read the first bytes of the second request.
  ASSERT_TRUE(shoal::testing::Eventually([&] { return !server->Drain(1); }));
  auto drained = std::async(std::launch::async, [&] { return server->Drain(10000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_FALSE(client.WriteRaw("world"));
  Response res = client.Read();
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_FALSE(res.keep_alive());
  EXPECT_TRUE(drained.get());
  EXPECT_EQ(calls, 2);
  server->Stop();
}

TEST(HttpServer, PortZeroPicksDistinctFreePorts) {
  auto a = Start(Echo);
  auto b = Start(Echo);
  ASSERT_TRUE(a && b);
  EXPECT_GT(a->port(), 0);
  EXPECT_GT(b->port(), 0);
  EXPECT_NE(a->port(), b->port());
}

TEST(HttpServer, BindingAPortInUseFails) {
  auto a = Start(Echo);
  ASSERT_TRUE(a);
  HttpServerOptions options;
  options.port = a->port();
  auto b = HttpServer::Create(options, Echo);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(b.status().message(), HasSubstr(std::to_string(a->port())));
  EXPECT_THAT(b.status().message(), HasSubstr("in use"));
  // CheckAddress says the same without keeping the address; a free one
  // passes and stays free.
  EXPECT_EQ(HttpServer::CheckAddress(options).message(), b.status().message());
  a.reset();
  EXPECT_TRUE(HttpServer::CheckAddress(options).ok());
  EXPECT_TRUE(HttpServer::Create(options, Echo).ok());
}

TEST(HttpServer, ResolvesHostNames) {
  HttpServerOptions options;
  options.host = "localhost";
  auto server = Start(Echo, options);
  ASSERT_TRUE(server);
  EXPECT_GT(server->port(), 0);
}

// Hands out the body streams of the requests a handler answered with one.
class ParkedStreams {
 public:
  HttpHandler Handler() {
    return [this](HttpRequest&& req, HttpResponder respond) {
      if (req.path == "/plain") return Echo(std::move(req), std::move(respond));
      HttpResponse r;
      r.content_type = "text/event-stream";
      r.stream = std::make_shared<HttpBodyStream>();
      {
        std::lock_guard<std::mutex> lock(mu_);
        streams_.push_back(r.stream);
        clients_.push_back(req.client);
        cv_.notify_all();
      }
      respond(std::move(r));
    };
  }
  // `client` (may be null) gets its request's ClientPresence.
  std::shared_ptr<HttpBodyStream> Take(std::shared_ptr<ClientPresence>* client = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return !streams_.empty(); });
    if (streams_.empty()) return nullptr;
    auto s = streams_.front();
    streams_.pop_front();
    if (client) *client = clients_.front();
    clients_.pop_front();
    return s;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<HttpBodyStream>> streams_;  // guarded by mu_
  std::deque<std::shared_ptr<ClientPresence>> clients_;  // guarded by mu_, one per stream
};

TEST(HttpServer, StreamsABodyAsItIsWritten) {
  ParkedStreams parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  net::io_context ioc;
  beast::tcp_stream s(ioc);
  s.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(server->port())));
  http::write(s, Client::Get("/events"));
  auto body = parked.Take();
  ASSERT_TRUE(body);
  // Headers go out before any data.
  beast::flat_buffer buf;
  http::response_parser<http::string_body> p;
  http::read_header(s, buf, p);
  EXPECT_EQ(p.get().result_int(), 200);
  EXPECT_TRUE(p.get().chunked());
  EXPECT_EQ(p.get()[http::field::content_type], "text/event-stream");
  ASSERT_TRUE(body->Write("data: 1\n\n"));
  while (p.get().body().size() < 9) http::read_some(s, buf, p);
  EXPECT_EQ(p.get().body(), "data: 1\n\n");
  ASSERT_TRUE(body->Write("data: 2\n\n"));
  body->Close();
  EXPECT_FALSE(body->Write("late"));
  http::read(s, buf, p);
  EXPECT_EQ(p.get().body(), "data: 1\n\ndata: 2\n\n");
  EXPECT_TRUE(p.get().keep_alive());
  // The connection serves the next request.
  http::write(s, Client::Get("/plain"));
  Response next;
  http::read(s, buf, next);
  EXPECT_EQ(next.body(), "GET /plain q= x-test= body=");
}

// A streamed answer's client that leaves before anything was written to
// the stream is gone at once; one that read its whole stream is not.
TEST(HttpServer, AStreamsClientThatLeavesBeforeItsFirstEventIsGone) {
  ParkedStreams parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  {
    Client client(server->port());
    ASSERT_FALSE(client.Write(Client::Get("/events")));
    std::shared_ptr<ClientPresence> presence;
    auto body = parked.Take(&presence);
    ASSERT_TRUE(body);
    ASSERT_TRUE(presence);
    client.Close();
    EXPECT_TRUE(shoal::testing::Eventually([&] { return presence->gone(); }));
  }
  Client client(server->port());
  ASSERT_FALSE(client.Write(Client::Get("/events")));
  std::shared_ptr<ClientPresence> presence;
  auto body = parked.Take(&presence);
  ASSERT_TRUE(body);
  body->Write("data: 1\n\n");
  body->Close();
  EXPECT_EQ(client.Read().body(), "data: 1\n\n");
  client.Close();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(presence->gone());
}

TEST(HttpServer, StreamOverHttp10EndsWithTheConnection) {
  ParkedStreams parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  Client client(server->port());
  ASSERT_FALSE(client.Write(Client::Get("/events", 10)));
  auto body = parked.Take();
  ASSERT_TRUE(body);
  body->Write("a");
  body->Write("b");
  body->Close();
  error_code ec;
  Response res = client.Read(&ec);
  ASSERT_FALSE(ec) << ec.message();
  EXPECT_EQ(res.body(), "ab");
  EXPECT_FALSE(res.chunked());
}

TEST(HttpServer, StreamWritesFailOnceTheClientIsGone) {
  ParkedStreams parked;
  auto server = Start(parked.Handler());
  ASSERT_TRUE(server);
  auto client = std::make_unique<Client>(server->port());
  ASSERT_FALSE(client->Write(Client::Get("/events")));
  auto body = parked.Take();
  ASSERT_TRUE(body);
  client->Close();
  int writes = 0;
  while (writes < 500 && body->Write(std::string(1024, 'x'))) {
    ++writes;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(body->gone());
}

TEST(HttpServerOptions, RejectsBadValues) {
  auto invalid = [](auto mutate) {
    HttpServerOptions o;
    mutate(o);
    return o.Validate().code();
  };
  EXPECT_EQ(HttpServerOptions{}.Validate().code(), StatusCode::kOk);
  EXPECT_EQ(invalid([](auto& o) { o.host = ""; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid([](auto& o) { o.port = 65536; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid([](auto& o) { o.threads = 0; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid([](auto& o) { o.max_body_bytes = 0; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid([](auto& o) { o.idle_timeout_ms = 0; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(invalid([](auto& o) { o.read_timeout_ms = -1; }), StatusCode::kInvalidArgument);

  HttpServerOptions bad;
  bad.threads = 0;
  EXPECT_EQ(HttpServer::Create(bad, Echo).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpServer::Create({}, nullptr).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shoal
