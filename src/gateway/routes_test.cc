// Unit tests of the HTTP routes on Shoal's own request/response structs,
// with a fake queue side: validation, error mapping, rendering.
#include "gateway/routes.h"

#include <cmath>
#include <cstring>

#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "gateway/internal/http_json.h"

namespace shoal {
namespace {

using nlohmann::json;

// Answers every job with row i = [i+1, 0, 0, 0] (dim 4) and 3 tokens per row,
// or with a fixed error.
class FakeSubmitter : public WorkSubmitter {
 public:
  void SubmitEmbed(EmbedJob job, EmbedCallback done) override {
    last = job;
    ++calls;
    if (!error.ok()) return done(error);
    EmbedResult r;
    r.rows = static_cast<int>(job.size());
    r.dim = 4;
    for (int i = 0; i < r.rows; ++i) {
      r.data.insert(r.data.end(), {static_cast<float>(i + 1), 0.f, 0.f, 0.f});
      r.prompt_tokens += 3;
    }
    done(std::move(r));
  }
  void RequestLoad(const std::string& model) override { load_requests.push_back(model); }
  EmbedJob last;
  int calls = 0;
  Status error;
  std::vector<std::string> load_requests;
};

// Records what it was asked and answers with a canned outcome.
class FakeController : public ModelController {
 public:
  void Act(const std::string& action, const std::string& model, const std::string& worker,
           ControlCallback done) override {
    asked.push_back(action + " " + model + " @" + worker);
    if (!error.ok()) return done(error);
    ControlOutcome o;
    o.model = model;
    o.action = action;
    o.results = results;
    done(o);
  }
  std::vector<std::string> asked;
  std::vector<ControlResult> results;
  Status error;
};

class RoutesTest : public ::testing::Test {
 protected:
  RoutesTest() {
    auto snap = std::make_shared<FleetSnapshot>();
    snap->nats_connected = true;
    snap->stream_ok = true;
    CatalogModel m;
    m.name = "m";
    m.task = "embed";
    m.dim = 4;
    m.max_seq_len = 16;
    snap->models["m"] = m;
    CatalogModel rr;
    rr.name = "rr";
    rr.task = "score";
    rr.dim = 1;
    snap->models["rr"] = rr;
    CatalogModel cls;
    cls.name = "cls";
    cls.task = "classify";
    cls.dim = 4;
    cls.labels = {"a", "b", "c", "d"};
    snap->models["cls"] = cls;
    snapshot_ = snap;
    RouterOptions o;
    o.max_inputs = 8;
    router_ = std::make_unique<Router>(o, &submitter_, [this] { return snapshot_; }, &metrics_, &clock_);
  }

  HttpResponse Call(const std::string& method, const std::string& path, const std::string& body,
                    std::vector<std::pair<std::string, std::string>> headers = {}) {
    HttpRequest req;
    req.method = method;
    req.path = path;
    req.target = path;
    req.body = body;
    req.headers = std::move(headers);
    req.client = client_;
    HttpResponse out;
    bool called = false;
    router_->Handle(std::move(req), [&](HttpResponse r) {
      EXPECT_FALSE(called) << "responded twice";
      called = true;
      out = std::move(r);
    });
    EXPECT_TRUE(called);
    return out;
  }

  // Adds a live worker with this heartbeat to the fleet view.
  void AddWorker(const std::string& heartbeat) {
    auto snap = std::make_shared<FleetSnapshot>(*snapshot_);
    snap->worker_json.push_back(heartbeat);
    WorkerInfo info;
    EXPECT_TRUE(ParseWorkerHeartbeat(heartbeat, &info));
    snap->workers.push_back(info);
    snapshot_ = snap;
  }

  static std::string ErrorCode(const HttpResponse& r) {
    auto j = json::parse(r.body);
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"]["type"].is_string());
    return j["error"]["code"].get<std::string>();
  }

  FakeClock clock_;
  MetricsRegistry metrics_;
  std::shared_ptr<ClientPresence> client_ = std::make_shared<ClientPresence>();  // every Call's
  FakeSubmitter submitter_;
  std::shared_ptr<const FleetSnapshot> snapshot_;
  std::unique_ptr<Router> router_;
};

TEST_F(RoutesTest, EmbeddingsRendersOpenAIShape) {
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":["a","b"]})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["model"], "m");
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][1]["object"], "embedding");
  EXPECT_EQ(j["data"][1]["index"], 1);
  EXPECT_EQ(j["data"][1]["embedding"], json::parse("[2,0,0,0]"));
  EXPECT_EQ(j["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(j["usage"]["total_tokens"], 6);
  EXPECT_EQ(submitter_.last.texts, (std::vector<std::string>{"a", "b"}));
  EXPECT_GT(submitter_.last.deadline_unix_ms, clock_.NowUnixMs());
}

TEST_F(RoutesTest, EmbeddingsBase64IsLittleEndianFloat32) {
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a","encoding_format":"base64"})");
  ASSERT_EQ(r.status, 200);
  auto j = json::parse(r.body);
  // [1,0,0,0] as float32 LE: 00 00 80 3f + 12 zero bytes.
  EXPECT_EQ(j["data"][0]["embedding"], "AACAPwAAAAAAAAAAAAAAAA==");
}

TEST_F(RoutesTest, DimensionsShortensAndRenormalises) {
  submitter_.error = Status::Ok();
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":["a","b"],"dimensions":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["data"][1]["embedding"], json::parse("[1,0]"));  // [2,0] renormalised
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"a","dimensions":5})").status, 400);
  // A model whose width the catalog does not know yet (dim 0 until its
  // first load): too many dimensions are refused once the answer says the
  // width, not passed through at full width.
  auto snap = std::make_shared<FleetSnapshot>(*snapshot_);
  snap->models["m"].dim = 0;
  snapshot_ = snap;
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a","dimensions":5})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(ErrorCode(r), "invalid_dimensions");
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"a","dimensions":4})").status, 200);
}

TEST_F(RoutesTest, AcceptsEveryOpenAIInputForm) {
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"one"})").status, 200);
  EXPECT_EQ(submitter_.last.texts.size(), 1u);
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":[1,2,3]})").status, 200);
  EXPECT_EQ(submitter_.last.token_ids, (std::vector<std::vector<int32_t>>{{1, 2, 3}}));
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":[[1],[2,3]]})").status, 200);
  EXPECT_EQ(submitter_.last.token_ids.size(), 2u);
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"x","truncate":true})").status, 200);
  EXPECT_TRUE(submitter_.last.truncate);
}

