#include "cli/models_command.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "cli/internal/models_format.h"

namespace shoal {
namespace {

using cli::HttpClient;
using cli::HttpUrl;
using cli::ParseHttpUrl;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
namespace ui = cli::internal;

constexpr int64_t kNowMs = 1700000100000;

// Two workers hold tiny-bert (one failed), nobody holds minilm-l6.
const char* kModelsBody = R"({"object":"list","data":[
  {"id":"tiny-bert","object":"model","created":0,"owned_by":"shoal","task":"embed","dim":64,"state":"loaded",
   "workers":[
     {"worker":"host-1","state":"loaded","pinned":true,"memory_bytes":12897490,"last_used_unix_ms":1700000097000},
     {"worker":"host-2","state":"failed","pinned":false,"memory_bytes":0,"last_used_unix_ms":0,
      "error":"CUDA out of memory"}]},
  {"id":"minilm-l6","object":"model","created":0,"owned_by":"shoal","task":"embed","dim":384,
   "state":"not_loaded","workers":[]}]})";

const char* kNotFoundBody =
    R"({"error":{"message":"model 'nope' not found","type":"invalid_request_error","code":"model_not_found"}})";

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

std::string Response(int status, const std::string& reason, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

// A loopback HTTP server for one test: answers each connection, one at a
// time on its own thread, with the raw response `handler` returns; an empty
// response holds the connection open without answering (timeouts). The
// destructor stops and joins the thread.
class CannedServer {
 public:
  struct Request {
    std::string method, target, body, head;
  };
  using Handler = std::function<std::string(const Request&)>;

  explicit CannedServer(Handler handler) : handler_(std::move(handler)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd_, 8) != 0) {
      ADD_FAILURE() << "cannot listen on loopback";
      return;
    }
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~CannedServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<Request> requests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  // Waits up to 50 ms for `fd` to be readable; false when not (yet).
  static bool Readable(int fd) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 50) > 0;
  }

  void Serve() {
    while (!stop_) {
      if (!Readable(fd_)) continue;
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      Handle(c);
      ::close(c);
    }
  }

  void Handle(int c) {
    std::string data;
    size_t head_end = std::string::npos;
    size_t want = 0;
    char buf[4096];
    while (!stop_) {
      if (head_end != std::string::npos && data.size() >= head_end + 4 + want) break;
      if (!Readable(c)) continue;
      ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n <= 0) return;
      data.append(buf, static_cast<size_t>(n));
      if (head_end == std::string::npos && (head_end = data.find("\r\n\r\n")) != std::string::npos) {
        std::string lower = data.substr(0, head_end);
        for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        if (size_t p = lower.find("content-length:"); p != std::string::npos) {
          want = std::stoul(lower.substr(p + 15));
        }
      }
    }
    if (stop_) return;
    Request r;
    r.head = data.substr(0, head_end);
    std::istringstream first(r.head);
    first >> r.method >> r.target;
    r.body = data.substr(head_end + 4, want);
    {
      std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(r);
    }
    const std::string response = handler_(r);
    if (response.empty()) {
      // Hold the connection until the client gives up or the test ends.
      while (!stop_) {
        if (Readable(c) && ::recv(c, buf, sizeof buf, 0) <= 0) return;
      }
      return;
    }
    size_t sent = 0;
    while (sent < response.size()) {
      ssize_t n = ::send(c, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

  Handler handler_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::vector<Request> requests_;  // guarded by mu_
  std::thread thread_;
};

// The gateway's routes for these tests.
std::string FakeGateway(const CannedServer::Request& r) {
  if (r.method == "GET" && (r.target == "/v1/models" || r.target == "/api/v1/models")) {
    return Response(200, "OK", kModelsBody);
  }
  if (r.method == "POST" && r.target == "/v1/models/tiny-bert/load") {
    return Response(200, "OK",
                    R"({"model":"tiny-bert","action":"load","results":[{"worker":"host-1","ok":true,"state":"loaded"}]})");
  }
  if (r.method == "POST" && r.target == "/v1/models/my%20model%2Fv2/pin") {
    return Response(200, "OK", R"({"model":"my model/v2","action":"pin","results":[
      {"worker":"w1","ok":false,"error":{"message":"model is not loaded","code":"not_loaded"}}]})");
  }
  if (r.method == "POST" && r.target == "/v1/models/tiny-bert/unload") {  // pinned on one worker
    return Response(400, "Bad Request", R"({"error":{"message":"model 'tiny-bert' is pinned; unpin it first",
      "type":"invalid_request_error","code":"model_pinned"},"model":"tiny-bert","action":"unload","results":[
      {"worker":"w1","ok":true,"status":{"state":"not_loaded"}},
      {"worker":"w2","ok":false,"error":{"message":"model 'tiny-bert' is pinned; unpin it first","code":"model_pinned"}}]})");
  }
  return Response(404, "Not Found", kNotFoundBody);
}

