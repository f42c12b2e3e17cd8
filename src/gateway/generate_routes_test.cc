// /v1/completions and /v1/chat/completions on Shoal's own structs, with a
// fake queue side that answers item jobs: validation, model rewriting,
// server-sent events and errors before and during a stream.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gateway/routes.h"

namespace shoal {
namespace {

using nlohmann::json;

std::string Msgpack(const json& j) {
  std::string out;
  json::to_msgpack(j, out);
  return out;
}

class ItemSubmitter : public WorkSubmitter {
 public:
  void SubmitEmbed(EmbedJob, EmbedCallback done) override { done(Internal("not here")); }
  void SubmitItems(ItemJob job, ItemCallback done, PartialCallback partial) override {
    last = job;
    ++calls;
    for (const auto& e : events)
      if (partial) partial(0, Msgpack(e));
    done_ = std::move(done);
    partial_ = std::move(partial);
    if (hold) return;
    Finish();
  }
  void Finish() {
    if (!error.ok()) return done_(error);
    ItemResult r;
    r.items.push_back(Msgpack(result));
    done_(std::move(r));
  }
  ItemJob last;
  int calls = 0;
  std::vector<json> events;
  json result;
  Status error;
  bool hold = false;
  ItemCallback done_;
  PartialCallback partial_;
};

class GenerateRoutesTest : public ::testing::Test {
 protected:
  GenerateRoutesTest() {
    auto snap = std::make_shared<FleetSnapshot>();
    snap->nats_connected = true;
    snap->stream_ok = true;
    CatalogModel g;
    g.name = "gen";
    g.task = "generate";
    snap->models["gen"] = g;
    CatalogModel e;
    e.name = "emb";
    e.task = "embed";
    snap->models["emb"] = e;
    snapshot_ = snap;
    router_ = std::make_unique<Router>(RouterOptions{}, &submitter_, [this] { return snapshot_; }, &metrics_);
  }

  HttpResponse Call(const std::string& path, const std::string& body, int* responses = nullptr) {
    HttpRequest req;
    req.method = "POST";
    req.path = path;
    req.target = path;
    req.body = body;
    HttpResponse out;
    int called = 0;
    router_->Handle(std::move(req), [&](HttpResponse r) {
      ++called;
      out = std::move(r);
    });
    if (responses) *responses = called;
    else EXPECT_EQ(called, 1);
    return out;
  }

  static std::string Text(HttpResponse& r) {
    if (!r.stream) return r.body;
    bool closed = false;
    return r.stream->Take(&closed);
  }

  ItemSubmitter submitter_;
  MetricsRegistry metrics_;
  std::shared_ptr<const FleetSnapshot> snapshot_;
  std::unique_ptr<Router> router_;
};

json Chunk(const std::string& content) {
  return {{"object", "chat.completion.chunk"},
          {"model", "up-model"},
          {"choices", json::array({{{"index", 0}, {"delta", {{"content", content}}}}})}};
}

TEST_F(GenerateRoutesTest, ChatForwardsTheRequestAndRewritesTheModel) {
  submitter_.result = {{"object", "chat.completion"}, {"model", "up-model"},
                       {"choices", json::array({{{"index", 0}, {"message", {{"role", "assistant"}, {"content", "hi"}}}}})}};
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{"role":"user","content":"yo"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  json out = json::parse(r.body);
  EXPECT_EQ(out["model"], "gen");
  EXPECT_EQ(out["choices"][0]["message"]["content"], "hi");
  EXPECT_EQ(submitter_.last.task, "generate");
  ASSERT_EQ(submitter_.last.items.size(), 1u);
  json sent = json::from_msgpack(submitter_.last.items[0]);
  EXPECT_EQ(sent["endpoint"], "chat/completions");
  EXPECT_EQ(sent["messages"][0]["content"], "yo");
}

TEST_F(GenerateRoutesTest, CompletionsUseTheirEndpoint) {
  submitter_.result = {{"object", "text_completion"}, {"model", "x"}, {"choices", json::array()}};
  HttpResponse r = Call("/v1/completions", R"({"model":"gen","prompt":"once upon"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::from_msgpack(submitter_.last.items[0])["endpoint"], "completions");
}

// A result nested deeper than any answer a worker passes on (it bounds
// upstream answers to 64 levels) is not decoded: anything on NATS can
// publish to a reply subject, and the decoder recurses once per level.
TEST_F(GenerateRoutesTest, AResultNestedTooDeepIsAnUpstreamError) {
  json deep = json::array();
  for (int i = 0; i < 100; ++i) deep = json::array({deep});
  submitter_.result = {{"object", "chat.completion"}, {"model", "up-model"}, {"deep", deep}};
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{"role":"user","content":"yo"}]})");
  EXPECT_EQ(r.status, 502) << r.body;
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "upstream_error");
}