struct BadCase {
  const char* name;
  const char* body;
  int status;
  const char* code;
};

TEST_F(RoutesTest, EveryBadInputGetsItsStatusAndCode) {
  const BadCase cases[] = {
      {"not json", "{\"model\":", 400, "invalid_json"},
      {"not an object", "[1,2]", 400, "invalid_json"},
      // The parser's message quotes the bad byte; the body stays valid JSON.
      {"ill-formed UTF-8", "{\"model\":\"m\",\"input\":\"\xff\xfe\"}", 400, "invalid_json"},
      {"no model", R"({"input":"a"})", 400, "invalid_model"},
      {"model not a string", R"({"model":7,"input":"a"})", 400, "invalid_model"},
      {"unknown model", R"({"model":"nope","input":"a"})", 404, "model_not_found"},
      {"no input", R"({"model":"m"})", 400, "missing_input"},
      {"empty string", R"({"model":"m","input":""})", 400, "empty_input"},
      {"empty list", R"({"model":"m","input":[]})", 400, "empty_input"},
      {"empty string in list", R"({"model":"m","input":["a",""]})", 400, "empty_input"},
      {"empty token array", R"({"model":"m","input":[[]]})", 400, "empty_input"},
      {"number input", R"({"model":"m","input":5})", 400, "invalid_input"},
      {"object input", R"({"model":"m","input":{"a":1}})", 400, "invalid_input"},
      {"mixed list", R"({"model":"m","input":["a",1]})", 400, "invalid_input"},
      {"float token", R"({"model":"m","input":[[1.5]]})", 400, "invalid_input"},
      {"negative token", R"({"model":"m","input":[[-1]]})", 400, "invalid_token_id"},
      {"token past int32", R"({"model":"m","input":[[2147483648]]})", 400, "invalid_token_id"},
      // Past INT64_MAX: an unsigned value, which must not wrap into range.
      {"token past int64", R"({"model":"m","input":[[9223372036854775808]]})", 400, "invalid_token_id"},
      {"token 2^64 - 1", R"({"model":"m","input":[[18446744073709551615]]})", 400, "invalid_token_id"},
      {"too many inputs", R"({"model":"m","input":["a","b","c","d","e","f","g","h","i"]})", 400, "too_many_inputs"},
      {"bad encoding", R"({"model":"m","input":"a","encoding_format":"int8"})", 400, "invalid_encoding_format"},
      {"bad dimensions", R"({"model":"m","input":"a","dimensions":0})", 400, "invalid_dimensions"},
      {"bad truncate", R"({"model":"m","input":"a","truncate":"yes"})", 400, "invalid_truncate"},
  };
  for (const auto& c : cases) {
    auto r = Call("POST", "/v1/embeddings", c.body);
    EXPECT_EQ(r.status, c.status) << c.name << ": " << r.body;
    EXPECT_EQ(ErrorCode(r), c.code) << c.name;
  }
  EXPECT_EQ(submitter_.calls, 0) << "bad input must never reach the queue";
}

TEST_F(RoutesTest, ErrorMessagesQuotingClientBytesStayValidUtf8) {
  // A model name from the path is not parsed JSON: ill-formed bytes become
  // U+FFFD, well-formed multi-byte characters pass unchanged.
  auto r = Call("POST", "/v1/encode/bad\xff\xc0\xaf\xed\xa0\x80name", R"({"inputs":["a"]})");
  EXPECT_EQ(r.status, 404) << r.body;
  EXPECT_EQ(ErrorCode(r), "model_not_found");
  const std::string message = json::parse(r.body)["error"]["message"];
  EXPECT_NE(message.find("bad\uFFFD"), std::string::npos) << message;
  EXPECT_NE(message.find("name"), std::string::npos) << message;
  r = Call("POST", "/v1/embeddings", R"({"model":"日本語 é 🐟","input":"a"})");
  EXPECT_EQ(r.status, 404) << r.body;
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("日本語 é 🐟"), std::string::npos);
}

TEST_F(RoutesTest, QueueErrorsMapToStatusWithRetryAfter) {
  submitter_.error = ResourceExhausted("full", "queue_full");
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a"})");
  EXPECT_EQ(r.status, 429);
  EXPECT_EQ(ErrorCode(r), "queue_full");
  bool retry = false;
  for (auto& [k, v] : r.headers) retry |= k == "Retry-After";
  EXPECT_TRUE(retry);
  submitter_.error = DeadlineExceeded("late", "deadline_exceeded");
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a"})");
  EXPECT_EQ(r.status, 504);
  submitter_.error = Unprocessable("too long", "input_too_long");
  r = Call("POST", "/v1/encode/m", R"({"inputs":["a"]})");
  EXPECT_EQ(r.status, 422);
  EXPECT_EQ(ErrorCode(r), "input_too_long");
}

