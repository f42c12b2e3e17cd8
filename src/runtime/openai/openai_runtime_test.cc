// The openai runtime against a scripted OpenAI-compatible server (a real
// HTTP server on 127.0.0.1): embeddings, completions, streamed chat, error
// mapping, timeouts and connection reuse.
#include "runtime/openai/openai_runtime.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "runtime/openai/sse_parser.h"
#include "support/fake_openai_server.h"
#include "support/test_env.h"

namespace shoal {
namespace {

using nlohmann::json;
using testing::FakeOpenAiServer;

ModelConfig Config(const std::string& task, const std::string& base_url, const std::string& extra = "") {
  ModelConfig c;
  c.name = "remote";
  c.task = task;
  c.runtime = "openai";
  c.config_json = R"({"name":"remote","task":")" + task + R"(","runtime":"openai","openai":{"base_url":")" +
                  base_url + R"(","model":"up-model")" + extra + "}}";
  return c;
}

std::string Msgpack(const json& j) {
  std::string out;
  json::to_msgpack(j, out);
  return out;
}

json FromMsgpack(const std::string& s) { return json::from_msgpack(s); }

std::vector<float> Row(const std::string& doc) {
  json j = json::from_msgpack(doc);
  EXPECT_TRUE(j.is_binary());
  const auto& b = j.get_binary();
  std::vector<float> row(b.size() / sizeof(float));
  std::memcpy(row.data(), b.data(), b.size());
  return row;
}

std::unique_ptr<OpenAiRuntime> Loaded(const ModelConfig& c) {
  auto r = std::make_unique<OpenAiRuntime>();
  Status st = r->Load(c);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return r;
}

TEST(SseParser, SplitsEventsFedInPieces) {
  std::vector<std::string> got;
  SseParser p([&](std::string_view d) {
    got.emplace_back(d);
    return true;
  });
  const std::string stream = ": keep-alive\r\ndata: {\"a\":1}\r\n\r\nevent: x\ndata: line1\ndata:line2\n\ndata: [DONE]\n\n";
  for (char ch : stream) ASSERT_TRUE(p.Feed(std::string_view(&ch, 1)));
  ASSERT_TRUE(p.Finish());
  EXPECT_EQ(got, (std::vector<std::string>{"{\"a\":1}", "line1\nline2", "[DONE]"}));
}

TEST(SseParser, FinishDeliversAnUnterminatedEvent) {
  std::vector<std::string> got;
  SseParser p([&](std::string_view d) {
    got.emplace_back(d);
    return true;
  });
  ASSERT_TRUE(p.Feed("data: tail"));
  EXPECT_TRUE(got.empty());
  ASSERT_TRUE(p.Finish());
  EXPECT_EQ(got, (std::vector<std::string>{"tail"}));
  // A stream cut between the CR and the LF of its last line.
  ASSERT_TRUE(p.Feed("data: [DONE]\r"));
  ASSERT_TRUE(p.Finish());
  EXPECT_EQ(got, (std::vector<std::string>{"tail", "[DONE]"}));
}

// A line fed a byte at a time is still one line (each piece is scanned
// once: 1 MB took 10^12 steps when every piece rescanned the line).
TEST(SseParser, ALongLineFedInSmallPiecesIsOneEvent) {
  std::vector<std::string> got;
  SseParser p([&](std::string_view d) {
    got.emplace_back(d);
    return true;
  });
  const std::string data(1 << 20, 'x');
  ASSERT_TRUE(p.Feed("data: "));
  for (size_t i = 0; i < data.size(); i += 7) ASSERT_TRUE(p.Feed(std::string_view(data).substr(i, 7)));
  ASSERT_TRUE(p.Feed("\n\ndata: next\n\n"));
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], data);
  EXPECT_EQ(got[1], "next");
}