// A loopback port nobody listens on (bound, then closed).
int ClosedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct Outcome {
  int code = -1;
  std::string out, err;
};
Outcome RunCommand(const ModelsCommandFlags& flags) {
  std::ostringstream out, err;
  Outcome r;
  r.code = RunModelsCommand(flags, out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

// --- URL parsing -------------------------------------------------------------

TEST(ParseHttpUrl, AcceptsHostPortAndPrefix) {
  auto u = ParseHttpUrl("http://127.0.0.1:8080");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->host, "127.0.0.1");
  EXPECT_EQ(u->port, 8080);
  EXPECT_EQ(u->prefix, "");

  u = ParseHttpUrl("HTTP://gw.example.com:9000/shoal/");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->host, "gw.example.com");
  EXPECT_EQ(u->port, 9000);
  EXPECT_EQ(u->prefix, "/shoal");
  EXPECT_EQ(u->ToString(), "http://gw.example.com:9000/shoal");

  u = ParseHttpUrl("http://localhost/");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->host, "localhost");
  EXPECT_EQ(u->port, 80);
  EXPECT_EQ(u->prefix, "");

  u = ParseHttpUrl("http://[::1]:8081");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->host, "::1");
  EXPECT_EQ(u->port, 8081);
  EXPECT_EQ(u->ToString(), "http://[::1]:8081");
}

TEST(ParseHttpUrl, RejectsHttpsWithAClearMessage) {
  auto u = ParseHttpUrl("https://gw.example.com:443");
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(u.status().message(), HasSubstr("https is not supported"));
  EXPECT_THAT(u.status().message(), HasSubstr("https://gw.example.com:443"));
}

TEST(ParseHttpUrl, RejectsMalformedUrls) {
  for (const char* bad : {"", "127.0.0.1:8080", "ftp://h:21", "nats://127.0.0.1:4222", "http://", "http://:8080",
                          "http://h:", "http://h:0", "http://h:65536", "http://h:80x", "http://user@h:80",
                          "http://h:80/?q=1", "http://h:80/#frag", "http://::1:80", "http://[::1", "http://h :80",
                          "http://[::1]x"}) {
    auto u = ParseHttpUrl(bad);
    ASSERT_FALSE(u.ok()) << "accepted '" << bad << "'";
    EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(u.status().message(), HasSubstr("bad gateway URL")) << bad;
  }
}

TEST(HttpClient, CreateRejectsANonPositiveTimeout) {
  auto c = HttpClient::Create("http://127.0.0.1:1", std::chrono::milliseconds(0));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  // Past a day (10^13 ms would wrap Beast's nanosecond timer and expire at
  // once): refused, not a request that times out before it starts.
  EXPECT_TRUE(HttpClient::Create("http://127.0.0.1:1", HttpClient::kMaxTimeout).ok());
  c = HttpClient::Create("http://127.0.0.1:1", std::chrono::milliseconds(10000000000000));
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
}

// --- pure formatting -----------------------------------------------------------