TEST_F(RoutesTest, TimeoutHeaderSetsTheDeadline) {
  ASSERT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"a"})", {{"shoal-timeout-ms", "250"}}).status, 200);
  EXPECT_EQ(submitter_.last.deadline_unix_ms, clock_.NowUnixMs() + 250);
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a"})", {{"shoal-timeout-ms", "soon"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_timeout");
  // Empty, or given twice: refused too, not read as the default or as one of them.
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a"})", {{"shoal-timeout-ms", ""}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_timeout");
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"a"})",
           {{"shoal-timeout-ms", "100"}, {"shoal-timeout-ms", "0"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_timeout");
}

// Every route that queues work hands its client on, so the work of a
// client that disconnects is dropped (Dispatcher: AnnounceCancel).
TEST_F(RoutesTest, EveryRouteThatQueuesWorkHandsOnItsClient) {
  const std::vector<std::pair<std::string, std::string>> calls = {
      {"/v1/embeddings", R"({"model":"m","input":"a"})"},
      {"/v1/encode/m", R"({"inputs":["a"]})"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["d"]})"},
      {"/v1/score", R"({"model":"rr","text_1":"q","text_2":"a"})"},
      {"/v1/classify", R"({"model":"cls","input":"x"})"}};
  for (const auto& [path, body] : calls) {
    submitter_.last = EmbedJob{};
    ASSERT_EQ(Call("POST", path, body).status, 200) << path;
    EXPECT_EQ(submitter_.last.client, client_) << path;
  }
}

TEST_F(RoutesTest, EncodeSpeaksJsonAndMessagePack) {
  auto r = Call("POST", "/v1/encode/m", R"({"inputs":["a","b"]})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["dim"], 4);
  EXPECT_EQ(j["embeddings"][1], json::parse("[2,0,0,0]"));

  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(2);
  pk.pack(std::string("inputs"));
  pk.pack(std::vector<std::string>{"a", "b", "c"});
  pk.pack(std::string("truncate"));
  pk.pack(true);
  r = Call("POST", "/v1/encode/m", std::string(buf.data(), buf.size()),
           {{"content-type", "application/msgpack"}, {"accept", "application/msgpack"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "application/msgpack");
  EXPECT_TRUE(submitter_.last.truncate);
  auto h = msgpack::unpack(r.body.data(), r.body.size());
  auto m = h.get().as<std::map<std::string, msgpack::object>>();
  EXPECT_EQ(m["rows"].as<int>(), 3);
  EXPECT_EQ(m["dim"].as<int>(), 4);
  ASSERT_EQ(m["embeddings"].type, msgpack::type::BIN);
  ASSERT_EQ(m["embeddings"].via.bin.size, 3u * 4 * sizeof(float));
  float third;
  std::memcpy(&third, m["embeddings"].via.bin.ptr + 8 * sizeof(float), sizeof third);
  EXPECT_EQ(third, 3.0f);

  // MessagePack takes what JSON takes: one flat token array is one input,
  // and a nil truncate is the default, as JSON's null.
  msgpack::sbuffer flat;
  msgpack::packer<msgpack::sbuffer> fp(flat);
  fp.pack_map(2);
  fp.pack(std::string("inputs"));
  fp.pack(std::vector<int>{101, 7, 102});
  fp.pack(std::string("truncate"));
  fp.pack_nil();
  r = Call("POST", "/v1/encode/m", std::string(flat.data(), flat.size()), {{"content-type", "application/msgpack"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.token_ids, (std::vector<std::vector<int32_t>>{{101, 7, 102}}));
  EXPECT_FALSE(submitter_.last.truncate);

  r = Call("POST", "/v1/encode/m", "\xc1\xc1", {{"content-type", "application/msgpack"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_msgpack");
  // Refused before any route took it, and counted all the same.
  EXPECT_NE(Call("GET", "/metrics", "").body.find("shoal_http_errors_total{code=\"invalid_msgpack\"} 1"),
            std::string::npos);
  r = Call("POST", "/v1/encode/nope", R"({"inputs":["a"]})");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(ErrorCode(r), "model_not_found");
}

// A parsed value costs 16-24 bytes against 1-2 in the body: a body of
// millions of tiny values is refused before it is parsed into memory.
TEST_F(RoutesTest, BodiesWithMoreValuesThanTheBoundGet413) {
  const uint64_t kMax = internal::kMaxRequestValues;
  std::string zeros;
  zeros.reserve(2 * kMax);
  for (uint64_t i = 0; i < kMax; ++i) zeros += i == 0 ? "0" : ",0";
  // The root object, "model", the input list and the token array are four
  // values more: over the bound.
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":[[)" + zeros + "]]}");
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(ErrorCode(r), "too_many_values");
  // A large body with few values is counted and passes.
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":")" + std::string(2 * kMax + 16, 'x') + R"("})");
  EXPECT_EQ(r.status, 200) << r.body.substr(0, 300);
  EXPECT_EQ(submitter_.calls, 1);

  // MessagePack: {inputs: [[0, 0, ...]]}, one value over; then an array
  // header that claims more than the bound in a body large enough to be
  // checked.
  const auto be32 = [](uint32_t n) {
    return std::string{static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                       static_cast<char>(n)};
  };
  const std::string head = std::string("\x81\xa6inputs\xdd") + be32(1) + "\xdd";
  const std::vector<std::pair<std::string, std::string>> kMsgpack = {{"content-type", "application/msgpack"}};
  r = Call("POST", "/v1/encode/m", head + be32(static_cast<uint32_t>(kMax)) + std::string(kMax, '\0'), kMsgpack);
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(ErrorCode(r), "too_many_values");
  // A header that claims more elements than the body has bytes is refused
  // before msgpack-c reserves room for them (24 bytes each).
  for (const std::string& body : {head + be32(0xffffffffu), head + be32(0xffffffffu) + std::string(kMax, '\0')}) {
    r = Call("POST", "/v1/encode/m", body, kMsgpack);
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(ErrorCode(r), "invalid_msgpack");
  }
  // A large body with few values is counted and passes.
  const uint32_t long_text = static_cast<uint32_t>(kMax) + 10;
  r = Call("POST", "/v1/encode/m", std::string("\x81\xa6inputs\x91\xdb") + be32(long_text) + std::string(long_text, 'x'),
           kMsgpack);
  EXPECT_EQ(r.status, 200) << r.body.substr(0, 300);
  EXPECT_EQ(submitter_.calls, 2) << "refused bodies never reach the queue";
}

// Nesting deep enough to exhaust the stack of a recursive encoder or
// decoder is refused, in JSON and in MessagePack, on every route.
TEST_F(RoutesTest, BodiesNestedDeeperThanTheBoundGet400) {
  const int kDepth = internal::kMaxRequestDepth;
  const auto nested_json = [](int depth) {
    return R"({"model":"m","input":)" + std::string(depth, '[') + "1" + std::string(depth, ']') + "}";
  };
  // The root object is one level: kDepth - 1 arrays inside it are allowed
  // (and rejected by validation), one more is not.
  auto r = Call("POST", "/v1/embeddings", nested_json(kDepth - 1));
  EXPECT_EQ(ErrorCode(r), "invalid_input") << r.body;
  r = Call("POST", "/v1/embeddings", nested_json(kDepth));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "nesting_too_deep");
  r = Call("POST", "/v1/chat/completions", R"({"model":"m","messages":)" + std::string(1 << 20, '[') + "}");
  EXPECT_EQ(ErrorCode(r), "nesting_too_deep");

  // 1 MiB of 0x91 (an array of one element, nested): it would overflow
  // the stack of a recursive MessagePack reader.
  const std::vector<std::pair<std::string, std::string>> kMsgpack = {{"content-type", "application/msgpack"}};
  const std::string deep = "\x81\xa5input" + std::string(1 << 20, '\x91') + "\x01";
  for (const char* path : {"/v1/embeddings", "/v1/encode/m", "/v1/rerank"}) {  // OCR: ocr_routes_test
    r = Call("POST", path, deep, kMsgpack);
    EXPECT_EQ(r.status, 400) << path;
    EXPECT_EQ(ErrorCode(r), "nesting_too_deep") << path;
  }
  EXPECT_EQ(submitter_.calls, 0);
}

// A MessagePack body for a JSON route becomes JSON text, where a control
// character takes 6 bytes: a body that would pass the body limit as text
// is 413 before the text is written (256 MiB of them became 1.5 GiB).
// Ordinary and non-ASCII text takes what it took.
TEST_F(RoutesTest, MessagePackBodiesThatWouldGrowPastTheBodyLimitAsJsonAre413) {
  RouterOptions o;
  o.max_body_bytes = 2000;
  router_ = std::make_unique<Router>(o, &submitter_, [this] { return snapshot_; }, &metrics_, &clock_);
  const std::vector<std::pair<std::string, std::string>> kMsgpack = {{"content-type", "application/msgpack"}};
  auto body = [](const std::string& input) {
    std::string out;
    json::to_msgpack(json{{"model", "m"}, {"input", input}}, out);
    return out;
  };
  auto r = Call("POST", "/v1/embeddings", body(std::string(400, '\x01')), kMsgpack);  // 2,400 bytes as text
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(ErrorCode(r), "payload_too_large");
  EXPECT_EQ(Call("POST", "/nowhere", body(std::string(400, '\x01')), kMsgpack).status, 413);
  EXPECT_EQ(submitter_.calls, 0);
  r = Call("POST", "/v1/embeddings", body(std::string(1900, 'a')), kMsgpack);
  EXPECT_EQ(r.status, 200) << r.body;
  std::string cjk;
  for (int i = 0; i < 600; ++i) cjk += "\xe4\xb8\xad";  // 1,800 bytes of U+4E2D
  r = Call("POST", "/v1/embeddings", body(cjk), kMsgpack);
  EXPECT_EQ(r.status, 200) << r.body;
  // Line breaks take 2 bytes as JSON: 900 of them fit.
  r = Call("POST", "/v1/embeddings", body(std::string(900, '\n')), kMsgpack);
  EXPECT_EQ(r.status, 200) << r.body;
  // Token ids take their digits: 300 of "12345," fit.
  std::string ids;
  json::to_msgpack(json{{"model", "m"}, {"input", json::array({std::vector<int>(300, 12345)})}}, ids);
  r = Call("POST", "/v1/embeddings", ids, kMsgpack);
  EXPECT_NE(r.status, 413) << r.body;
}

TEST_F(RoutesTest, EveryJsonRouteAlsoSpeaksMessagePack) {
  const std::vector<std::pair<std::string, std::string>> kMsgpack = {{"content-type", "application/msgpack"},
                                                                        {"accept", "application/msgpack"}};
  auto unpack = [](const HttpResponse& r) { return json::from_msgpack(r.body); };
  // /v1/embeddings: the OpenAI shape, each embedding a bin of float32.
  auto body = json::to_msgpack(json{{"model", "m"}, {"input", {"a", "b"}}});
  auto r = Call("POST", "/v1/embeddings", std::string(body.begin(), body.end()),
                kMsgpack);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "application/msgpack");
  auto h = msgpack::unpack(r.body.data(), r.body.size());
  auto m = h.get().as<std::map<std::string, msgpack::object>>();
  auto data = m["data"].as<std::vector<std::map<std::string, msgpack::object>>>();
  ASSERT_EQ(data.size(), 2u);
  ASSERT_EQ(data[1]["embedding"].type, msgpack::type::BIN);
  ASSERT_EQ(data[1]["embedding"].via.bin.size, 4 * sizeof(float));
  float first;
  std::memcpy(&first, data[1]["embedding"].via.bin.ptr, sizeof first);
  EXPECT_EQ(first, 2.0f);
  // /v1/rerank: request and response transcoded.
  body = json::to_msgpack(json{{"model", "rr"}, {"query", "q"}, {"documents", {"d0", "d1"}}});
  r = Call("POST", "/v1/rerank", std::string(body.begin(), body.end()), kMsgpack);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "application/msgpack");
  EXPECT_EQ(unpack(r)["results"].size(), 2u);
  // /v1/models answers in MessagePack when asked.
  r = Call("GET", "/v1/models", "", {{"accept", "application/msgpack"}});
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(unpack(r)["object"], "list");
  // ... and in JSON when MessagePack is listed but JSON is preferred.
  r = Call("GET", "/v1/models", "", {{"accept", "application/json, application/msgpack;q=0.1"}});
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "application/json");
  // Errors too: the OpenAI error shape, in MessagePack.
  r = Call("POST", "/v1/rerank", "\xc1", kMsgpack);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.content_type, "application/msgpack");
  EXPECT_EQ(unpack(r)["error"]["code"], "invalid_msgpack");
  // A str that is not UTF-8 is refused as the same bytes in JSON are (it
  // was embedded with U+FFFD in their place).
  body = json::to_msgpack(json{{"model", "m"}, {"input", std::string("a\xff" "b")}});
  r = Call("POST", "/v1/embeddings", std::string(body.begin(), body.end()), {{"content-type", "application/msgpack"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_msgpack");
  // An empty body is not MessagePack either (it was read as empty JSON).
  for (const char* path : {"/v1/embeddings", "/v1/rerank"}) {
    r = Call("POST", path, "", {{"content-type", "application/msgpack"}});
    EXPECT_EQ(r.status, 400) << path;
    EXPECT_EQ(ErrorCode(r), "invalid_msgpack") << path;
  }
  // A MessagePack array is not a request object; a JSON caller gets JSON.
  body = json::to_msgpack(json::array({1, 2}));
  r = Call("POST", "/v1/embeddings", std::string(body.begin(), body.end()), {{"content-type", "application/msgpack"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.content_type, "application/json");
  EXPECT_EQ(ErrorCode(r), "invalid_msgpack");
}

// A route that parses JSON takes MessagePack transcoded to JSON, where a
// bin or ext value has no form (nlohmann writes each byte out as a number:
// a 250 MB bin became 1 GB of JSON). Such a body is refused before it is
// decoded; /v1/encode, which reads MessagePack itself, still takes bin.
TEST_F(RoutesTest, MessagePackBinaryValuesAreRefusedWhereTheyHaveNoJsonForm) {
  const std::vector<std::pair<std::string, std::string>> kMsgpack = {{"content-type", "application/msgpack"}};
  // {"model": "m", "input": <bin "abc">}, then the same with ext type 1.
  const std::string head = std::string("\x82\xa5model\xa1m\xa5input");
  for (const std::string& value : {std::string("\xc4\x03" "abc", 5), std::string("\xc7\x03\x01" "abc", 6)}) {
    for (const char* path : {"/v1/embeddings", "/v1/classify", "/v1/score", "/v1/rerank"}) {
      auto r = Call("POST", path, head + value, kMsgpack);
      EXPECT_EQ(r.status, 400) << path;
      EXPECT_EQ(ErrorCode(r), "invalid_msgpack") << path;
      EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("no JSON form"), std::string::npos);
    }
  }
  EXPECT_EQ(submitter_.calls, 0);
  // The same body with a str value passes.
  auto r = Call("POST", "/v1/embeddings", head + "\xa3" "abc", kMsgpack);
  EXPECT_EQ(r.status, 200) << r.body;
  // /v1/encode reads the body itself: a bin there is a wrong type for
  // "inputs", not a transcoding refusal.
  r = Call("POST", "/v1/encode/m", std::string("\x81\xa6inputs\xc4\x03" "abc", 12), kMsgpack);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["message"].get<std::string>().find("no JSON form"), std::string::npos)
      << r.body;
}

TEST_F(RoutesTest, RoutesMethodsAndProbes) {
  EXPECT_EQ(Call("GET", "/nope", "").status, 404);
  EXPECT_EQ(Call("GET", "/v1/embeddings", "").status, 405);
  EXPECT_EQ(Call("GET", "/healthz", "").status, 200);
  // No worker heartbeat yet: not ready.
  auto r = Call("GET", "/readyz", "");
  EXPECT_EQ(r.status, 503);
  AddWorker(R"({"id":"w1","models":[{"name":"m","state":"loaded","memory_bytes":5}]})");
  EXPECT_EQ(Call("GET", "/readyz", "").status, 200);
  auto models = json::parse(Call("GET", "/v1/models", "").body);
  ASSERT_EQ(models["data"].size(), 3u);  // sorted by id: cls, m, rr
  EXPECT_EQ(models["data"][1]["id"], "m");
  EXPECT_EQ(models["data"][1]["workers"][0]["worker"], "w1");
  Call("POST", "/v1/embeddings", R"({"model":"m","input":""})");
  auto text = Call("GET", "/metrics", "").body;
  EXPECT_NE(text.find("shoal_http_requests_total{route=\"/v1/embeddings\",code=\"400\"}"), std::string::npos);
  EXPECT_NE(text.find("shoal_http_errors_total{code=\"empty_input\"}"), std::string::npos);
  // Every GET route takes HEAD (the server sends no body); the others say
  // what they take.
  for (const char* path : {"/healthz", "/readyz", "/metrics", "/v1/models", "/v1/models/m", "/v1/workers"}) {
    EXPECT_EQ(Call("HEAD", path, "").status, 200) << path;
    r = Call("DELETE", path, "");
    EXPECT_EQ(r.status, 405) << path;
    ASSERT_EQ(r.headers.size(), 1u) << path;
    EXPECT_EQ(r.headers[0], (std::pair<std::string, std::string>("Allow", "GET, HEAD"))) << path;
  }
  r = Call("HEAD", "/v1/embeddings", "");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.headers[0].second, "POST");
  // Error codes a runtime passes on from an upstream are any strings: the
  // series stop growing at a bound, and the rest count as "other".
  for (int i = 0; i < 300; ++i) {
    submitter_.error = Status(StatusCode::kBadGateway, "upstream said no", "upstream_code_" + std::to_string(i));
    EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"x"})").status, 502);
  }
  // Shoal's own codes that operators watch keep their series past the bound.
  submitter_.error = ResourceExhausted("full", "queue_full");
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"x"})").status, 429);
  submitter_.error = Status::Ok();
  text = Call("GET", "/metrics", "").body;
  EXPECT_NE(text.find("shoal_http_errors_total{code=\"queue_full\"} 1"), std::string::npos);
  size_t series = 0;
  for (size_t pos = 0; (pos = text.find("\nshoal_http_errors_total{", pos)) != std::string::npos; ++pos) ++series;
  EXPECT_LE(series, 130u);
  EXPECT_NE(text.find("shoal_http_errors_total{code=\"other\"}"), std::string::npos);
  EXPECT_NE(text.find("shoal_http_errors_total{code=\"upstream_code_0\"} 1"), std::string::npos);
}