TEST(OpenAiRuntime, RejectsBadConfigs) {
  OpenAiRuntime r;
  ModelConfig c = Config("embed", "http://127.0.0.1:1/v1");
  c.config_json = R"({"name":"remote","runtime":"openai"})";
  EXPECT_EQ(r.Load(c).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenAiRuntime().Load(Config("embed", "https://example.com/v1")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenAiRuntime().Load(Config("score", "http://127.0.0.1:1/v1")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenAiRuntime().Load(Config("embed", "http://127.0.0.1:1/v1", R"(,"api_key_env":"SHOAL_TEST_UNSET_KEY")"))
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(OpenAiRuntime, EmbedsABatchInOneCallOverOneConnection) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) { return FakeOpenAiServer::Embeddings(r.body); });
  ::setenv("SHOAL_TEST_OPENAI_KEY", "sk-test", 1);
  auto rt = Loaded(Config("embed", server.url() + "/v1", R"(,"api_key_env":"SHOAL_TEST_OPENAI_KEY")"));
  EXPECT_TRUE(rt->TakesItems());
  for (int round = 0; round < 3; ++round) {
    auto out = rt->RunItems({"hello world", "a b c"}, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    ASSERT_EQ(out->size(), 2u);
    EXPECT_EQ(Row((*out)[0]), (std::vector<float>{0.6f, 0.8f}));
    EXPECT_EQ(Row((*out)[1]), (std::vector<float>{0.6f, 0.8f}));
  }
  auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 3u);
  EXPECT_EQ(reqs[0].target, "/v1/embeddings");
  EXPECT_EQ(reqs[0].authorization, "Bearer sk-test");
  json body = json::parse(reqs[0].body);
  EXPECT_EQ(body["model"], "up-model");
  EXPECT_EQ(body["input"], json::array({"hello world", "a b c"}));
  EXPECT_EQ(rt->client()->connections_opened(), 1);
}

TEST(OpenAiRuntime, ReconnectsWhenTheUpstreamClosedTheConnection) {
  for (bool announced : {true, false}) {
    FakeOpenAiServer server([announced](const FakeOpenAiServer::Request& r) {
      auto reply = FakeOpenAiServer::Embeddings(r.body);
      // Connection: close, or a keep-alive answer followed by a hang-up
      // (the pooled connection is found dead at the next request).
      (announced ? reply.close : reply.hang_up) = true;
      return reply;
    });
    auto rt = Loaded(Config("embed", server.url() + "/v1"));
    for (int round = 0; round < 3; ++round) {
      auto out = rt->RunItems({"x"}, {});
      ASSERT_TRUE(out.ok()) << announced << " " << out.status().ToString();
    }
    EXPECT_EQ(server.requests().size(), 3u);
    EXPECT_EQ(rt->client()->connections_opened(), 3);
  }
}

// Interim answers (103 Early Hints, 100 Continue) before the real one are
// skipped. Taken as the answer, each request on the pooled connection got
// the previous request's vectors.
TEST(OpenAiRuntime, InterimAnswersAreSkippedAndEachRequestGetsItsOwnAnswer) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    const std::string input = json::parse(r.body)["input"][0];
    const double k = std::stod(input);
    FakeOpenAiServer::Reply reply;
    reply.body = json({{"object", "list"},
                       {"data", json::array({{{"object", "embedding"}, {"index", 0}, {"embedding", {k, 1.0}}}})},
                       {"usage", {{"prompt_tokens", 1}, {"total_tokens", 1}}}})
                     .dump();
    reply.interim = "HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
                    "HTTP/1.1 100 Continue\r\n\r\n";
    return reply;
  });
  auto rt = Loaded(Config("embed", server.url() + "/v1"));
  for (int k = 1; k <= 4; ++k) {
    auto out = rt->RunItems({std::to_string(k)}, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    ASSERT_EQ(out->size(), 1u);
    EXPECT_EQ(Row((*out)[0]), (std::vector<float>{static_cast<float>(k), 1.0f})) << "request " << k;
  }
  EXPECT_EQ(rt->client()->connections_opened(), 1);
}