TEST(EncodePathSegment, KeepsUnreservedAndEncodesEverythingElse) {
  EXPECT_EQ(ui::EncodePathSegment("tiny-bert"), "tiny-bert");
  EXPECT_EQ(ui::EncodePathSegment("A.b_c~9-z"), "A.b_c~9-z");
  EXPECT_EQ(ui::EncodePathSegment("my model/v2"), "my%20model%2Fv2");
  EXPECT_EQ(ui::EncodePathSegment("100%?#"), "100%25%3F%23");
  EXPECT_EQ(ui::EncodePathSegment("a+b&c=d:e@f"), "a%2Bb%26c%3Dd%3Ae%40f");
  EXPECT_EQ(ui::EncodePathSegment("caf\xC3\xA9"), "caf%C3%A9");
  EXPECT_EQ(ui::EncodePathSegment(""), "");
}

TEST(FormatBytes, UsesBinaryUnitsWithOneDecimal) {
  EXPECT_EQ(ui::FormatBytes(-1), "-");
  EXPECT_EQ(ui::FormatBytes(0), "0 B");
  EXPECT_EQ(ui::FormatBytes(1023), "1023 B");
  EXPECT_EQ(ui::FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(ui::FormatBytes(12897490), "12.3 MiB");
  EXPECT_EQ(ui::FormatBytes(1048575), "1.0 MiB");
  EXPECT_EQ(ui::FormatBytes(int64_t{3} << 30), "3.0 GiB");
}

TEST(FormatAgo, SaysNeverOrHowLongAgo) {
  EXPECT_EQ(ui::FormatAgo(0, kNowMs), "never");
  EXPECT_EQ(ui::FormatAgo(kNowMs + 5000, kNowMs), "just now");
  EXPECT_EQ(ui::FormatAgo(kNowMs - 3000, kNowMs), "3s ago");
  EXPECT_EQ(ui::FormatAgo(kNowMs - 125000, kNowMs), "2m ago");
  EXPECT_EQ(ui::FormatAgo(kNowMs - 2 * 3600000, kNowMs), "2h ago");
  EXPECT_EQ(ui::FormatAgo(kNowMs - 3 * 86400000LL, kNowMs), "3d ago");
}

TEST(RenderModelsTable, OneLinePerModelAndWorker) {
  auto models = ui::ParseModelList(kModelsBody);
  ASSERT_TRUE(models.ok()) << models.status().ToString();
  ASSERT_EQ(models->size(), 2u);
  const std::string table = ui::RenderModelsTable(*models, kNowMs);
  const auto lines = Lines(table);
  ASSERT_EQ(lines.size(), 4u) << table;

  EXPECT_THAT(lines[0], StartsWith("MODEL"));
  for (const char* col : {"STATE", "WORKER", "PINNED", "MEMORY", "LAST USED", "ERROR"}) {
    EXPECT_THAT(lines[0], HasSubstr(col));
  }
  EXPECT_THAT(lines[1], StartsWith("tiny-bert"));
  for (const char* cell : {"loaded", "host-1", "yes", "12.3 MiB", "3s ago"}) EXPECT_THAT(lines[1], HasSubstr(cell));
  for (const char* cell : {"failed", "host-2", "no", "0 B", "never", "CUDA out of memory"}) {
    EXPECT_THAT(lines[2], HasSubstr(cell));
  }
  EXPECT_THAT(lines[3], StartsWith("minilm-l6"));
  EXPECT_THAT(lines[3], HasSubstr("not_loaded"));
  EXPECT_THAT(lines[3], HasSubstr(" - "));

  // Columns line up: every row's WORKER cell starts under the header's.
  const size_t worker_col = lines[0].find("WORKER");
  EXPECT_EQ(lines[1].find("host-1"), worker_col);
  EXPECT_EQ(lines[2].find("host-2"), worker_col);
  EXPECT_EQ(lines[3].find('-', lines[3].find("not_loaded")), worker_col);
  for (const auto& l : lines) EXPECT_NE(l.back(), ' ') << "trailing space in '" << l << "'";
}

TEST(RenderModelsTable, DropsTheErrorColumnWhenNothingFailed) {
  auto models = ui::ParseModelList(
      R"({"data":[{"id":"m","state":"loaded","workers":[{"worker":"w","state":"loaded","memory_bytes":2048}]}]})");
  ASSERT_TRUE(models.ok()) << models.status().ToString();
  const std::string table = ui::RenderModelsTable(*models, kNowMs);
  EXPECT_THAT(table, Not(HasSubstr("ERROR")));
  EXPECT_THAT(table, HasSubstr("2.0 KiB"));
  EXPECT_THAT(table, HasSubstr("never"));
}

// A model not resident now shows what it measured at its last load there,
// in parentheses; one never loaded there shows 0 B.
TEST(RenderModelsTable, ShowsTheLastMeasuredFootprintOfAModelNotResident) {
  auto models = ui::ParseModelList(R"({"data":[{"id":"m","state":"not_loaded","workers":[
      {"worker":"w1","state":"not_loaded","memory_bytes":0,"measured_bytes":118489088},
      {"worker":"w2","state":"not_loaded","memory_bytes":0,"measured_bytes":0}]}]})");
  ASSERT_TRUE(models.ok()) << models.status().ToString();
  const auto lines = Lines(ui::RenderModelsTable(*models, kNowMs));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_THAT(lines[1], HasSubstr("(113.0 MiB)"));
  EXPECT_THAT(lines[2], HasSubstr("0 B"));
  EXPECT_THAT(lines[2], Not(HasSubstr("(")));
}