// A model name in a path is percent-encoded (it may hold '/' or spaces) on
// every route that names one.
TEST_F(RoutesTest, ModelNamesInPathsArePercentDecoded) {
  auto snap = std::make_shared<FleetSnapshot>(*snapshot_);
  CatalogModel odd = snap->models["m"];
  odd.name = "team/m v2";
  snap->models[odd.name] = odd;
  snapshot_ = snap;
  auto r = Call("POST", "/v1/encode/team%2Fm%20v2", R"({"inputs":["a"]})");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.model, "team/m v2");
  EXPECT_EQ(json::parse(Call("GET", "/v1/models/team%2Fm%20v2", "").body)["id"], "team/m v2");
  for (const char* bad : {"/v1/encode/%zz", "/v1/encode/"}) {
    r = Call("POST", bad, R"({"inputs":["a"]})");
    EXPECT_EQ(r.status, 400) << bad;
    EXPECT_EQ(ErrorCode(r), "invalid_model") << bad;
  }
}

TEST_F(RoutesTest, ModelsShowEachWorkersStateAndTheFleetState) {
  AddWorker(R"({"id":"w1","models":[{"name":"m","state":"failed","error":"bad file","measured_bytes":11}]})");
  auto one = json::parse(Call("GET", "/v1/models/m", "").body);
  EXPECT_EQ(one["state"], "failed");
  EXPECT_EQ(one["workers"][0]["error"], "bad file");
  EXPECT_EQ(one["workers"][0]["measured_bytes"], 11);  // at an earlier load there
  AddWorker(R"({"id":"w2","models":[{"name":"m","state":"loaded","pinned":true,"memory_bytes":7,"last_used_unix_ms":9}]})");
  one = json::parse(Call("GET", "/v1/models/m", "").body);
  EXPECT_EQ(one["state"], "loaded");  // the best any worker has
  ASSERT_EQ(one["workers"].size(), 2u);
  EXPECT_EQ(one["workers"][1]["pinned"], true);
  EXPECT_EQ(one["workers"][1]["memory_bytes"], 7);
  EXPECT_EQ(one["workers"][1]["last_used_unix_ms"], 9);
  auto r = Call("GET", "/v1/models/nope", "");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(ErrorCode(r), "model_not_found");
  EXPECT_EQ(Call("POST", "/v1/models/m", "").status, 405);
  r = Call("GET", "/v1/models/bad%zz", "");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_model");
}