TEST(OpenAiRuntime, ForwardsCompletionsWithTheUpstreamModelName) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    json req = json::parse(r.body);
    json out = {{"id", "cmpl-1"},
                {"object", "text_completion"},
                {"model", req["model"]},
                {"choices", json::array({{{"index", 0}, {"text", "echo " + req["prompt"].get<std::string>()},
                                          {"finish_reason", "stop"}}})}};
    return FakeOpenAiServer::Reply{200, out.dump()};
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  auto out = rt->RunItems({Msgpack({{"endpoint", "completions"}, {"model", "remote"}, {"prompt", "hi"}})}, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  json doc = FromMsgpack((*out)[0]);
  EXPECT_EQ(doc["choices"][0]["text"], "echo hi");
  EXPECT_EQ(doc["model"], "up-model");
  auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_EQ(reqs[0].target, "/v1/completions");
  EXPECT_FALSE(json::parse(reqs[0].body).contains("endpoint"));
}

std::vector<std::string> ChatEvents(const std::string& tag, int n) {
  std::vector<std::string> ev;
  for (int i = 0; i < n; ++i)
    ev.push_back(json{{"object", "chat.completion.chunk"},
                      {"choices", json::array({{{"index", 0}, {"delta", {{"content", tag + std::to_string(i)}}}}})}}
                     .dump());
  ev.push_back("[DONE]");
  return ev;
}

// An upstream that streams `n` chat events 50 ms apart to every request.
FakeOpenAiServer::Handler SlowChatStream(int n) {
  return [n](const FakeOpenAiServer::Request&) {
    FakeOpenAiServer::Reply reply;
    reply.events = ChatEvents("t", n);
    reply.event_delay_ms = 50;
    return reply;
  };
}

TEST(OpenAiRuntime, StreamsChatEventsToThePartialSink) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    FakeOpenAiServer::Reply reply;
    reply.events = ChatEvents(json::parse(r.body)["messages"][0]["content"].get<std::string>(), 3);
    reply.event_delay_ms = 5;
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1", R"(,"max_connections":2)"));
  std::map<size_t, std::vector<std::string>> got;
  auto request = [](const std::string& tag) {
    return Msgpack({{"endpoint", "chat/completions"},
                    {"stream", true},
                    {"messages", json::array({{{"role", "user"}, {"content", tag}}})}});
  };
  auto out = rt->RunItems({request("a"), request("b"), request("c")}, [&](size_t item, std::string_view chunk) {
    got[item].push_back(FromMsgpack(std::string(chunk))["choices"][0]["delta"]["content"].get<std::string>());
  });
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 3u);
  for (const auto& doc : *out) {
    EXPECT_EQ(FromMsgpack(doc)["object"], "shoal.stream.end");
    EXPECT_EQ(FromMsgpack(doc)["events"], 3);
  }
  EXPECT_EQ(got[0], (std::vector<std::string>{"a0", "a1", "a2"}));
  EXPECT_EQ(got[1], (std::vector<std::string>{"b0", "b1", "b2"}));
  EXPECT_EQ(got[2], (std::vector<std::string>{"c0", "c1", "c2"}));
  EXPECT_LE(rt->client()->connections_opened(), 2);
}

std::string ChatRequest(bool stream) {
  return Msgpack({{"endpoint", "chat/completions"},
                  {"stream", stream},
                  {"messages", json::array({{{"role", "user"}, {"content", "x"}}})}});
}

// The error of a one-request batch: the batch's, or its request's own.
Status OnlyError(const Result<std::vector<std::string>>& out) {
  if (!out.ok()) return out.status();
  return out->size() == 1 ? ParseItemError((*out)[0]) : Internal("not one result");
}