TEST(RenderModelsTable, FiltersByWorkerAndSaysWhenEmpty) {
  auto models = ui::ParseModelList(kModelsBody);
  ASSERT_TRUE(models.ok());
  const auto lines = Lines(ui::RenderModelsTable(*models, kNowMs, "host-1"));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[1], HasSubstr("host-1"));
  EXPECT_EQ(ui::RenderModelsTable({}, kNowMs), "(no models)\n");
  EXPECT_EQ(ui::RenderModelsTable(*models, kNowMs, "host-9"), "(no models on worker host-9)\n");
}

// Names and states come from the registry, which any NATS client can
// write: no control character (an ANSI escape, C1 CSI) reaches the terminal.
TEST(RenderModelsTable, PrintsNoControlCharacters) {
  auto models = ui::ParseModelList(
      "{\"data\":[{\"id\":\"m\\u001b[2J\",\"state\":\"loaded\",\"workers\":[{\"worker\":\"w\\u009b1m\","
      "\"state\":\"loaded\\u0007\",\"error\":\"bad\\u001b]0;title\\u0007\"}]}]}");
  ASSERT_TRUE(models.ok()) << models.status().ToString();
  const std::string table = ui::RenderModelsTable(*models, kNowMs);
  for (char c : table) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 && c != '\n') << table;
  EXPECT_EQ(table.find("\xc2\x9b"), std::string::npos) << table;
  EXPECT_THAT(table, HasSubstr("m?[2J"));
  EXPECT_THAT(table, HasSubstr("w?1m"));
  auto s = ui::SummarizeAction(
      "{\"results\":[{\"worker\":\"w\\u001b[1m\",\"ok\":false,\"error\":\"x\\u001b[1m\"}]}", "load", "m");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->lines[0], "load m failed on w?[1m: x?[1m");
  // An answer that is not JSON is quoted without its control bytes, and a
  // bare C1 byte (CSI to a terminal not in UTF-8 mode) is not passed on.
  auto bad = ui::ParseModelList("not json \x1b[2J \x9b" "1m");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message().find('\x1b'), std::string::npos) << bad.status().message();
  EXPECT_EQ(bad.status().message().find('\x9b'), std::string::npos) << bad.status().message();
}

