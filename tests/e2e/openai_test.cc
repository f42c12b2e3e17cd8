// End to end, the openai runtime: a `shoal gateway` + `shoal worker` whose
// models live upstream. Embeddings go to a second, real Shoal (`shoal serve`
// with tiny-bert) and must match its direct answer; completions and chat go
// to a scripted OpenAI-compatible server that streams server-sent events and
// fails on request (400, 500, slow, refused).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "e2e/http_client.h"
#include "e2e/shoal_cluster.h"
#include "support/fake_openai_server.h"
#include "support/test_env.h"

namespace shoal::e2e {
namespace {

using nlohmann::json;
using shoal::testing::FakeOpenAiServer;
using namespace std::chrono_literals;

void WriteModel(const std::string& repo, const std::string& name, const json& config) {
  std::filesystem::create_directories(repo + "/" + name);
  std::ofstream(repo + "/" + name + "/shoal.json") << config.dump(2);
}

json Chunk(const std::string& content) {
  return {{"id", "chatcmpl-1"},
          {"object", "chat.completion.chunk"},
          {"model", "fake-llm"},
          {"choices", json::array({{{"index", 0}, {"delta", {{"content", content}}}, {"finish_reason", nullptr}}})}};
}

// The scripted upstream: the user's message chooses the behaviour.
FakeOpenAiServer::Reply Script(const FakeOpenAiServer::Request& r) {
  if (r.target == "/v1/embeddings") return FakeOpenAiServer::Embeddings(r.body);
  json req = json::parse(r.body, nullptr, false);
  std::string said;
  if (req.contains("messages")) said = req["messages"][0].value("content", "");
  if (req.contains("prompt") && req["prompt"].is_string()) said = req["prompt"].get<std::string>();
  if (said == "fail400") return {400, R"({"error":{"message":"maximum context length exceeded","code":"context_length_exceeded"}})"};
  if (said == "fail500") return {500, R"({"error":{"message":"CUDA out of memory"}})"};
  FakeOpenAiServer::Reply reply;
  if (said == "slow") reply.delay_ms = 3000;
  if (said == "stall") reply.delay_ms = 20000;  // then answers as usual
  if (said == "long" && req.value("stream", false)) {  // 10 s of events
    for (int i = 0; i < 200; ++i) reply.events.push_back(Chunk(" word").dump());
    reply.events.push_back("[DONE]");
    reply.event_delay_ms = 50;
    return reply;
  }
  if (req.value("stream", false)) {
    for (const char* w : {"Hello", " from", " upstream"}) reply.events.push_back(Chunk(w).dump());
    reply.events.push_back("[DONE]");
    reply.event_delay_ms = 20;
    return reply;
  }
  json out;
  if (r.target == "/v1/completions") {
    out = {{"id", "cmpl-1"}, {"object", "text_completion"}, {"model", req.value("model", "")},
           {"choices", json::array({{{"index", 0}, {"text", "echo: " + said}, {"finish_reason", "stop"}}})}};
  } else {
    out = {{"id", "chatcmpl-1"}, {"object", "chat.completion"}, {"model", req.value("model", "")},
           {"choices", json::array({{{"index", 0}, {"message", {{"role", "assistant"}, {"content", "echo: " + said}}},
                                     {"finish_reason", "stop"}}})},
           {"usage", {{"prompt_tokens", 1}, {"completion_tokens", 2}, {"total_tokens", 3}}}};
  }
  reply.body = out.dump();
  return reply;
}

class E2eOpenAi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    upstream_dir_ = new shoal::testing::TempDir();
    upstream_ = new Shoal(StartServe(upstream_dir_->path(), {"--models", "tiny-bert", "--threads", "1"}));
    upstream_ready_ = WaitForReadyz(upstream_->port, 200, 60s);
    fake_ = new FakeOpenAiServer(Script);
    int dead_port = 0;
    {
      FakeOpenAiServer gone([](const FakeOpenAiServer::Request&) { return FakeOpenAiServer::Reply{}; });
      dead_port = gone.port();
    }
    repo_ = new shoal::testing::TempDir();
    const std::string up = "http://127.0.0.1:" + std::to_string(upstream_->port) + "/v1";
    WriteModel(repo_->path(), "remote-bert",
               {{"name", "remote-bert"}, {"task", "embed"}, {"runtime", "openai"}, {"dim", 64},
                {"openai", {{"base_url", up}, {"model", "tiny-bert"}}}});
    WriteModel(repo_->path(), "remote-chat",
               {{"name", "remote-chat"}, {"task", "generate"}, {"runtime", "openai"},
                {"openai", {{"base_url", fake_->url() + "/v1"}, {"model", "fake-llm"}, {"timeout_ms", 1000}}}});
    WriteModel(repo_->path(), "fake-embed",
               {{"name", "fake-embed"}, {"task", "embed"}, {"runtime", "openai"}, {"dim", 2},
                {"batching", {{"max_batch_size", 4}}},
                {"openai", {{"base_url", fake_->url() + "/v1"}}}});
    WriteModel(repo_->path(), "long-chat",
               {{"name", "long-chat"}, {"task", "generate"}, {"runtime", "openai"},
                {"openai", {{"base_url", fake_->url() + "/v1"}, {"model", "fake-llm"}, {"timeout_ms", 60000}}}});
    WriteModel(repo_->path(), "remote-down",
               {{"name", "remote-down"}, {"task", "generate"}, {"runtime", "openai"},
                {"openai", {{"base_url", "http://127.0.0.1:" + std::to_string(dead_port) + "/v1"}}}});
    nats_ = new shoal::testing::TestNatsServer();
    worker_ = new Shoal(StartFleetWorker(nats_->url(), repo_->path(), {"--threads", "1", "--preload", "none"}));
    gateway_ = new Shoal(StartGateway(nats_->url()));
    // A generator whose upstream is a Shoal gateway (this one, serving
    // remote-chat), on a worker of its own: Shoal relaying Shoal.
    relay_repo_ = new shoal::testing::TempDir();
    WriteModel(relay_repo_->path(), "relay-chat",
               {{"name", "relay-chat"}, {"task", "generate"}, {"runtime", "openai"},
                {"openai", {{"base_url", "http://127.0.0.1:" + std::to_string(gateway_->port) + "/v1"},
                            {"model", "remote-chat"}}}});
    relay_worker_ =
        new Shoal(StartFleetWorker(nats_->url(), relay_repo_->path(), {"--threads", "1", "--preload", "none"}));
  }
  static void TearDownTestSuite() {
    delete relay_worker_;
    delete relay_repo_;
    delete gateway_;
    delete worker_;
    delete nats_;
    delete repo_;
    delete fake_;
    delete upstream_;
    delete upstream_dir_;
  }
  void SetUp() override { ASSERT_EQ(upstream_ready_, 200) << "the upstream Shoal never became ready"; }