// A batch larger than max_connections runs in waves: a request whose
// caller's deadline passed while it waited for a connection is not sent.
TEST(OpenAiRuntime, ARequestPastItsDeadlineIsNotSent) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    json out = {{"object", "text_completion"}, {"choices", json::array()}, {"prompt", json::parse(r.body)["prompt"]}};
    FakeOpenAiServer::Reply reply{200, out.dump()};
    reply.delay_ms = 300;
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1", R"(,"max_connections":1)"));
  auto request = [](const std::string& prompt) {
    return Msgpack({{"endpoint", "completions"}, {"model", "remote"}, {"prompt", prompt}});
  };
  const int64_t now = SystemClock::Get()->NowUnixMs();
  auto out = rt->RunItemsBefore({request("first"), request("late"), request("open")}, {now + 60000, now + 100, 0},
                                [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(ParseItemError((*out)[0]).ok());
  EXPECT_EQ(ParseItemError((*out)[1]).code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(ParseItemError((*out)[2]).ok());  // 0: no deadline
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  for (const auto& r : reqs) EXPECT_NE(json::parse(r.body)["prompt"], "late");
  // One request alone, already late: not sent either.
  out = rt->RunItemsBefore({request("alone")}, {now - 1}, {});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(ParseItemError((*out)[0]).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(server.requests().size(), 2u);
}

// Each request's result is handed over when its upstream call ends, while
// the batch's slower ones still run; the batch's results are all returned
// as well.
TEST(OpenAiRuntime, EachResultIsHandedOverWhenItsRequestEnds) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    const std::string prompt = json::parse(r.body)["prompt"];
    json out = {{"object", "text_completion"}, {"choices", json::array()}, {"prompt", prompt}};
    FakeOpenAiServer::Reply reply{200, out.dump()};
    reply.delay_ms = prompt == "slow" ? 1500 : 0;
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  auto request = [](const std::string& prompt) {
    return Msgpack({{"endpoint", "completions"}, {"model", "remote"}, {"prompt", prompt}});
  };
  std::vector<size_t> order;  // items in the order their results came
  std::vector<std::string> handed(3);
  ItemCalls calls;
  calls.done = [&](size_t item, const std::string& result) {
    order.push_back(item);
    handed.at(item) = result;
  };
  auto out = rt->RunItemsAsReady({request("slow"), request("quick"), request("quick too")}, {}, calls);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order.back(), 0u) << "the slow request's result came before a quick one's";
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(handed[i], (*out)[i]) << i;
  // A sink that throws fails the batch once its requests are done; it does
  // not end the process.
  calls.done = [](size_t, const std::string&) { throw std::runtime_error("no memory for the reply"); };
  out = rt->RunItemsAsReady({request("quick"), request("quick too")}, {}, calls);
  EXPECT_EQ(out.status().code(), StatusCode::kInternal) << out.status().ToString();
  EXPECT_NE(out.status().message().find("no memory for the reply"), std::string::npos) << out.status().ToString();
}

// A stream whose caller went away is closed at its next event, and its
// result is Cancelled(); one not sent yet is not sent. The others of the
// batch go on.
TEST(OpenAiRuntime, AStreamWhoseCallerWentAwayIsClosed) {
  FakeOpenAiServer server(SlowChatStream(20));
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  std::mutex mu;
  std::vector<int> events(2, 0);  // per item
  std::atomic<bool> gone{false};
  ItemCalls calls;
  calls.partial = [&](size_t item, std::string_view) {
    std::lock_guard<std::mutex> lock(mu);
    if (++events.at(item) == 3 && item == 0) gone = true;
  };
  calls.cancelled = [&](size_t item) { return item == 0 && gone.load(); };
  auto out = rt->RunItemsAsReady({ChatRequest(true), ChatRequest(true)}, {}, calls);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(ParseItemError((*out)[0]).reason(), "cancelled") << ParseItemError((*out)[0]).ToString();
  EXPECT_LT(events[0], 20);
  EXPECT_TRUE(ParseItemError((*out)[1]).ok()) << ParseItemError((*out)[1]).ToString();
  EXPECT_EQ(events[1], 20);
  // Alone: the same; and one already gone is not sent.
  gone = false;
  events = {0, 0};
  out = rt->RunItemsAsReady({ChatRequest(true)}, {}, calls);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(ParseItemError((*out)[0]).reason(), "cancelled");
  EXPECT_LT(events[0], 20);
  const size_t sent = server.requests().size();
  out = rt->RunItemsAsReady({ChatRequest(true)}, {}, calls);  // gone is still true
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(ParseItemError((*out)[0]).reason(), "cancelled");
  EXPECT_EQ(server.requests().size(), sent);
}

// A caller that goes away while its request waits on the upstream (a long
// prefill, a non-streamed answer) closes the connection then, not when the
// upstream finally answers: the upstream stops generating.
TEST(OpenAiRuntime, ARequestWhoseCallerWentAwayWhileItWaitedIsClosed) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    FakeOpenAiServer::Reply reply;
    reply.delay_ms = 20000;
    if (json::parse(r.body).value("stream", false)) {
      reply.events = ChatEvents("t", 2);
    } else {
      reply.body = R"({"choices":[{"index":0,"message":{"content":"late"},"finish_reason":"stop"}]})";
    }
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1", R"(,"timeout_ms":60000)"));
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "not streamed");
    const int cut_before = server.cut();
    const size_t sent_before = server.requests().size();
    ItemCalls calls;
    // Gone once the upstream has the request (and waits to answer it).
    calls.cancelled = [&](size_t) { return server.requests().size() > sent_before; };
    const auto t0 = std::chrono::steady_clock::now();
    auto out = rt->RunItemsAsReady({ChatRequest(stream)}, {}, calls);
    const auto took = std::chrono::steady_clock::now() - t0;
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(ParseItemError((*out)[0]).reason(), "cancelled") << ParseItemError((*out)[0]).ToString();
    EXPECT_LT(took, std::chrono::seconds(10)) << "the answer was waited for";
    // The server notices the close within its poll.
    for (int i = 0; i < 500 && server.cut() == cut_before; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(server.cut(), cut_before + 1) << "the upstream connection stayed open";
  }
}