TEST(ParseModelList, RejectsAnswersThatAreNotAModelList) {
  for (const char* bad : {"", "<html>oops</html>", "[]", R"({"object":"list"})", R"({"data":[{"object":"model"}]})"}) {
    auto m = ui::ParseModelList(bad);
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_EQ(m.status().code(), StatusCode::kBadGateway) << bad;
  }
  // Valid JSON nested a million deep: quoting it in the message used to
  // recurse once per level and overflow the stack.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  for (const std::string& body : {deep, R"({"data":[)" + deep + "]}", R"({"data":)" + deep + "}"}) {
    auto m = ui::ParseModelList(body);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kBadGateway);
    auto a = ui::SummarizeAction(body, "load", "m");
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kBadGateway);
  }
}

TEST(SummarizeAction, FailedWorkerResultMeansExitOne) {
  auto s = ui::SummarizeAction(R"({"model":"tiny-bert","action":"load","results":[
      {"worker":"host-1","ok":true,"state":"loaded"},
      {"worker":"host-2","ok":false,"error":{"message":"out of memory","code":"resource_exhausted"}}]})",
                               "load", "tiny-bert");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->lines.size(), 2u);
  EXPECT_EQ(s->lines[0], "loaded tiny-bert on host-1 (ok)");
  EXPECT_THAT(s->lines[1], HasSubstr("failed on host-2: out of memory"));
  EXPECT_EQ(s->succeeded, 1);
  EXPECT_EQ(s->failed, 1);
  EXPECT_EQ(ui::ActionExitCode(*s), 1);
}

TEST(SummarizeAction, AllOkMeansExitZeroAndNoResultsMeansOne) {
  auto ok = ui::SummarizeAction(R"({"results":[{"worker":"a","ok":true},{"worker":"b","ok":true}]})", "unpin", "m");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->lines[1], "unpinned m on b (ok)");
  EXPECT_EQ(ui::ActionExitCode(*ok), 0);

  // Unloading or unpinning a model no worker has loaded or pinned is done
  // already; a load that no worker answered is not.
  auto none = ui::SummarizeAction(R"({"results":[]})", "unload", "m");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->lines.at(0), "unload m: nothing to do (no live worker has it loaded)");
  EXPECT_EQ(ui::ActionExitCode(*none), 0);
  none = ui::SummarizeAction(R"({"results":[]})", "unpin", "m");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->lines.at(0), "unpin m: nothing to do (no live worker has it pinned)");
  EXPECT_EQ(ui::ActionExitCode(*none), 0);
  none = ui::SummarizeAction(R"({"results":[]})", "load", "m");
  ASSERT_TRUE(none.ok());
  EXPECT_THAT(none->lines.at(0), HasSubstr("no worker answered"));
  EXPECT_EQ(ui::ActionExitCode(*none), 1);

  auto bad = ui::SummarizeAction("not json", "load", "m");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kBadGateway);
}

TEST(FormatHttpError, UsesTheOpenAiErrorFields) {
  EXPECT_EQ(ui::FormatHttpError(404, kNotFoundBody), "error: model 'nope' not found (model_not_found, HTTP 404)");
  EXPECT_EQ(ui::FormatHttpError(503, R"({"error":{"message":"no workers","type":"service_unavailable_error"}})"),
            "error: no workers (service_unavailable_error, HTTP 503)");
  EXPECT_EQ(ui::FormatHttpError(502, "Bad Gateway\n"), "error: Bad Gateway (HTTP 502)");
  EXPECT_EQ(ui::FormatHttpError(500, ""), "error: the gateway gave no details (HTTP 500)");
}

// --- command line ----------------------------------------------------------------

TEST(ModelsCommand, ParsesActionModelAndOptions) {
  CLI::App app;
  ModelsCommandFlags flags;
  CLI::App* models = AddModelsCommand(&app, &flags);
  app.parse("models pin tiny-bert --worker host-1 --json --gateway http://gw:9000 --timeout-ms 5000", false);
  EXPECT_TRUE(models->parsed());
  EXPECT_EQ(flags.action, "pin");
  EXPECT_EQ(flags.model, "tiny-bert");
  EXPECT_EQ(flags.worker, "host-1");
  EXPECT_TRUE(flags.json);
  EXPECT_EQ(flags.gateway_url, "http://gw:9000");
  EXPECT_EQ(flags.timeout_ms, 5000);
}