TEST_F(RoutesTest, ModelActionsGoToTheControllerAndReportEveryWorker) {
  // Without a controller: 503.
  auto r = Call("POST", "/v1/models/m/load", "");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(ErrorCode(r), "control_unavailable");
  FakeController control;
  router_->SetModelController(&control);
  control.results = {{"w1", Status::Ok(), R"({"state":"loaded"})"}};
  r = Call("POST", "/v1/models/org%2Fm%20x/pin", R"({"worker":"w1"})");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(control.asked.back(), "pin org/m x @w1");
  auto body = json::parse(r.body);
  EXPECT_EQ(body["results"][0]["status"]["state"], "loaded");
  EXPECT_EQ(Call("GET", "/v1/models/m/unload", "").status, 405);
  // A mistyped action is a missing route, not a method the model refuses.
  r = Call("POST", "/v1/models/m/reload", "");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(ErrorCode(r), "route_not_found");
  EXPECT_EQ(Call("POST", "/v1/models/m", "").status, 405);
  r = Call("POST", "/v1/models/m/load", R"({"worker":5})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_worker");
  // An empty id is not "the whole fleet".
  const size_t asked = control.asked.size();
  r = Call("POST", "/v1/models/m/unload", R"({"worker":""})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "invalid_worker");
  EXPECT_EQ(control.asked.size(), asked);
  r = Call("POST", "/v1/models/m/load", "[1]");
  EXPECT_EQ(ErrorCode(r), "invalid_json");
  // One worker failing fails the request with its status; both are reported.
  control.results = {{"w1", Status::Ok(), "{}"},
                     {"w2", Status(StatusCode::kInvalidArgument, "pinned", "model_pinned"), ""}};
  r = Call("POST", "/v1/models/m/unload", "");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(ErrorCode(r), "model_pinned");
  body = json::parse(r.body);
  EXPECT_EQ(body["results"].size(), 2u);
  EXPECT_EQ(body["results"][1]["ok"], false);
  control.error = Unavailable("no live worker serves model 'm'", "no_worker");
  r = Call("POST", "/v1/models/m/load", "");
  EXPECT_EQ(r.status, 503);
  EXPECT_FALSE(r.headers.empty());  // Retry-After
  EXPECT_EQ(ErrorCode(r), "no_worker");
}

// A worker's error message may quote bytes that are not UTF-8 (a parser's
// excerpt of a garbled reply): the answer is still JSON, with U+FFFD for
// them, and the gateway lives on.
TEST_F(RoutesTest, AWorkersMessageThatIsNotUtf8StillGivesAJsonAnswer) {
  FakeController control;
  router_->SetModelController(&control);
  control.results = {{"w\xff" "1", Status(StatusCode::kInternal, "unreadable reply: \xff\xfe", "runtime_error"), ""}};
  auto r = Call("POST", "/v1/models/m/load", "");
  EXPECT_EQ(r.status, 500);
  auto body = json::parse(r.body);
  EXPECT_EQ(body["results"][0]["error"]["message"], "unreadable reply: \uFFFD\uFFFD");
  control.results = {{"w\xff" "1", Status::Ok(), "{}"}};
  r = Call("POST", "/v1/models/m/load", "");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(json::parse(r.body)["results"][0]["worker"], "w\uFFFD1");
}

TEST_F(RoutesTest, NoWaitGatewayAnswers503AndAsksForTheLoad) {
  RouterOptions o;
  o.wait_for_load = false;
  o.retry_after_s = 3;
  router_ = std::make_unique<Router>(o, &submitter_, [this] { return snapshot_; }, &metrics_, &clock_);
  // No live worker serves it: no load can be under way (one is still asked
  // for, for a worker yet to come).
  auto r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"hi"})");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(ErrorCode(r), "no_worker");
  EXPECT_EQ(submitter_.load_requests, std::vector<std::string>{"m"});
  // Every worker that serves it failed to load it: the failure, as a
  // waiting caller would get it, not "being loaded" for ever.
  AddWorker(R"({"id":"w0","models":[{"name":"m","state":"failed","error":"model.pt is truncated"}]})");
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"hi"})");
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(ErrorCode(r), "model_load_failed");
  EXPECT_NE(r.body.find("model.pt is truncated"), std::string::npos) << r.body;
  AddWorker(R"({"id":"w3","models":[{"name":"m","state":"not_loaded"}]})");
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"hi"})");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(ErrorCode(r), "model_loading");
  ASSERT_EQ(r.headers.size(), 1u);
  EXPECT_EQ(r.headers[0].first, "Retry-After");
  EXPECT_EQ(r.headers[0].second, "3");
  EXPECT_EQ(submitter_.load_requests, (std::vector<std::string>{"m", "m", "m"}));
  EXPECT_EQ(submitter_.calls, 0);  // no work was queued
  AddWorker(R"({"id":"w1","models":[{"name":"m","state":"loading"}]})");
  EXPECT_EQ(Call("POST", "/v1/encode/m", R"({"inputs":["a"]})").status, 503);
  AddWorker(R"({"id":"w2","models":[{"name":"m","state":"loaded"}]})");
  EXPECT_EQ(Call("POST", "/v1/embeddings", R"({"model":"m","input":"hi"})").status, 200);
  // While NATS cannot be reached, no worker is known to have it: that is
  // the queue's unavailability, not a load under way, and no load is asked
  // for (the hint would wait in the client's reconnect buffer).
  auto disconnected = std::make_shared<FleetSnapshot>(*snapshot_);
  disconnected->nats_connected = false;
  disconnected->workers.clear();
  disconnected->worker_json.clear();
  snapshot_ = disconnected;
  const size_t loads_asked = submitter_.load_requests.size();
  r = Call("POST", "/v1/embeddings", R"({"model":"m","input":"hi"})");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(ErrorCode(r), "queue_unavailable");
  EXPECT_EQ(submitter_.load_requests.size(), loads_asked);
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