// A request whose deadline passes while the upstream streams is closed then
// (its caller had its 504): the upstream does not generate for no one.
TEST(OpenAiRuntime, AStreamPastItsDeadlineIsClosed) {
  FakeOpenAiServer server(SlowChatStream(40));
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  std::atomic<int> events{0};
  ItemCalls calls;
  calls.partial = [&](size_t, std::string_view) { ++events; };
  const int64_t deadline = SystemClock::Get()->NowUnixMs() + 400;
  auto out = rt->RunItemsAsReady({ChatRequest(true)}, {deadline}, calls);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(ParseItemError((*out)[0]).code(), StatusCode::kDeadlineExceeded) << ParseItemError((*out)[0]).ToString();
  EXPECT_LT(events.load(), 40);
  EXPECT_TRUE(shoal::testing::Eventually([&] { return server.cut() == 1; }));
}

// An API key read from a file keeps no trailing newline; one with spaces or
// control characters inside, and a base_url with them, would break the
// request line or a header: refused at load.
TEST(OpenAiRuntime, KeysAndUrlsThatWouldBreakARequestAreRefused) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) { return FakeOpenAiServer::Embeddings(r.body); });
  ::setenv("SHOAL_TEST_KEY_NL", "sk-from-a-file\n", 1);
  auto rt = Loaded(Config("embed", server.url() + "/v1", R"(,"api_key_env":"SHOAL_TEST_KEY_NL")"));
  ASSERT_TRUE(rt->RunItems({"hello"}, {}).ok());
  ASSERT_EQ(server.requests().size(), 1u);
  EXPECT_EQ(server.requests()[0].authorization, "Bearer sk-from-a-file");
  ::setenv("SHOAL_TEST_KEY_SP", "sk-one\r\nX-Injected: 1", 1);
  EXPECT_EQ(OpenAiRuntime().Load(Config("embed", server.url() + "/v1", R"(,"api_key_env":"SHOAL_TEST_KEY_SP")")).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenAiRuntime().Load(Config("embed", server.url() + "/v1 HTTP/1.1")).code(), StatusCode::kInvalidArgument);
  ::setenv("SHOAL_TEST_KEY_SP", "\n", 1);  // an empty secret: not a key
  EXPECT_EQ(OpenAiRuntime().Load(Config("embed", server.url() + "/v1", R"(,"api_key_env":"SHOAL_TEST_KEY_SP")")).code(),
            StatusCode::kInvalidArgument);
  ::unsetenv("SHOAL_TEST_KEY_NL");
  ::unsetenv("SHOAL_TEST_KEY_SP");
}