// The gateway waits up to 300 s for a load; the client waits longer, so a
// slow load ends with the gateway's answer rather than a transport timeout.
TEST(ModelsCommand, DefaultTimeoutOutlastsTheGatewaysLoadWait) {
  EXPECT_GT(ModelsCommandFlags{}.timeout_ms, 300000);
}

TEST(ModelsCommand, DefaultsToListAndReadsTheEnvironment) {
  ::setenv("SHOAL_GATEWAY_URL", "http://10.0.0.5:8080", 1);
  ::setenv("SHOAL_MODELS_TIMEOUT_MS", "1234", 1);
  CLI::App app;
  ModelsCommandFlags flags;
  CLI::App* models = AddModelsCommand(&app, &flags);
  app.parse("models", false);
  ::unsetenv("SHOAL_GATEWAY_URL");
  ::unsetenv("SHOAL_MODELS_TIMEOUT_MS");
  EXPECT_TRUE(models->parsed());
  EXPECT_EQ(flags.action, "list");
  EXPECT_EQ(flags.gateway_url, "http://10.0.0.5:8080");
  EXPECT_EQ(flags.timeout_ms, 1234);
}

TEST(ModelsCommand, BadUsageExitsTwoWithUsage) {
  ModelsCommandFlags flags;
  flags.gateway_url = "http://127.0.0.1:" + std::to_string(ClosedPort());

  flags.action = "reload";
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown action 'reload'"));
  EXPECT_THAT(r.err, HasSubstr("usage: shoal models"));

  flags.action = "load";
  r = RunCommand(flags);
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("load needs a model name"));

  flags.action = "list";
  flags.model = "tiny-bert";
  EXPECT_EQ(RunCommand(flags).code, 2);

  flags.model.clear();
  flags.gateway_url = "https://127.0.0.1:8443";
  r = RunCommand(flags);
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("https is not supported"));

  flags.gateway_url = "http://127.0.0.1:1";
  flags.timeout_ms = 0;
  EXPECT_EQ(RunCommand(flags).code, 2);
}

// --- over real HTTP ------------------------------------------------------------------

TEST(HttpClientOverHttp, GetsABodyAndAnErrorStatus) {
  CannedServer server(FakeGateway);
  auto client = HttpClient::Create(server.url(), std::chrono::seconds(10));
  ASSERT_TRUE(client.ok()) << client.status().ToString();

  auto ok = client->Get("/v1/models");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->content_type, "application/json");
  EXPECT_EQ(ok->body, kModelsBody);

  auto missing = client->Post("/v1/models/nope/load", "{}");
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->body, kNotFoundBody);

  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(reqs[1].method, "POST");
  EXPECT_EQ(reqs[1].body, "{}");
  EXPECT_THAT(reqs[1].head, HasSubstr("Content-Type: application/json"));
  EXPECT_THAT(reqs[1].head, HasSubstr("Host: 127.0.0.1:" + std::to_string(server.port())));
}

TEST(HttpClientOverHttp, ResolvesHostNamesAndKeepsThePrefix) {
  CannedServer server(FakeGateway);
  auto client = HttpClient::Create("http://localhost:" + std::to_string(server.port()) + "/api/",
                                   std::chrono::seconds(10));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto r = client->Get("/v1/models");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200);
  ASSERT_EQ(server.requests().size(), 1u);
  EXPECT_EQ(server.requests()[0].target, "/api/v1/models");
}

TEST(HttpClientOverHttp, ConnectionRefusedIsAStatusNotAThrow) {
  const std::string url = "http://127.0.0.1:" + std::to_string(ClosedPort());
  auto client = HttpClient::Create(url, std::chrono::seconds(5));
  ASSERT_TRUE(client.ok());
  auto r = client->Get("/v1/models");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(r.status().reason(), "connection_refused");
  EXPECT_THAT(r.status().message(), HasSubstr(url));
}