TEST_F(GenerateRoutesTest, ValidatesBeforeQueueing) {
  EXPECT_EQ(Call("/v1/chat/completions", R"({"model":"gen"})").status, 400);
  EXPECT_EQ(Call("/v1/completions", R"({"model":"gen"})").status, 400);
  EXPECT_EQ(Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":"yes"})").status, 400);
  HttpResponse unknown = Call("/v1/chat/completions", R"({"model":"nope","messages":[{}]})");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(json::parse(unknown.body)["error"]["code"], "model_not_found");
  HttpResponse wrong = Call("/v1/completions", R"({"model":"emb","prompt":"x"})");
  EXPECT_EQ(wrong.status, 400);
  EXPECT_EQ(json::parse(wrong.body)["error"]["code"], "wrong_task");
  EXPECT_EQ(submitter_.calls, 0);
}

TEST_F(GenerateRoutesTest, UpstreamErrorsKeepTheirStatus) {
  submitter_.error = Status(StatusCode::kBadGateway, "upstream answered 500: boom", "upstream_error");
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}]})");
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "upstream_error");
  submitter_.error = DeadlineExceeded("slow", "upstream_timeout");
  EXPECT_EQ(Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})").status, 504);
}

TEST_F(GenerateRoutesTest, StreamsEventsThenDone) {
  submitter_.events = {Chunk("a"), Chunk("b")};
  submitter_.result = {{"object", "shoal.stream.end"}, {"events", 2}};
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "text/event-stream");
  ASSERT_TRUE(r.stream);
  bool closed = false;
  const std::string text = r.stream->Take(&closed);
  EXPECT_TRUE(closed);
  EXPECT_EQ(text, "data: " + Chunk("a").dump().replace(Chunk("a").dump().find("up-model"), 8, "gen") + "\n\n" +
                      "data: " + Chunk("b").dump().replace(Chunk("b").dump().find("up-model"), 8, "gen") + "\n\n" +
                      "data: [DONE]\n\n");
}