// How a stream ends: [DONE] (what follows it is ignored) or a finish_reason
// without [DONE] complete it; a stream that just stops (the connection
// closed mid-generation) is an upstream error, not a complete answer.
TEST(OpenAiRuntime, AStreamIsCompleteOnlyWithDoneOrAFinishReason) {
  std::vector<std::string> events;
  FakeOpenAiServer server([&](const FakeOpenAiServer::Request&) {
    FakeOpenAiServer::Reply reply;
    reply.events = events;
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  const std::string chunk = ChatEvents("a", 1)[0];
  const std::string last =
      json{{"choices", json::array({{{"index", 0}, {"delta", json::object()}, {"finish_reason", "stop"}}})}}.dump();
  events = {chunk, "[DONE]", chunk};
  auto out = rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 1u);
  EXPECT_EQ(FromMsgpack((*out)[0])["object"], "shoal.stream.end") << FromMsgpack((*out)[0]).dump();
  EXPECT_EQ(FromMsgpack((*out)[0])["events"], 1);
  events = {chunk, last};
  out = rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(FromMsgpack((*out)[0])["object"], "shoal.stream.end") << FromMsgpack((*out)[0]).dump();
  events = {chunk, chunk};
  const Status cut = OnlyError(rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {}));
  EXPECT_EQ(cut.code(), StatusCode::kBadGateway) << cut.ToString();
  EXPECT_EQ(cut.reason(), "upstream_error");
  EXPECT_NE(cut.message().find("without [DONE]"), std::string::npos) << cut.ToString();
}

// The same when the connection breaks (the response never ends): complete
// if a finish_reason came, else the broken stream is the error.
TEST(OpenAiRuntime, AStreamThatBreaksAfterAFinishReasonIsComplete) {
  std::vector<std::string> events;
  FakeOpenAiServer server([&](const FakeOpenAiServer::Request&) {
    FakeOpenAiServer::Reply reply;
    reply.events = events;
    reply.break_after_events = true;
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  const std::string chunk = ChatEvents("a", 1)[0];
  const std::string last =
      json{{"choices", json::array({{{"index", 0}, {"delta", json::object()}, {"finish_reason", "stop"}}})}}.dump();
  events = {chunk, last};
  auto out = rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(FromMsgpack((*out)[0])["object"], "shoal.stream.end") << FromMsgpack((*out)[0]).dump();
  events = {chunk, chunk};
  const Status cut = OnlyError(rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {}));
  EXPECT_EQ(cut.code(), StatusCode::kBadGateway) << cut.ToString();
  EXPECT_NE(cut.message().find("the stream broke"), std::string::npos) << cut.ToString();
  // Several choices (n > 1): complete only once every one has ended.
  const auto choice = [](int index, bool last) {
    json c = {{"index", index}, {"delta", {{"content", "x"}}}};
    c["finish_reason"] = last ? json("stop") : json(nullptr);
    return json{{"choices", json::array({c})}}.dump();
  };
  events = {choice(0, false), choice(1, false), choice(0, true)};
  const Status half = OnlyError(rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {}));
  EXPECT_NE(half.message().find("the stream broke"), std::string::npos) << half.ToString();
  events = {choice(0, false), choice(1, false), choice(0, true), choice(1, true)};
  out = rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(FromMsgpack((*out)[0])["object"], "shoal.stream.end") << FromMsgpack((*out)[0]).dump();
}