TEST(HttpClientOverHttp, ASilentServerHitsTheDeadline) {
  CannedServer server([](const CannedServer::Request&) { return std::string(); });
  auto client = HttpClient::Create(server.url(), std::chrono::milliseconds(200));
  ASSERT_TRUE(client.ok());
  auto r = client->Get("/v1/models");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("within 200 ms"));
}

TEST(ModelsCommandOverHttp, ListPrintsTheTable) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, StartsWith("MODEL"));
  EXPECT_THAT(r.out, HasSubstr("tiny-bert"));
  EXPECT_THAT(r.out, HasSubstr("12.3 MiB"));
  EXPECT_THAT(r.out, HasSubstr("minilm-l6"));
}

// Listing one worker: a worker the registry does not list is an error, as
// an action on it is; a listed one gets its lines.
TEST(ModelsCommandOverHttp, ListingAWorkerNotInTheRegistryFails) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  flags.worker = "nobody";
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("no live worker 'nobody'"));
  EXPECT_EQ(r.out, "");
  flags.worker = "host-2";
  r = RunCommand(flags);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("host-2"));
}

TEST(ModelsCommandOverHttp, JsonPrintsTheRawBody) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  flags.json = true;
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, std::string(kModelsBody) + "\n");
}

TEST(ModelsCommandOverHttp, LoadPrintsOneLinePerWorker) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  flags.action = "load";
  flags.model = "tiny-bert";
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "loaded tiny-bert on host-1 (ok)\n");
  ASSERT_EQ(server.requests().size(), 1u);
  EXPECT_EQ(server.requests()[0].body, "{}");
}

TEST(ModelsCommandOverHttp, EncodesTheNameSendsTheWorkerAndFailsOnAFailedResult) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  flags.action = "pin";
  flags.model = "my model/v2";
  flags.worker = "w1";
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.out, HasSubstr("failed on w1: model is not loaded"));
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_EQ(reqs[0].method, "POST");
  EXPECT_EQ(reqs[0].target, "/v1/models/my%20model%2Fv2/pin");
  EXPECT_EQ(nlohmann::json::parse(reqs[0].body), nlohmann::json({{"worker", "w1"}}));

  // A --worker that is not UTF-8 goes out with U+FFFD for the bad byte
  // instead of ending the command in an exception.
  flags.worker = "w\xff";
  r = RunCommand(flags);
  ASSERT_EQ(server.requests().size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(server.requests()[1].body), nlohmann::json({{"worker", "w\xef\xbf\xbd"}}));
}

TEST(ModelsCommandOverHttp, HttpErrorPrintsMessageCodeAndStatus) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  flags.action = "unload";
  flags.model = "nope";
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "error: model 'nope' not found (model_not_found, HTTP 404)\n");
}

// A failure on one worker does not hide what the others did.
TEST(ModelsCommandOverHttp, AnErrorStillListsWhatEachWorkerDid) {
  CannedServer server(FakeGateway);
  ModelsCommandFlags flags;
  flags.gateway_url = server.url();
  flags.action = "unload";
  flags.model = "tiny-bert";
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.out, HasSubstr("unloaded tiny-bert on w1 (ok)"));
  EXPECT_THAT(r.out, HasSubstr("unload tiny-bert failed on w2: "));
  EXPECT_THAT(r.err, HasSubstr("model_pinned, HTTP 400"));
}

TEST(ModelsCommandOverHttp, ConnectionRefusedNamesTheUrl) {
  ModelsCommandFlags flags;
  flags.gateway_url = "http://127.0.0.1:" + std::to_string(ClosedPort());
  Outcome r = RunCommand(flags);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot connect to the gateway at " + flags.gateway_url));
  EXPECT_THAT(r.err, HasSubstr("SHOAL_GATEWAY_URL"));
}

}  // namespace
}  // namespace shoal