TEST_F(GenerateRoutesTest, AFailureMidStreamEndsWithAnErrorEvent) {
  submitter_.events = {Chunk("a")};
  submitter_.hold = true;
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  ASSERT_TRUE(r.stream);
  submitter_.error = Status(StatusCode::kBadGateway, "upstream went away", "upstream_error");
  submitter_.Finish();
  bool closed = false;
  const std::string text = r.stream->Take(&closed);
  EXPECT_TRUE(closed);
  EXPECT_NE(text.find("\"content\":\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("data: {\"error\":{\"message\":\"upstream went away\""), std::string::npos) << text;
  EXPECT_EQ(text.find("[DONE]"), std::string::npos);
}

// The queue side answers a request (its deadline, the gateway stopping)
// while a partial for it is on its way: the late partial is dropped, not
// sent into a response that is already gone (it used to call the spent
// responder and end the gateway with std::bad_function_call).
TEST_F(GenerateRoutesTest, APartialAfterTheAnswerIsDropped) {
  for (const bool started : {false, true}) {
    submitter_.events = started ? std::vector<json>{Chunk("a")} : std::vector<json>{};
    submitter_.hold = true;
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/chat/completions";
    req.body = R"({"model":"gen","messages":[{}],"stream":true})";
    int responses = 0;
    HttpResponse r;
    router_->Handle(std::move(req), [&](HttpResponse out) {
      ++responses;
      r = std::move(out);
    });
    EXPECT_EQ(responses, started ? 1 : 0);
    submitter_.error = DeadlineExceeded("the request's deadline passed");
    submitter_.Finish();
    ASSERT_TRUE(submitter_.partial_);
    EXPECT_FALSE(submitter_.partial_(0, Msgpack(Chunk("late"))));  // nobody reads it: the work may stop
    EXPECT_EQ(responses, 1);
    if (!started) {
      EXPECT_EQ(r.status, 504);
      EXPECT_FALSE(r.stream);
      continue;
    }
    ASSERT_TRUE(r.stream);
    bool closed = false;
    const std::string text = r.stream->Take(&closed);
    EXPECT_TRUE(closed);
    EXPECT_EQ(text.find("late"), std::string::npos) << text;
  }
}

// A client that went away mid-stream: the next event reports it (false),
// so the dispatcher can have the generation stopped.
TEST_F(GenerateRoutesTest, AnEventForAClientThatWentAwayReportsIt) {
  submitter_.events = {Chunk("a")};
  submitter_.hold = true;
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  ASSERT_TRUE(r.stream);
  ASSERT_TRUE(submitter_.partial_);
  EXPECT_TRUE(submitter_.partial_(0, Msgpack(Chunk("b"))));
  r.stream->Abandon();
  EXPECT_FALSE(submitter_.partial_(0, Msgpack(Chunk("c"))));
}

TEST_F(GenerateRoutesTest, ANonStreamingUpstreamAnswersPlainJson) {
  submitter_.result = {{"object", "chat.completion"}, {"model", "up"}, {"choices", json::array()}};
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  EXPECT_EQ(r.status, 200);
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(json::parse(r.body)["object"], "chat.completion");
}

// The worker's end marker says how many events it sent: fewer arrived (one
// too large to publish, a reply subscription that fell behind) ends the
// stream with 502 stream_interrupted, not [DONE] over cut output; with no
// event arrived at all, that is the whole answer.
TEST_F(GenerateRoutesTest, EventsLostOnTheWayEndWithStreamInterrupted) {
  submitter_.events = {Chunk("a")};
  submitter_.result = {{"object", "shoal.stream.end"}, {"events", 3}};
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  ASSERT_TRUE(r.stream);
  bool closed = false;
  const std::string text = r.stream->Take(&closed);
  EXPECT_TRUE(closed);
  EXPECT_NE(text.find("\"content\":\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"code\":\"stream_interrupted\""), std::string::npos) << text;
  EXPECT_NE(text.find("1 of 3 arrived"), std::string::npos) << text;
  EXPECT_EQ(text.find("[DONE]"), std::string::npos) << text;

  submitter_.events = {};
  submitter_.result = {{"object", "shoal.stream.end"}, {"events", 2}};
  r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "stream_interrupted");
}

// A result or an event the gateway cannot read is a 502, streamed or not:
// not a 200 stream holding only [DONE], nor an event silently skipped.
TEST_F(GenerateRoutesTest, AnUnreadableStreamedResultIs502) {
  submitter_.events = {};
  submitter_.result = json::array({1, 2});  // not a map
  HttpResponse r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "upstream_error");

  submitter_.events = {Chunk("a"), json::array({1})};
  submitter_.result = {{"object", "shoal.stream.end"}, {"events", 2}};
  r = Call("/v1/chat/completions", R"({"model":"gen","messages":[{}],"stream":true})");
  ASSERT_TRUE(r.stream);
  bool closed = false;
  const std::string text = r.stream->Take(&closed);
  EXPECT_TRUE(closed);
  EXPECT_NE(text.find("\"content\":\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"code\":\"upstream_error\""), std::string::npos) << text;
  EXPECT_EQ(text.find("[DONE]"), std::string::npos) << text;
}

}  // namespace
}  // namespace shoal