// The fake answers row i with score i + 1, so later documents rank higher.
TEST_F(RoutesTest, RerankSortsByScoreAndHonoursTopN) {
  auto r = Call("POST", "/v1/rerank",
                R"({"model":"rr","query":"q","documents":["d0",{"text":"d1"},"d2"],"top_n":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["model"], "rr");
  EXPECT_EQ(j["id"].get<std::string>().rfind("rerank-", 0), 0u);
  ASSERT_EQ(j["results"].size(), 2u);
  EXPECT_EQ(j["results"][0]["index"], 2);
  EXPECT_EQ(j["results"][0]["relevance_score"], 3.0);
  EXPECT_EQ(j["results"][0]["document"]["text"], "d2");
  EXPECT_EQ(j["results"][1]["index"], 1);
  EXPECT_EQ(j["results"][1]["document"]["text"], "d1");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 9);
  // The queue got one pair per document, the query first, truncation on.
  EXPECT_EQ(submitter_.last.task, "score");
  EXPECT_EQ(submitter_.last.texts, (std::vector<std::string>{"q", "q", "q"}));
  EXPECT_EQ(submitter_.last.texts_pair, (std::vector<std::string>{"d0", "d1", "d2"}));
  EXPECT_TRUE(submitter_.last.truncate);

  auto bare = json::parse(Call("POST", "/v1/rerank",
                               R"({"model":"rr","query":"q","documents":["x","y"],"return_documents":false,
                                   "truncate":false})").body);
  ASSERT_EQ(bare["results"].size(), 2u);
  EXPECT_FALSE(bare["results"][0].contains("document"));
  EXPECT_FALSE(submitter_.last.truncate);
  // Any top_n from 1 up is taken, beyond int64 too (it used to wrap to -1).
  auto all = Call("POST", "/v1/rerank",
                  R"({"model":"rr","query":"q","documents":["d0","d1","d2"],"top_n":18446744073709551615})");
  ASSERT_EQ(all.status, 200) << all.body;
  EXPECT_EQ(json::parse(all.body)["results"].size(), 3u);
}