  static HttpResult Chat(const std::string& model, const std::string& text, bool stream = false) {
    json req = {{"model", model}, {"messages", json::array({{{"role", "user"}, {"content", text}}})}};
    if (stream) req["stream"] = true;
    return HttpPostJson(gateway_->port, "/v1/chat/completions", req.dump(), {}, 60s);
  }

  static shoal::testing::TempDir* upstream_dir_;
  static Shoal* upstream_;
  static int upstream_ready_;
  static FakeOpenAiServer* fake_;
  static shoal::testing::TempDir* repo_;
  static shoal::testing::TestNatsServer* nats_;
  static Shoal* worker_;
  static Shoal* gateway_;
  static shoal::testing::TempDir* relay_repo_;
  static Shoal* relay_worker_;
};

shoal::testing::TempDir* E2eOpenAi::upstream_dir_ = nullptr;
Shoal* E2eOpenAi::upstream_ = nullptr;
int E2eOpenAi::upstream_ready_ = 0;
FakeOpenAiServer* E2eOpenAi::fake_ = nullptr;
shoal::testing::TempDir* E2eOpenAi::repo_ = nullptr;
shoal::testing::TestNatsServer* E2eOpenAi::nats_ = nullptr;
Shoal* E2eOpenAi::worker_ = nullptr;
Shoal* E2eOpenAi::gateway_ = nullptr;
shoal::testing::TempDir* E2eOpenAi::relay_repo_ = nullptr;
Shoal* E2eOpenAi::relay_worker_ = nullptr;