// An upstream that sends [DONE] but keeps the response open: the answer is
// complete at [DONE] (not a 504 after the whole timeout); the connection it
// held is dropped, and the next request gets a fresh one.
TEST(OpenAiRuntime, AStreamEndsAtDoneEvenWhenTheUpstreamKeepsItOpen) {
  std::atomic<bool> stall{true};
  FakeOpenAiServer server([&](const FakeOpenAiServer::Request&) {
    FakeOpenAiServer::Reply reply;
    reply.events = {ChatEvents("a", 1)[0], "[DONE]"};
    reply.stall_after_events = stall;
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1", R"(,"timeout_ms":20000)"));
  auto out = rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 1u);
  EXPECT_EQ(FromMsgpack((*out)[0])["object"], "shoal.stream.end") << FromMsgpack((*out)[0]).dump();
  EXPECT_EQ(FromMsgpack((*out)[0])["events"], 1);
  stall = false;
  out = rt->RunItems({ChatRequest(true)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(FromMsgpack((*out)[0])["object"], "shoal.stream.end");
  EXPECT_EQ(rt->client()->connections_opened(), 2);
}

// An answer nested far deeper than any real one (as a body or as one
// stream event) is an upstream error, not a stack overflow in the worker.
TEST(OpenAiRuntime, DeeplyNestedAnswersAreUpstreamErrors) {
  const std::string deep = R"({"x":)" + std::string(200000, '[') + std::string(200000, ']') + "}";
  bool stream = false;
  FakeOpenAiServer server([&](const FakeOpenAiServer::Request&) {
    FakeOpenAiServer::Reply reply{200, deep};
    if (stream) reply.events = {deep, "[DONE]"};
    return reply;
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  for (bool s : {false, true}) {
    stream = s;
    const Status st = OnlyError(rt->RunItems({ChatRequest(s)}, [](size_t, std::string_view) {}));
    EXPECT_EQ(st.reason(), "upstream_error") << s;
    EXPECT_NE(st.message().find("nested deeper"), std::string::npos) << st.ToString();
  }
  auto embed = Loaded(Config("embed", server.url() + "/v1"));
  stream = false;
  EXPECT_EQ(embed->RunItems({"x"}, {}).status().reason(), "upstream_error");
}

// A generate input published to the queue directly (past the gateway's
// checks) that nests a million one-element arrays in 1 MiB is refused
// before nlohmann's reader, which recurses once per level, would take the
// worker's stack; the upstream is never called, and the next input is
// served.
TEST(OpenAiRuntime, DeeplyNestedGenerateInputsAreRefusedBeforeDecoding) {
  std::atomic<int> calls{0};
  FakeOpenAiServer server([&](const FakeOpenAiServer::Request&) {
    ++calls;
    return FakeOpenAiServer::Reply{200, R"({"id":"c","object":"chat.completion","choices":[]})"};
  });
  auto rt = Loaded(Config("generate", server.url() + "/v1"));
  std::string deep(1 << 20, '\x91');  // fixarray of one element, a million deep
  deep.push_back('\xc0');
  const Status st = OnlyError(rt->RunItems({deep}, [](size_t, std::string_view) {}));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_EQ(st.reason(), "nesting_too_deep") << st.ToString();
  EXPECT_EQ(calls.load(), 0);
  auto out = rt->RunItems({ChatRequest(false)}, [](size_t, std::string_view) {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(ParseItemError((*out)[0]).ok()) << ParseItemError((*out)[0]).ToString();
  EXPECT_EQ(calls.load(), 1);
}

TEST(OpenAiRuntime, MapsUpstreamErrors) {
  int status = 400;
  FakeOpenAiServer server([&](const FakeOpenAiServer::Request&) {
    return FakeOpenAiServer::Reply{status, R"({"error":{"message":"prompt is too long","code":"context_length"}})"};
  });
  auto rt = Loaded(Config("embed", server.url() + "/v1"));
  auto out = rt->RunItems({"x"}, {});
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("prompt is too long"), std::string::npos) << out.status().message();
  EXPECT_EQ(out.status().reason(), "context_length");
  status = 429;
  EXPECT_EQ(rt->RunItems({"x"}, {}).status().code(), StatusCode::kResourceExhausted);
  status = 500;
  out = rt->RunItems({"x"}, {});
  EXPECT_EQ(out.status().code(), StatusCode::kBadGateway);
  EXPECT_EQ(out.status().reason(), "upstream_error");
  status = 503;
  EXPECT_EQ(rt->RunItems({"x"}, {}).status().code(), StatusCode::kBadGateway);
}

// An error body past 64 KiB is not parsed (a 256 MiB array of numbers
// would take gigabytes as a tree): its start is the message.
TEST(OpenAiRuntime, LargeErrorBodiesAreReadAsText) {
  const std::string big = R"({"error":{"message":"short","pad":")" + std::string(70 * 1024, 'x') + R"("}})";
  const Status large = UpstreamError(400, big);
  EXPECT_EQ(large.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(large.message().find(R"(upstream answered 400: {"error":{"message":"short")"), std::string::npos)
      << large.message().substr(0, 100);
  EXPECT_LT(large.message().size(), 1000u);
  const Status small = UpstreamError(400, R"({"error":{"message":"short","pad":"xx"}})");
  EXPECT_EQ(small.message().find("{"), std::string::npos) << small.message();
  EXPECT_NE(small.message().find("short"), std::string::npos) << small.message();
}

TEST(OpenAiRuntime, ConnectionRefusedIsBadGateway) {
  int port = 0;
  {
    FakeOpenAiServer gone([](const FakeOpenAiServer::Request&) { return FakeOpenAiServer::Reply{}; });
    port = gone.port();
  }
  auto rt = Loaded(Config("embed", "http://127.0.0.1:" + std::to_string(port) + "/v1"));
  auto out = rt->RunItems({"x"}, {});
  EXPECT_EQ(out.status().code(), StatusCode::kBadGateway) << out.status().ToString();
  EXPECT_EQ(out.status().reason(), "upstream_error");
}

// A host name is resolved (off the caller's thread, bounded by the connect
// timeout); one that does not resolve is an upstream error, not a hang.
TEST(OpenAiRuntime, ResolvesHostNames) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) { return FakeOpenAiServer::Embeddings(r.body); });
  auto rt = Loaded(Config("embed", "http://localhost:" + std::to_string(server.port()) + "/v1"));
  for (int i = 0; i < 2; ++i) {
    auto out = rt->RunItems({"hello"}, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(Row((*out)[0]), (std::vector<float>{0.6f, 0.8f}));
  }
  auto nowhere = Loaded(Config("embed", "http://no-such-host.invalid/v1", R"(,"connect_timeout_ms":2000)"));
  const Status st = nowhere->RunItems({"hello"}, {}).status();
  EXPECT_TRUE(st.code() == StatusCode::kBadGateway || st.code() == StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_NE(st.message().find("cannot resolve no-such-host.invalid"), std::string::npos) << st.ToString();
}

TEST(OpenAiRuntime, SlowUpstreamTimesOut) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request& r) {
    auto reply = FakeOpenAiServer::Embeddings(r.body);
    reply.delay_ms = 1500;
    return reply;
  });
  auto rt = Loaded(Config("embed", server.url() + "/v1", R"(,"timeout_ms":200)"));
  auto out = rt->RunItems({"x"}, {});
  EXPECT_EQ(out.status().code(), StatusCode::kDeadlineExceeded) << out.status().ToString();
  EXPECT_EQ(out.status().reason(), "upstream_timeout");
}

TEST(OpenAiRuntime, MalformedEmbeddingsAreBadGateway) {
  FakeOpenAiServer server([](const FakeOpenAiServer::Request&) {
    return FakeOpenAiServer::Reply{200, R"({"data":[{"index":0,"embedding":"zz"}]})"};
  });
  auto rt = Loaded(Config("embed", server.url() + "/v1"));
  EXPECT_EQ(rt->RunItems({"x"}, {}).status().code(), StatusCode::kBadGateway);
  EXPECT_EQ(rt->RunItems({"x", "y"}, {}).status().code(), StatusCode::kBadGateway);
}

// A component beyond float's range would have become an infinity, written
// as 0 in the JSON answer; it is the upstream's error instead.
TEST(OpenAiRuntime, ComponentsOutsideFloatRangeAreBadGateway) {
  for (const std::string v : {"1e39", "-3.5e38"}) {
    SCOPED_TRACE(v);
    FakeOpenAiServer server([v](const FakeOpenAiServer::Request&) {
      return FakeOpenAiServer::Reply{200, R"({"data":[{"index":0,"embedding":[0.5, )" + v + "]}]}"};
    });
    auto rt = Loaded(Config("embed", server.url() + "/v1"));
    const Status st = rt->RunItems({"x"}, {}).status();
    EXPECT_EQ(st.code(), StatusCode::kBadGateway) << st.ToString();
    EXPECT_NE(st.message().find("outside float range"), std::string::npos) << st.ToString();
  }
}

}  // namespace
}  // namespace shoal