TEST_F(RoutesTest, ScorePairsOneToManyOrZipped) {
  auto r = Call("POST", "/v1/score", R"({"model":"rr","text_1":"q","text_2":["a","b"]})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][1]["index"], 1);
  EXPECT_EQ(j["data"][1]["object"], "score");
  EXPECT_EQ(j["data"][1]["score"], 2.0);
  EXPECT_EQ(submitter_.last.texts, (std::vector<std::string>{"q", "q"}));

  ASSERT_EQ(Call("POST", "/v1/score", R"({"model":"rr","text_1":["q1","q2"],"text_2":["a","b"]})").status, 200);
  EXPECT_EQ(submitter_.last.texts, (std::vector<std::string>{"q1", "q2"}));
  EXPECT_EQ(submitter_.last.texts_pair, (std::vector<std::string>{"a", "b"}));
  ASSERT_EQ(Call("POST", "/v1/score", R"({"model":"rr","text_1":"q","text_2":"a"})").status, 200);
  EXPECT_EQ(submitter_.last.texts_pair, (std::vector<std::string>{"a"}));
}

TEST_F(RoutesTest, ClassifyNamesTheLabelAndReturnsProbabilities) {
  auto r = Call("POST", "/v1/classify", R"({"model":"cls","input":["x","y"]})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][0]["label"], "a");
  EXPECT_EQ(j["data"][0]["num_classes"], 4);
  EXPECT_EQ(j["data"][1]["probs"], json::parse("[2.0,0.0,0.0,0.0]"));
  EXPECT_EQ(submitter_.last.task, "classify");
  EXPECT_FALSE(submitter_.last.truncate);
}

TEST_F(RoutesTest, EveryBadScoringInputGetsItsStatusAndCode) {
  struct Case {
    const char* path;
    const char* body;
    int status;
    const char* code;
  };
  const Case cases[] = {
      {"/v1/rerank", R"({"query":"q","documents":["a"]})", 400, "invalid_model"},
      {"/v1/rerank", R"({"model":"rr","documents":["a"]})", 400, "invalid_query"},
      {"/v1/rerank", R"({"model":"rr","query":"","documents":["a"]})", 400, "invalid_query"},
      {"/v1/rerank", R"({"model":"rr","query":"q"})", 400, "invalid_documents"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":[]})", 400, "invalid_documents"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":[7]})", 400, "invalid_documents"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":[{"body":"a"}]})", 400, "invalid_documents"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a","b","c","d","e","f","g","h","i"]})", 400,
       "too_many_inputs"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a"],"top_n":0})", 400, "invalid_top_n"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a"],"top_n":"2"})", 400, "invalid_top_n"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a"],"top_n":-1})", 400, "invalid_top_n"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a"],"top_n":1.5})", 400, "invalid_top_n"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a"],"return_documents":1})", 400,
       "invalid_return_documents"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a"],"truncate":"no"})", 400, "invalid_truncate"},
      {"/v1/rerank", R"({"model":"m","query":"q","documents":["a"]})", 400, "wrong_task"},
      {"/v1/rerank", R"({"model":"nope","query":"q","documents":["a"]})", 404, "model_not_found"},
      {"/v1/score", R"({"model":"rr","text_2":["a"]})", 400, "missing_input"},
      {"/v1/score", R"({"model":"rr","text_1":"q","text_2":[]})", 400, "empty_input"},
      {"/v1/score", R"({"model":"rr","text_1":"","text_2":"b"})", 400, "empty_input"},
      {"/v1/score", R"({"model":"rr","text_1":"q","text_2":["a",""]})", 400, "empty_input"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":["a",""]})", 400, "empty_input"},
      {"/v1/rerank", R"({"model":"rr","query":"q","documents":[{"text":""}]})", 400, "empty_input"},
      {"/v1/classify", R"({"model":"cls","input":""})", 400, "empty_input"},
      {"/v1/classify", R"({"model":"cls","input":[]})", 400, "empty_input"},
      {"/v1/classify", R"({"model":"cls","input":["x",""]})", 400, "empty_input"},
      {"/v1/score", R"({"model":"rr","text_1":"q","text_2":[1]})", 400, "invalid_input"},
      {"/v1/score", R"({"model":"rr","text_1":["a","b"],"text_2":["a","b","c"]})", 400, "invalid_input"},
      {"/v1/score", R"({"model":"rr","text_1":["a","b"],"text_2":"c"})", 400, "invalid_input"},
      {"/v1/score", R"({"model":"cls","text_1":"a","text_2":"b"})", 400, "wrong_task"},
      {"/v1/classify", R"({"model":"cls"})", 400, "missing_input"},
      {"/v1/classify", R"({"model":"cls","input":{"a":1}})", 400, "invalid_input"},
      {"/v1/classify", R"({"model":"rr","input":"x"})", 400, "wrong_task"},
      {"/v1/embeddings", R"({"model":"rr","input":"x"})", 400, "wrong_task"},
      {"/v1/classify", "{", 400, "invalid_json"},
  };
  for (const auto& c : cases) {
    auto r = Call("POST", c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.path << " " << c.body << ": " << r.body;
    EXPECT_EQ(ErrorCode(r), c.code) << c.path << " " << c.body;
  }
  EXPECT_EQ(submitter_.calls, 0) << "bad input must never reach the queue";
  EXPECT_EQ(Call("GET", "/v1/rerank", "").status, 405);
}

// A rerank (or 1:N score) request repeats its query once per document on
// the queue: the pairs' bytes are bounded (the gateway sets the bound to
// its body limit), and the model is checked before anything is copied.
TEST_F(RoutesTest, PairingTheQueryWithEachDocumentIsBounded) {
  RouterOptions o;
  o.max_inputs = 8;
  o.max_body_bytes = 100;
  router_ = std::make_unique<Router>(o, &submitter_, [this] { return snapshot_; }, &metrics_, &clock_);
  const auto rerank = [&](const std::string& model, size_t query_bytes) {
    json docs = json::array();
    for (int i = 0; i < 8; ++i) docs.push_back("d" + std::to_string(i));
    return Call("POST", "/v1/rerank",
                json{{"model", model}, {"query", std::string(query_bytes, 'q')}, {"documents", docs}}.dump());
  };
  // 8 documents of 2 bytes and a 10-byte query: 96 bytes of pairs.
  auto r = rerank("rr", 10);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.texts, std::vector<std::string>(8, std::string(10, 'q')));
  // An 11-byte query: 104.
  r = rerank("rr", 11);
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(ErrorCode(r), "pairs_too_large");
  // A query far over the bound for a model that does not exist is a 404,
  // found before the query is copied.
  r = rerank("nope", 1 << 20);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(ErrorCode(r), "model_not_found");
  // /v1/score 1:N is held to the same bound; N:N repeats nothing.
  const json eight = json::array({"a", "b", "c", "d", "e", "f", "g", "h"});
  r = Call("POST", "/v1/score", json{{"model", "rr"}, {"text_1", std::string(11, 'q')}, {"text_2", eight}}.dump());
  EXPECT_EQ(r.status, 200) << r.body;
  r = Call("POST", "/v1/score", json{{"model", "rr"}, {"text_1", std::string(12, 'q')}, {"text_2", eight}}.dump());
  EXPECT_EQ(r.status, 413);
  EXPECT_EQ(ErrorCode(r), "pairs_too_large");
  r = Call("POST", "/v1/score", json{{"model", "rr"}, {"text_1", std::string(200, 'q')}, {"text_2", "a"}}.dump());
  EXPECT_EQ(r.status, 200) << "1:1 pairs nothing";
  EXPECT_EQ(submitter_.calls, 3);
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

TEST_F(RoutesTest, WorkersListsBusySecondsSlotsAndBudgets) {
  auto empty = json::parse(Call("GET", "/v1/workers", "").body);
  EXPECT_EQ(empty["object"], "list");
  EXPECT_TRUE(empty["data"].empty());
  AddWorker(R"({"id":"w1","host":"h","device":"cuda:1","device_slots":2,"busy_seconds":12.5,"heartbeat_unix_ms":7,
                "memory_used_bytes":300,"memory_budget_bytes":1000,
                "host_memory_used_bytes":40,"host_memory_budget_bytes":500,
                "models":[{"name":"m","state":"loaded"},{"name":"rr","state":"not_loaded"}]})");
  AddWorker(R"({"id":"w2","models":[]})");  // an older worker: no busy_seconds
  auto r = Call("GET", "/v1/workers", "");
  ASSERT_EQ(r.status, 200);
  auto j = json::parse(r.body);
  ASSERT_EQ(j["data"].size(), 2u);
  const auto& w1 = j["data"][0];
  EXPECT_EQ(w1["id"], "w1");
  EXPECT_EQ(w1["object"], "worker");
  EXPECT_DOUBLE_EQ(w1["busy_seconds"].get<double>(), 12.5);
  EXPECT_EQ(w1["device_slots"], 2);
  EXPECT_EQ(w1["device"], "cuda:1");
  EXPECT_EQ(w1["models_loaded"], json::array({"m"}));
  EXPECT_EQ(w1["memory_used_bytes"], 300);
  EXPECT_EQ(w1["memory_budget_bytes"], 1000);
  // A GPU worker's models in host memory have their own budget.
  EXPECT_EQ(w1["host_memory_used_bytes"], 40);
  EXPECT_EQ(w1["host_memory_budget_bytes"], 500);
  EXPECT_FALSE(j["data"][1].contains("host_memory_budget_bytes"));  // a CPU worker: one budget
  EXPECT_EQ(j["data"][1]["busy_seconds"], 0);
  EXPECT_EQ(j["data"][1]["device_slots"], 1);
  EXPECT_EQ(j["data"][1]["device"], "cpu");
  EXPECT_EQ(Call("POST", "/v1/workers", "").status, 405);
}

TEST(AcceptHeader, MessagePackOnlyWhenPreferredAtLeastAsMuchAsJson) {
  using internal::AcceptsMsgpack;
  EXPECT_FALSE(AcceptsMsgpack(""));
  EXPECT_FALSE(AcceptsMsgpack("*/*"));
  EXPECT_FALSE(AcceptsMsgpack("application/json"));
  EXPECT_TRUE(AcceptsMsgpack("application/msgpack"));
  EXPECT_TRUE(AcceptsMsgpack("Application/X-MsgPack"));
  EXPECT_TRUE(AcceptsMsgpack("application/vnd.msgpack, */*;q=0.5"));
  EXPECT_TRUE(AcceptsMsgpack("application/json, application/msgpack"));  // a tie: MessagePack
  EXPECT_FALSE(AcceptsMsgpack("application/json, application/msgpack;q=0.1"));
  EXPECT_FALSE(AcceptsMsgpack("application/msgpack;q=0"));
  EXPECT_TRUE(AcceptsMsgpack("application/json;q=0.5, application/msgpack;q=0.9"));
  EXPECT_FALSE(AcceptsMsgpack("application/*, application/msgpack; q=0.8"));
  EXPECT_FALSE(AcceptsMsgpack("application/msgpack;q=oops"));  // an unreadable q counts as 0
  EXPECT_TRUE(internal::IsMsgpackType("application/msgpack; charset=binary"));
  EXPECT_TRUE(internal::IsMsgpackType(" APPLICATION/MSGPACK"));
  EXPECT_FALSE(internal::IsMsgpackType("application/msgpackx"));
  EXPECT_FALSE(internal::IsMsgpackType("application/json"));
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

// The gateway id is part of every reply subject, which workers refuse past
// 1,024 bytes: a long one is refused at start, not by every worker later.
TEST(DispatcherOptionsTest, AGatewayIdTooLongForAReplySubjectIsRefused) {
  DispatcherOptions o;
  o.gateway_id = std::string(128, 'g');
  EXPECT_TRUE(o.Validate().ok());
  o.gateway_id = std::string(129, 'g');
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shoal