TEST_F(E2eOpenAi, EmbeddingsThroughAnotherShoalMatchItsDirectAnswer) {
  const std::vector<std::string> texts = {"the quick brown fox", "jumps over", "the lazy dog", "a"};
  OpenAiEmbeddings direct = EmbedOrThrow(upstream_->port, "tiny-bert", texts);
  OpenAiEmbeddings via = EmbedOrThrow(gateway_->port, "remote-bert", texts, 60s);
  EXPECT_EQ(via.model, "remote-bert");
  ASSERT_EQ(via.rows.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    ASSERT_EQ(via.rows[i].size(), 64u) << i;
    EXPECT_LT(MaxAbsDiff(via.rows[i], direct.rows[i]), 1e-6) << "row " << i;
  }
  // Base64 from the front gateway too.
  auto r = HttpPostJson(gateway_->port, "/v1/embeddings",
                        json{{"model", "remote-bert"}, {"input", texts[0]}, {"encoding_format", "base64"}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto b64 = DecodeBase64Floats(json::parse(r.body)["data"][0]["embedding"].get<std::string>());
  EXPECT_LT(MaxAbsDiff(b64, direct.rows[0]), 1e-6);
}

// One queue message carries up to --chunk-size (32) texts; the upstream
// gets them in requests of at most batching.max_batch_size (4 here).
TEST_F(E2eOpenAi, EmbeddingsReachTheUpstreamInRequestsOfAtMostMaxBatchSize) {
  std::vector<std::string> texts;
  for (int i = 0; i < 10; ++i) texts.push_back("text number " + std::to_string(i));
  OpenAiEmbeddings got = EmbedOrThrow(gateway_->port, "fake-embed", texts, 60s);
  ASSERT_EQ(got.rows.size(), texts.size());
  size_t sent = 0, requests = 0;
  for (const auto& req : fake_->requests()) {
    if (req.target != "/v1/embeddings") continue;
    const json body = json::parse(req.body);
    EXPECT_LE(body["input"].size(), 4u) << req.body;
    sent += body["input"].size();
    ++requests;
  }
  EXPECT_EQ(sent, texts.size());
  EXPECT_EQ(requests, 3u);
}

TEST_F(E2eOpenAi, ChatAndCompletionsAnswerWithShoalsModelName) {
  auto r = Chat("remote-chat", "hi");
  ASSERT_EQ(r.status, 200) << r.body;
  json out = json::parse(r.body);
  EXPECT_EQ(out["model"], "remote-chat");
  EXPECT_EQ(out["choices"][0]["message"]["content"], "echo: hi");
  auto c = HttpPostJson(gateway_->port, "/v1/completions",
                        json{{"model", "remote-chat"}, {"prompt", "once"}, {"max_tokens", 4}}.dump(), {}, 60s);
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(json::parse(c.body)["choices"][0]["text"], "echo: once");
  // The upstream saw its own model name.
  bool saw = false;
  for (const auto& req : fake_->requests())
    if (req.target == "/v1/completions") saw = json::parse(req.body)["model"] == "fake-llm";
  EXPECT_TRUE(saw);
}

TEST_F(E2eOpenAi, StreamedChatIsServerSentEventsEndingInDone) {
  auto r = Chat("remote-chat", "tell me", /*stream=*/true);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("content-type"), "text/event-stream");
  std::vector<std::string> events;
  size_t pos = 0;
  while (pos < r.body.size()) {
    const size_t end = r.body.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << "unterminated event in: " << r.body;
    const std::string ev = r.body.substr(pos, end - pos);
    ASSERT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    events.push_back(ev.substr(6));
    pos = end + 2;
  }
  ASSERT_EQ(events.size(), 4u) << r.body;
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json ev = json::parse(events[i]);
    EXPECT_EQ(ev["object"], "chat.completion.chunk");
    EXPECT_EQ(ev["model"], "remote-chat");
    text += ev["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, "Hello from upstream");
  EXPECT_EQ(events.back(), "[DONE]");
}

TEST_F(E2eOpenAi, ChatThroughAnotherShoalStreamsAndAnswers) {
  // The relay's worker publishes its catalog once it is up.
  for (int i = 0; i < 300 && HttpGet(gateway_->port, "/v1/models").body.find("relay-chat") == std::string::npos; ++i)
    std::this_thread::sleep_for(100ms);
  auto r = Chat("relay-chat", "hi");
  ASSERT_EQ(r.status, 200) << r.body;
  json out = json::parse(r.body);
  EXPECT_EQ(out["model"], "relay-chat");
  EXPECT_EQ(out["choices"][0]["message"]["content"], "echo: hi");
  // Streamed: the inner Shoal's events, relayed event by event.
  auto s = Chat("relay-chat", "tell me", /*stream=*/true);
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_EQ(s.Header("content-type"), "text/event-stream");
  std::string text;
  size_t pos = 0, events = 0;
  std::string last;
  while (pos < s.body.size()) {
    const size_t end = s.body.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << "unterminated event in: " << s.body;
    last = s.body.substr(pos + 6, end - pos - 6);
    pos = end + 2;
    ++events;
    if (last == "[DONE]") break;
    json ev = json::parse(last);
    EXPECT_EQ(ev["model"], "relay-chat");
    text += ev["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(last, "[DONE]");
  EXPECT_EQ(events, 4u) << s.body;
  EXPECT_EQ(text, "Hello from upstream");
}

// A client that goes away mid-stream stops its generation: the gateway
// tells the workers, and the worker closes its upstream stream at the next
// event instead of reading the whole answer.
// Sends a chat request for `model` on a raw connection the caller closes
// (-1 when it could not be sent).
int SendChat(int port, const std::string& model, const std::string& content, bool stream) {
  const std::string body =
      json{{"model", model}, {"stream", stream}, {"messages", json::array({{{"role", "user"}, {"content", content}}})}}
          .dump();
  return PostAndKeepOpen(port, "/v1/chat/completions", body);
}

// The gateway's shoal_gateway_cancels_total.
double GatewayCancels(int port) {
  const std::string metrics = HttpGet(port, "/metrics").body;
  const std::string name = "\nshoal_gateway_cancels_total ";
  const size_t at = metrics.find(name);
  return at == std::string::npos ? -1 : std::stod(metrics.substr(at + name.size()));
}

TEST_F(E2eOpenAi, AClientThatDisconnectsMidStreamStopsItsGeneration) {
  const int cut_before = fake_->cut();
  const double cancels_before = GatewayCancels(gateway_->port);
  const int fd = SendChat(gateway_->port, "long-chat", "long", true);
  ASSERT_GE(fd, 0);
  // Read until two events came, then hang up.
  std::string got;
  const auto until = std::chrono::steady_clock::now() + 60s;
  auto events = [&] {
    size_t n = 0;
    for (size_t at = got.find("data: "); at != std::string::npos; at = got.find("data: ", at + 1)) ++n;
    return n;
  };
  while (events() < 2 && std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 1000) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  ASSERT_GE(events(), 2u) << got;
  EXPECT_NE(got.find("200 OK"), std::string::npos) << got;
  // The worker closed its upstream stream well before its 200 events.
  EXPECT_TRUE(shoal::testing::Eventually([&] { return fake_->cut() > cut_before; }, 30s))
      << "the upstream stream was read to its end";
  EXPECT_EQ(GatewayCancels(gateway_->port), cancels_before + 1);
}

// A client that leaves while the upstream has not answered at all (a
// non-streamed generation, or a stream before its first event) stops it
// too: the gateway notices the closed connection itself, and the worker
// closes its upstream request instead of waiting out the answer (20 s).
TEST_F(E2eOpenAi, AClientThatDisconnectsBeforeAnyAnswerStopsItsGeneration) {
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "not streamed");
    const int cut_before = fake_->cut();
    const double cancels_before = GatewayCancels(gateway_->port);
    const size_t sent_before = fake_->requests().size();
    const int fd = SendChat(gateway_->port, "long-chat", "stall", stream);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(shoal::testing::Eventually([&] { return fake_->requests().size() > sent_before; }, 30s))
        << "the request never reached the upstream";
    ::close(fd);
    EXPECT_TRUE(shoal::testing::Eventually([&] { return fake_->cut() > cut_before; }, 10s))
        << "the upstream request was waited out";
    EXPECT_EQ(GatewayCancels(gateway_->port), cancels_before + 1);
  }
}

// A generation that takes long does not hold back the model's next
// requests: the worker runs up to openai.max_connections (4) of them side by
// side, each started as soon as it comes.
TEST_F(E2eOpenAi, ALongGenerationDoesNotHoldBackTheNextRequests) {
  const size_t sent_before = fake_->requests().size();
  const int fd = SendChat(gateway_->port, "long-chat", "stall", false);  // 20 s upstream
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(shoal::testing::Eventually([&] { return fake_->requests().size() > sent_before; }, 30s));
  for (int i = 0; i < 3; ++i) {
    auto r = Chat("long-chat", "next " + std::to_string(i));
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_NE(r.body.find("echo: next " + std::to_string(i)), std::string::npos) << r.body;
  }
  // The long one has not been answered meanwhile: the others did not wait for it.
  char byte;
  EXPECT_LT(::recv(fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK), 0) << "the long generation was answered first";
  const int cut_before = fake_->cut();
  ::close(fd);  // and is cancelled, from its lane
  EXPECT_TRUE(shoal::testing::Eventually([&] { return fake_->cut() > cut_before; }, 10s));
}

TEST_F(E2eOpenAi, UpstreamErrorsReachTheCallerOnceInOpenAiShape) {
  auto bad = Chat("remote-chat", "fail400");
  EXPECT_EQ(bad.status, 400) << bad.body;
  EXPECT_NE(bad.body.find("maximum context length exceeded"), std::string::npos) << bad.body;
  EXPECT_EQ(ErrorCode(bad.body), "context_length_exceeded");
  auto broken = Chat("remote-chat", "fail500");
  EXPECT_EQ(broken.status, 502) << broken.body;
  EXPECT_EQ(ErrorCode(broken.body), "upstream_error");
  auto slow = Chat("remote-chat", "slow");
  EXPECT_EQ(slow.status, 504) << slow.body;
  EXPECT_EQ(ErrorCode(slow.body), "upstream_timeout");
  auto down = Chat("remote-down", "anyone?");
  EXPECT_EQ(down.status, 502) << down.body;
  EXPECT_EQ(ErrorCode(down.body), "upstream_error");
  // A streamed request that fails before any output gets a plain error.
  auto streamed = Chat("remote-chat", "fail500", /*stream=*/true);
  EXPECT_EQ(streamed.status, 502) << streamed.body;
  // Wrong task and unknown model.
  auto wrong = HttpPostJson(gateway_->port, "/v1/completions", json{{"model", "remote-bert"}, {"prompt", "x"}}.dump());
  EXPECT_EQ(wrong.status, 400);
  EXPECT_EQ(ErrorCode(wrong.body), "wrong_task");
  auto unknown = Chat("nope", "x");
  EXPECT_EQ(unknown.status, 404);
  // Each failed request still reached the upstream once or twice at most
  // (a 4xx batch is rerun alone), never in a redelivery loop.
  int fail500 = 0;
  for (const auto& req : fake_->requests())
    if (req.body.find("fail500") != std::string::npos) ++fail500;
  EXPECT_LE(fail500, 2);
}

}  // namespace
}  // namespace shoal::e2e
