// End to end: the built `shoal serve` (private nats-server -js, worker with
// libtorch and tiny-bert, gateway) driven over real HTTP.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "e2e/http_client.h"
#include "e2e/process.h"
#include "e2e/shoal_cluster.h"
#include "support/test_env.h"

namespace shoal::e2e {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kModel = "tiny-bert";
constexpr int kDim = 64;
constexpr int kMaxInputs = 128;
constexpr int kMaxBodyBytes = 64 * 1024;
// Rows of one input computed in different batches (other padding, other
// batch shapes) agree to float rounding, not bit for bit.
constexpr double kTolerance = 1e-4;

// One `shoal serve` shared by the tests of this suite (ctest runs each test
// in its own process, so each still gets a fresh one).
class E2eServe : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new shoal::testing::TempDir();
    serve_ = new Shoal(StartServe(dir_->path(), {"--models", kModel, "--chunk-size", "8", "--max-inputs",
                                                 std::to_string(kMaxInputs), "--max-body-bytes",
                                                 std::to_string(kMaxBodyBytes), "--threads", "1"}));
    ready_status_ = WaitForReadyz(serve_->port, 200, 60s);
  }
  static void TearDownTestSuite() {
    delete serve_;
    serve_ = nullptr;
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(ready_status_, 200) << "/readyz never became 200"; }

  static int port() { return serve_->port; }
  static Vectors Embed(const std::vector<std::string>& texts) { return EmbedOrThrow(port(), kModel, texts).rows; }
  static std::vector<float> EmbedOne(const std::string& text) { return Embed({text}).at(0); }

  static shoal::testing::TempDir* dir_;
  static Shoal* serve_;
  static int ready_status_;
};

shoal::testing::TempDir* E2eServe::dir_ = nullptr;
Shoal* E2eServe::serve_ = nullptr;
int E2eServe::ready_status_ = 0;

void ExpectUnitRows(const Vectors& rows, size_t dim) {
  for (size_t i = 0; i < rows.size(); ++i) {
    ASSERT_EQ(rows[i].size(), dim) << "row " << i;
    EXPECT_NEAR(L2Norm(rows[i]), 1.0, 1e-4) << "row " << i;
  }
}

TEST_F(E2eServe, HealthAndReadiness) {
  auto h = HttpGet(port(), "/healthz");
  EXPECT_EQ(h.status, 200) << h.error;
  auto r = HttpGet(port(), "/readyz");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j.at("ready"), true);
  EXPECT_EQ(j.at("nats"), true);
  EXPECT_EQ(j.at("stream"), true);
  EXPECT_GE(j.at("workers").get<int>(), 1);
}

TEST_F(E2eServe, EmbedsStringAndListInputs) {
  const std::vector<std::string> texts = {"The quick brown fox.", "Shoal serves small models on owned hardware.",
                                          "hello"};
  auto single_a = HttpPostJson(port(), "/v1/embeddings", json({{"model", kModel}, {"input", texts[0]}}).dump());
  ASSERT_EQ(single_a.status, 200) << single_a.body;
  auto a = ParseOpenAiEmbeddings(single_a.body);
  EXPECT_EQ(a.model, kModel);
  ASSERT_EQ(a.rows.size(), 1u);
  ExpectUnitRows(a.rows, kDim);
  EXPECT_GT(a.prompt_tokens, 0);
  EXPECT_EQ(a.total_tokens, a.prompt_tokens);

  auto single_b = EmbedOrThrow(port(), kModel, {texts[1]});
  auto single_c = EmbedOrThrow(port(), kModel, {texts[2]});

  auto list = EmbedOrThrow(port(), kModel, texts);
  ASSERT_EQ(list.rows.size(), 3u);
  EXPECT_EQ(list.indices, (std::vector<int64_t>{0, 1, 2}));
  ExpectUnitRows(list.rows, kDim);
  EXPECT_EQ(list.prompt_tokens, a.prompt_tokens + single_b.prompt_tokens + single_c.prompt_tokens);
  EXPECT_LT(MaxAbsDiff(list.rows[0], a.rows[0]), kTolerance);
  EXPECT_LT(MaxAbsDiff(list.rows[1], single_b.rows[0]), kTolerance);
  EXPECT_LT(MaxAbsDiff(list.rows[2], single_c.rows[0]), kTolerance);
  // Different texts embed differently.
  EXPECT_GT(MaxAbsDiff(list.rows[0], list.rows[1]), 1e-3);
}

TEST_F(E2eServe, IdenticalTextGivesIdenticalVectors) {
  const std::string text = "the same sentence, twice";
  auto first = EmbedOne(text);
  auto second = EmbedOne(text);
  EXPECT_EQ(first, second) << "the same request twice";
  auto batch = Embed({text, "something else entirely", text});
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_LT(MaxAbsDiff(batch[0], batch[2]), 1e-6) << "identical inputs inside one batch";
  EXPECT_LT(MaxAbsDiff(batch[0], first), kTolerance) << "batched vs alone";
}

TEST_F(E2eServe, Base64DecodesToTheFloats) {
  const std::vector<std::string> texts = {"base64 keeps the bits", "and so does float"};
  auto f = HttpPostJson(port(), "/v1/embeddings",
                        json({{"model", kModel}, {"input", texts}, {"encoding_format", "float"}}).dump());
  auto b = HttpPostJson(port(), "/v1/embeddings",
                        json({{"model", kModel}, {"input", texts}, {"encoding_format", "base64"}}).dump());
  ASSERT_EQ(f.status, 200) << f.body;
  ASSERT_EQ(b.status, 200) << b.body;
  auto bj = json::parse(b.body);
  ASSERT_TRUE(bj.at("data").at(0).at("embedding").is_string());
  auto fr = ParseOpenAiEmbeddings(f.body).rows;
  auto br = ParseOpenAiEmbeddings(b.body).rows;
  ASSERT_EQ(br.size(), 2u);
  ExpectUnitRows(br, kDim);
  // Float text is the shortest round-tripping form, so it parses back exactly.
  for (size_t i = 0; i < fr.size(); ++i) EXPECT_LT(MaxAbsDiff(fr[i], br[i]), 1e-6) << "row " << i;
}

TEST_F(E2eServe, DimensionsShortensAndRenormalises) {
  const std::string text = "matryoshka embeddings can be cut short";
  auto full = EmbedOne(text);
  auto r = HttpPostJson(port(), "/v1/embeddings",
                        json({{"model", kModel}, {"input", {text, text}}, {"dimensions", 32}}).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto rows = ParseOpenAiEmbeddings(r.body).rows;
  ASSERT_EQ(rows.size(), 2u);
  ExpectUnitRows(rows, 32);
  std::vector<float> expected(full.begin(), full.begin() + 32);
  const double n = L2Norm(expected);
  for (float& x : expected) x = static_cast<float>(x / n);
  EXPECT_LT(MaxAbsDiff(rows[0], expected), kTolerance);
}

// Token ids of the model's vocabulary (line number minus one).
int32_t VocabId(const std::string& token) {
  std::ifstream in(shoal::testing::ModelsDir() + "/" + kModel + "/vocab.txt");
  std::string line;
  for (int32_t id = 0; std::getline(in, line); ++id)
    if (line == token) return id;
  return -1;
}

TEST_F(E2eServe, TokenIdInputs) {
  const int32_t hello = VocabId("hello"), world = VocabId("world");
  ASSERT_GE(hello, 0);
  ASSERT_GE(world, 0);
  auto text = EmbedOrThrow(port(), kModel, {"hello world"});

  // [int]: one pre-tokenized input, framed with [CLS]/[SEP] by the worker.
  auto one = HttpPostJson(port(), "/v1/embeddings", json({{"model", kModel}, {"input", {hello, world}}}).dump());
  ASSERT_EQ(one.status, 200) << one.body;
  auto o = ParseOpenAiEmbeddings(one.body);
  ASSERT_EQ(o.rows.size(), 1u);
  ExpectUnitRows(o.rows, kDim);
  EXPECT_EQ(o.prompt_tokens, 4);
  EXPECT_EQ(o.prompt_tokens, text.prompt_tokens);
  EXPECT_LT(MaxAbsDiff(o.rows[0], text.rows[0]), kTolerance) << "token ids and the text they spell";

  // [[int]]: several.
  json many = {{"model", kModel}, {"input", json::array({json::array({hello, world}), json::array({world})})}};
  auto m = HttpPostJson(port(), "/v1/embeddings", many.dump());
  ASSERT_EQ(m.status, 200) << m.body;
  auto mr = ParseOpenAiEmbeddings(m.body);
  ASSERT_EQ(mr.rows.size(), 2u);
  ExpectUnitRows(mr.rows, kDim);
  EXPECT_LT(MaxAbsDiff(mr.rows[0], o.rows[0]), kTolerance);
  EXPECT_EQ(mr.prompt_tokens, 4 + 3);
}

// reference.json holds the model's embeddings of a few token sequences, each
// computed alone by the generator; the served libtorch model must agree.
TEST_F(E2eServe, MatchesGeneratorReference) {
  std::ifstream in(shoal::testing::ModelsDir() + "/" + kModel + "/reference.json");
  ASSERT_TRUE(in.good());
  json ref = json::parse(in);
  const double tol = ref.value("tolerance", 1e-4);
  json ids = json::array();
  for (const auto& input : ref.at("inputs")) ids.push_back(input.at("input_ids"));
  auto r = HttpPostJson(port(), "/v1/embeddings", json({{"model", kModel}, {"input", ids}}).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  auto rows = ParseOpenAiEmbeddings(r.body).rows;
  ASSERT_EQ(rows.size(), ref.at("embeddings").size());
  for (size_t i = 0; i < rows.size(); ++i)
    EXPECT_LT(MaxAbsDiff(rows[i], ref.at("embeddings")[i].get<std::vector<float>>()), tol) << "reference " << i;
}

TEST_F(E2eServe, LargeBatchComesBackInOrder) {
  // 100 inputs of varied length, 13 queue messages of at most 8 (--chunk-size).
  std::vector<std::string> texts;
  for (int i = 0; i < 100; ++i) {
    std::string t = "input number " + std::to_string(i);
    for (int k = 0; k < i % 7; ++k) t += " with some padding words";
    texts.push_back(t);
  }
  auto batch = EmbedOrThrow(port(), kModel, texts);
  ASSERT_EQ(batch.rows.size(), texts.size());
  ExpectUnitRows(batch.rows, kDim);
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch.indices[i], static_cast<int64_t>(i));

  std::vector<std::future<OpenAiEmbeddings>> singles;
  int64_t tokens = 0;
  for (size_t i = 0; i < texts.size(); i += 25) {
    // Four clients at a time keep this quick on a small machine.
    for (size_t k = i; k < std::min(texts.size(), i + 25); ++k)
      singles.push_back(std::async(std::launch::async, [&, k] { return EmbedOrThrow(port(), kModel, {texts[k]}); }));
    for (size_t k = i; k < std::min(texts.size(), i + 25); ++k) {
      auto s = singles[k].get();
      tokens += s.prompt_tokens;
      EXPECT_LT(MaxAbsDiff(batch.rows[k], s.rows.at(0)), kTolerance) << "input " << k;
    }
  }
  EXPECT_EQ(batch.prompt_tokens, tokens);
}

// Native /v1/encode/{model}: JSON or MessagePack in, JSON or MessagePack out.
struct NativeResult {
  int rows = 0;
  int dim = 0;
  Vectors embeddings;
  int64_t prompt_tokens = 0;
  std::string model;
};

std::string PackInputs(const std::vector<std::string>& texts) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(2);
  pk.pack(std::string("inputs"));
  pk.pack(texts);
  pk.pack(std::string("truncate"));
  pk.pack(false);
  return std::string(buf.data(), buf.size());
}

NativeResult ParseNativeJson(const std::string& body) {
  auto j = json::parse(body);
  NativeResult r;
  r.model = j.at("model");
  r.dim = j.at("dim");
  r.embeddings = j.at("embeddings").get<Vectors>();
  r.rows = static_cast<int>(r.embeddings.size());
  r.prompt_tokens = j.at("usage").at("prompt_tokens");
  return r;
}

NativeResult ParseNativeMsgpack(const std::string& body) {
  auto handle = msgpack::unpack(body.data(), body.size());
  const auto& root = handle.get();
  if (root.type != msgpack::type::MAP) throw std::runtime_error("response is not a map");
  NativeResult r;
  std::string bin;
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const auto& kv = root.via.map.ptr[i];
    const std::string key = kv.key.as<std::string>();
    if (key == "model") r.model = kv.val.as<std::string>();
    if (key == "rows") r.rows = kv.val.as<int>();
    if (key == "dim") r.dim = kv.val.as<int>();
    if (key == "embeddings") {
      if (kv.val.type != msgpack::type::BIN) throw std::runtime_error("embeddings is not bin");
      bin.assign(kv.val.via.bin.ptr, kv.val.via.bin.size);
    }
    if (key == "usage") {
      for (uint32_t k = 0; k < kv.val.via.map.size; ++k)
        if (kv.val.via.map.ptr[k].key.as<std::string>() == "prompt_tokens")
          r.prompt_tokens = kv.val.via.map.ptr[k].val.as<int64_t>();
    }
  }
  if (r.dim <= 0 || bin.size() != static_cast<size_t>(r.rows) * r.dim * sizeof(float))
    throw std::runtime_error("embeddings bin has the wrong size");
  for (int i = 0; i < r.rows; ++i) {
    std::vector<float> row(r.dim);
    std::memcpy(row.data(), bin.data() + static_cast<size_t>(i) * r.dim * sizeof(float), r.dim * sizeof(float));
    r.embeddings.push_back(std::move(row));
  }
  return r;
}

TEST_F(E2eServe, NativeEncodeJsonAndMsgpack) {
  const std::vector<std::string> texts = {"native encode", "speaks json", "and messagepack"};
  auto reference = EmbedOrThrow(port(), kModel, texts);
  const std::string target = std::string("/v1/encode/") + kModel;

  struct Variant {
    const char* name;
    bool msgpack_in;
    bool msgpack_out;
  };
  for (const Variant& v : {Variant{"json->json", false, false}, Variant{"msgpack->json", true, false},
                           Variant{"json->msgpack", false, true}, Variant{"msgpack->msgpack", true, true}}) {
    SCOPED_TRACE(v.name);
    HttpCall call;
    call.method = "POST";
    call.target = target;
    if (v.msgpack_in) {
      call.body = PackInputs(texts);
      call.content_type = "application/msgpack";
    } else {
      call.body = json({{"inputs", texts}, {"truncate", false}}).dump();
    }
    if (v.msgpack_out) call.headers.emplace_back("Accept", "application/msgpack");
    auto r = Http(port(), call);
    ASSERT_EQ(r.status, 200) << r.error << r.body;
    EXPECT_EQ(r.Header("content-type").rfind(v.msgpack_out ? "application/msgpack" : "application/json", 0), 0u)
        << r.Header("content-type");
    NativeResult n = v.msgpack_out ? ParseNativeMsgpack(r.body) : ParseNativeJson(r.body);
    EXPECT_EQ(n.model, kModel);
    EXPECT_EQ(n.dim, kDim);
    ASSERT_EQ(n.rows, 3);
    EXPECT_EQ(n.prompt_tokens, reference.prompt_tokens);
    for (int i = 0; i < n.rows; ++i) {
      EXPECT_LT(MaxAbsDiff(n.embeddings[i], reference.rows[i]), kTolerance) << "row " << i;
    }
  }
}

TEST_F(E2eServe, ModelsListsTinyBertWithAWorker) {
  auto r = HttpGet(port(), "/v1/models");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j.at("object"), "list");
  const json* tiny = nullptr;
  for (const auto& m : j.at("data"))
    if (m.at("id") == kModel) tiny = &m;
  ASSERT_NE(tiny, nullptr) << r.body;
  EXPECT_EQ(tiny->at("object"), "model");
  EXPECT_EQ(tiny->at("dim"), kDim);
  EXPECT_EQ(tiny->at("max_seq_len"), 256);
  ASSERT_GE(tiny->at("workers").size(), 1u) << r.body;
  EXPECT_FALSE(tiny->at("workers")[0].at("worker").get<std::string>().empty());
}

TEST_F(E2eServe, MetricsArePrometheusText) {
  EmbedOne("one request so that every series exists");
  auto r = HttpGet(port(), "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.Header("content-type").rfind("text/plain", 0), 0u) << r.Header("content-type");
  for (const char* name : {"shoal_http_requests_total", "shoal_queue_depth", "shoal_worker_batch_rows"})
    EXPECT_NE(r.body.find(name), std::string::npos) << name << " missing from:\n" << r.body;
  EXPECT_NE(r.body.find("shoal_http_requests_total{"), std::string::npos);
}

// Every client error the API defines, with its status and error.code.
struct BadCase {
  std::string name;
  std::string method;
  std::string target;
  std::string body;
  int want_status;
  std::string want_code;  // empty: a success
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers = {};
};

std::string Embeddings(json input, json extra = json::object()) {
  json j = {{"model", kModel}, {"input", std::move(input)}};
  j.update(extra);
  return j.dump();
}

std::vector<BadCase> BadCases() {
  const std::string e = "/v1/embeddings";
  const std::string enc = std::string("/v1/encode/") + kModel;
  std::string long_text;
  for (int i = 0; i < 400; ++i) long_text += "word ";
  std::vector<std::string> too_many(kMaxInputs + 1, "x");
  std::string big = Embeddings(std::string(kMaxBodyBytes + 1000, 'a'));
  std::string truncated_msgpack = "\x81\xa6inputs";            // a map whose value is missing
  std::string no_inputs_msgpack = "\x81\xa8truncate\xc2";       // {truncate: false}
  return {
      {"invalid_json", "POST", e, "{\"model\": \"tiny-bert\", ", 400, "invalid_json"},
      {"json_not_object", "POST", e, "[1, 2]", 400, "invalid_json"},
      {"invalid_json_native", "POST", enc, "{nope", 400, "invalid_json"},
      {"invalid_msgpack", "POST", enc, "\xc1", 400, "invalid_msgpack", "application/msgpack"},
      {"truncated_msgpack", "POST", enc, truncated_msgpack, 400, "invalid_msgpack", "application/msgpack"},
      {"msgpack_not_map", "POST", enc, "\x93\x01\x02\x03", 400, "invalid_msgpack", "application/msgpack"},
      {"msgpack_missing_inputs", "POST", enc, no_inputs_msgpack, 400, "missing_input", "application/msgpack"},
      {"missing_model", "POST", e, R"({"input": "hi"})", 400, "invalid_model"},
      {"empty_model", "POST", e, R"({"model": "", "input": "hi"})", 400, "invalid_model"},
      {"model_not_string", "POST", e, R"({"model": 7, "input": "hi"})", 400, "invalid_model"},
      {"unknown_model", "POST", e, R"({"model": "no-such-model", "input": "hi"})", 404, "model_not_found"},
      {"unknown_model_native", "POST", "/v1/encode/no-such-model", R"({"inputs": ["hi"]})", 404,
       "model_not_found"},
      {"missing_input", "POST", e, R"({"model": "tiny-bert"})", 400, "missing_input"},
      {"missing_inputs_native", "POST", enc, R"({"truncate": true})", 400, "missing_input"},
      {"empty_string", "POST", e, Embeddings(""), 400, "empty_input"},
      {"empty_array", "POST", e, Embeddings(json::array()), 400, "empty_input"},
      {"empty_string_in_array", "POST", e, Embeddings({"ok", ""}), 400, "empty_input"},
      {"empty_token_array", "POST", e, Embeddings(json::array({json::array()})), 400, "empty_input"},
      {"input_number", "POST", e, Embeddings(5), 400, "invalid_input"},
      {"input_object", "POST", e, Embeddings({{"text", "hi"}}), 400, "invalid_input"},
      {"mixed_array", "POST", e, Embeddings({"hi", 3}), 400, "invalid_input"},
      {"float_tokens", "POST", e, Embeddings({1.5, 2.5}), 400, "invalid_input"},
      {"bool_array", "POST", e, Embeddings({true}), 400, "invalid_input"},
      {"bad_encoding_format", "POST", e, Embeddings("hi", {{"encoding_format", "int8"}}), 400,
       "invalid_encoding_format"},
      {"encoding_format_not_string", "POST", e, Embeddings("hi", {{"encoding_format", 1}}), 400,
       "invalid_encoding_format"},
      {"too_many_inputs", "POST", e, Embeddings(too_many), 400, "too_many_inputs"},
      {"too_many_inputs_native", "POST", enc, json({{"inputs", too_many}}).dump(), 400, "too_many_inputs"},
      {"input_too_long", "POST", e, Embeddings(long_text), 422, "input_too_long"},
      {"input_too_long_in_batch", "POST", e, Embeddings({"short", long_text}), 422, "input_too_long"},
      {"input_too_long_native", "POST", enc, json({{"inputs", {long_text}}}).dump(), 422, "input_too_long"},
      {"input_too_long_truncated", "POST", e, Embeddings(long_text, {{"truncate", true}}), 200, ""},
      {"input_too_long_truncated_native", "POST", enc, json({{"inputs", {long_text}}, {"truncate", true}}).dump(),
       200, ""},
      {"token_id_outside_vocab", "POST", e, Embeddings(json::array({json::array({5, 999999})})), 400,
       "invalid_token_id"},
      {"negative_token_id", "POST", e, Embeddings({7, -1}), 400, "invalid_token_id"},
      {"payload_too_large", "POST", e, big, 413, "payload_too_large"},
      {"unknown_route", "GET", "/v2/nothing", "", 404, "route_not_found"},
      {"unknown_route_post", "POST", "/v1/images/generations", "{}", 404, "route_not_found"},
      // A generate route exists now; a generator is still a model like any other.
      {"chat_unknown_model", "POST", "/v1/chat/completions", R"({"model":"nope","messages":[{}]})", 404, "model_not_found"},
      {"chat_wrong_task", "POST", "/v1/chat/completions", R"({"model":"tiny-bert","messages":[{}]})", 400, "wrong_task"},
      {"wrong_method_embeddings", "GET", e, "", 405, "method_not_allowed"},
      {"wrong_method_encode", "GET", enc, "", 405, "method_not_allowed"},
      {"wrong_method_models", "POST", "/v1/models", "{}", 405, "method_not_allowed"},
      {"bad_dimensions", "POST", e, Embeddings("hi", {{"dimensions", 0}}), 400, "invalid_dimensions"},
      {"dimensions_over_model", "POST", e, Embeddings("hi", {{"dimensions", kDim + 1}}), 400,
       "invalid_dimensions"},
      {"truncate_not_bool", "POST", e, Embeddings("hi", {{"truncate", "yes"}}), 400, "invalid_truncate"},
      {"bad_timeout_header", "POST", e, Embeddings("hi"), 400, "invalid_timeout", "application/json",
       {{"Shoal-Timeout-Ms", "soon"}}},
  };
}

TEST_F(E2eServe, EveryBadInputHasItsStatusAndCode) {
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.name);
    HttpCall call;
    call.method = c.method;
    call.target = c.target;
    call.body = c.body;
    call.content_type = c.content_type;
    call.headers = c.headers;
    auto r = Http(port(), call);
    ASSERT_EQ(r.status, c.want_status) << r.error << " " << r.body.substr(0, 500);
    if (c.want_code.empty()) continue;
    EXPECT_EQ(r.Header("content-type").rfind("application/json", 0), 0u);
    json j;
    ASSERT_NO_THROW(j = json::parse(r.body)) << r.body;
    ASSERT_TRUE(j.contains("error")) << r.body;
    const json& err = j.at("error");
    EXPECT_EQ(err.value("code", ""), c.want_code) << r.body;
    EXPECT_FALSE(err.value("message", "").empty()) << r.body;
    EXPECT_FALSE(err.value("type", "").empty()) << r.body;
    EXPECT_TRUE(err.contains("param") && err.at("param").is_null()) << "OpenAI errors carry param: null; " << r.body;
    if (c.want_status == 405) {
      EXPECT_FALSE(r.Header("allow").empty());
    }
  }
  // The server is still healthy after all of that.
  EXPECT_EQ(EmbedOne("still fine").size(), static_cast<size_t>(kDim));
}

// The nats-server that `shoal serve` (pid) started, or -1.
pid_t NatsServerChildOf(pid_t pid) {
  for (pid_t child : Descendants(pid)) {
    std::ifstream comm("/proc/" + std::to_string(child) + "/comm");
    std::string name;
    std::getline(comm, name);
    if (name == "nats-server") return child;
  }
  return -1;
}

// SIGTERM stops everything `shoal serve` started, promptly and cleanly.
TEST(E2eServeShutdown, SigtermExitsZeroAndStopsNatsServer) {
  shoal::testing::TempDir dir;
  Shoal serve = StartServe(dir.path(), {"--models", kModel, "--threads", "1"});
  ASSERT_EQ(WaitForReadyz(serve.port, 200, 60s), 200);
  // Work has gone through the queue, so the file store has something to flush.
  EmbedOrThrow(serve.port, kModel, {"one request before the signal"});

  const pid_t nats = NatsServerChildOf(serve.process->pid());
  ASSERT_GT(nats, 0) << "no nats-server child of shoal serve";
  ASSERT_TRUE(ProcessAlive(nats));

  serve.process->Signal(SIGTERM);
  auto status = serve.process->Wait(15s);
  ASSERT_TRUE(status.has_value()) << "shoal serve did not exit within 15 s of SIGTERM";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << DescribeWaitStatus(*status);
  // shoal serve reaps its nats-server before it exits.
  EXPECT_FALSE(ProcessAlive(nats)) << "nats-server " << nats << " outlived shoal serve";
  EXPECT_NE(HttpGet(serve.port, "/healthz", 1s).status, 200);
}

// A signal while `shoal serve` is still starting (here a preloaded model
// whose runtime never answers, which would hold the start for its 60 s
// start timeout) ends it at once, exit status 130, and the nats-server it
// had started goes with it. Before, the signal waited until the start was
// over.
TEST(E2eServeShutdown, SigintWhileStartingExitsAtOnce) {
  namespace fs = std::filesystem;
  shoal::testing::TempDir dir;
  const fs::path src = fs::path(shoal::testing::ModelsDir()) / "tiny-bert-py";
  const fs::path repo = fs::path(dir.path()) / "models";
  fs::create_directories(repo / "stuck");
  json config = json::parse(std::ifstream(src / "shoal.json"));
  config["name"] = "stuck";
  config["process"]["command"] = {"/bin/sleep", "600"};
  std::ofstream(repo / "stuck" / "shoal.json") << config.dump(2);
  for (const char* f : {"vocab.txt", "weights.pt"}) fs::create_symlink(src / f, repo / "stuck" / f);
  ChildOptions o;
  o.argv = {shoal::testing::ShoalBinary(), "serve", "--data-dir", dir.path() + "/data", "--port", "0",
            "--models-dir", repo.string(), "--preload", "stuck"};
  o.stderr_path = dir.path() + "/stderr.log";
  auto child = ChildProcess::Spawn(o);
  // Starting: its nats-server is up and the model's runtime is running.
  pid_t nats = -1;
  ASSERT_TRUE(shoal::testing::Eventually([&] {
    nats = NatsServerChildOf(child->pid());
    for (pid_t p : Descendants(child->pid())) {
      std::ifstream comm("/proc/" + std::to_string(p) + "/comm");
      std::string name;
      std::getline(comm, name);
      if (name == "sleep" && nats > 0) return true;
    }
    return false;
  }, 30s)) << "shoal serve never reached the model's load";
  child->Signal(SIGINT);
  auto status = child->Wait(10s);
  ASSERT_TRUE(status.has_value()) << "shoal serve went on starting after SIGINT";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 130) << DescribeWaitStatus(*status);
  EXPECT_TRUE(shoal::testing::Eventually([&] { return !ProcessAlive(nats); }, 15s))
      << "nats-server " << nats << " outlived shoal serve";
}

// A bad option value is an error before anything starts: exit 1 with an
// error naming the option, and no nats-server was started (its JetStream
// directory was never made). A GPU the build's libtorch cannot use (here
// one past any machine's), a model named that the repository lacks, a
// repository that does not exist and a blob store URL that does not parse
// are such values too.
TEST(E2eServeShutdown, BadOptionExitsBeforeStartingNatsServer) {
  struct Case {
    std::vector<std::string> bad;
    std::string code;
    std::string named;
  };
  const std::vector<Case> cases = {{{"--turn-quantum-ms", "-5"}, "invalid_argument", "turn_quantum_ms"},
                                   {{"--device-slots", "-1"}, "invalid_argument", "device_slots"},
                                   {{"--device", "gpu"}, "invalid_argument", "bad device 'gpu'"},
                                   {{"--device", "cuda:255"}, "unavailable (device_unavailable)", "device cuda:255"},
                                   {{"--host-memory-budget", "1GiB"}, "invalid_argument", "host memory budget"},
                                   {{"--preload", "bogus"}, "model_not_found", "--preload: model 'bogus'"},
                                   {{"--pin", "bogus"}, "model_not_found", "--pin: model 'bogus'"},
                                   // List items are trimmed: the name is 'bogus', not ' bogus '.
                                   {{"--preload", " bogus , "}, "model_not_found", "--preload: model 'bogus'"},
                                   {{"--models", "bogus"}, "model_not_found", "model 'bogus' is not in repository"},
                                   {{"--models-dir", "/nonexistent-shoal-models"}, "not_found", "/nonexistent-shoal-models"},
                                   {{"--blob-store", "file://relative/dir"}, "invalid_argument", "file:///absolute/dir"},
                                   {{"--blob-store", "s3://bucket"}, "invalid_argument", "unknown blob store scheme"},
                                   // Flags that make a model's config invalid.
                                   {{"--max-batch-tokens", "100"},
                                    "invalid_argument",
                                    "max_batch_tokens must be >= max_seq_len (with this worker's flags: "
                                    "--max-batch-tokens 100)"},
                                   {{"--runtime", "bogus"}, "invalid_argument", "unknown runtime 'bogus'"},
                                   {{"--max-batch-size", "-3"}, "invalid_argument", "max_batch_size must be >= 0"}};
  // Runs shoal serve with `bad`; expects it to exit `want` naming `named`,
  // without having started a nats-server.
  auto expect_exit = [](const std::vector<std::string>& bad, int want, const std::string& code,
                        const std::string& named) {
    shoal::testing::TempDir dir;
    ChildOptions o;
    o.argv = {shoal::testing::ShoalBinary(), "serve", "--data-dir", dir.path() + "/data", "--port", "0"};
    for (const auto& [flag, value] : {std::pair<std::string, std::string>{"--models-dir", shoal::testing::ModelsDir()},
                                      std::pair<std::string, std::string>{"--models", kModel}}) {
      if (std::find(bad.begin(), bad.end(), flag) == bad.end()) o.argv.insert(o.argv.end(), {flag, value});
    }
    o.argv.insert(o.argv.end(), bad.begin(), bad.end());
    o.stderr_path = dir.path() + "/stderr.log";
    auto child = ChildProcess::Spawn(o);
    auto status = child->Wait(30s);
    ASSERT_TRUE(status.has_value()) << bad[0] << ": shoal serve did not exit";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == want) << bad[0] << ": " << DescribeWaitStatus(*status);
    std::ifstream err(o.stderr_path);
    const std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find(code), std::string::npos) << text;
    EXPECT_NE(text.find(named), std::string::npos) << text;
    EXPECT_FALSE(std::filesystem::exists(dir.path() + "/data/jetstream")) << bad[0] << " started a nats-server first";
  };
  for (const auto& [bad, code, named] : cases) expect_exit(bad, 1, code, named);
  // Values that do not parse, or are not one of a flag's choices: the
  // parser's error (exit status 105).
  expect_exit({"--memory-budget", "12XB"}, 105, "--memory-budget", "12XB");
  expect_exit({"--eviction", "mru"}, 105, "--eviction", "mru");
  // Integers are decimal: -1 is no size (it would lift the body limit),
  // and 0x10 no count.
  expect_exit({"--max-body-bytes", "-1"}, 105, "--max-body-bytes", "expects a decimal integer of 0 or more");
  expect_exit({"--chunk-size", "0x10"}, 105, "--chunk-size", "expects a decimal integer");
}

// Two nats-servers must not share one JetStream store: a second serve on a
// data directory in use exits at once, naming the first, which serves on.
TEST(E2eServeShutdown, ASecondServeOnTheSameDataDirectoryExitsAtOnce) {
  shoal::testing::TempDir dir;
  Shoal first = StartServe(dir.path() + "/data", {"--models", kModel, "--threads", "1"});
  ASSERT_EQ(WaitForReadyz(first.port, 200, 60s), 200);
  ChildOptions o;
  o.argv = {shoal::testing::ShoalBinary(), "serve", "--data-dir", dir.path() + "/data", "--port", "0",
            "--models-dir", shoal::testing::ModelsDir(), "--models", kModel};
  o.stderr_path = dir.path() + "/stderr.log";
  auto second = ChildProcess::Spawn(o);
  auto status = second->Wait(30s);
  ASSERT_TRUE(status.has_value()) << "the second shoal serve did not exit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << DescribeWaitStatus(*status);
  std::ifstream err(o.stderr_path);
  const std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("is using the data directory " + dir.path() + "/data"), std::string::npos) << text;
  EXPECT_NE(text.find("pid " + std::to_string(first.process->pid())), std::string::npos) << text;
  EXPECT_EQ(WaitForReadyz(first.port, 200, 10s), 200) << "the first serve stopped serving";
  // Once the first has stopped (with its nats-server), the directory is free.
  first.process->Signal(SIGTERM);
  ASSERT_TRUE(first.process->Wait(30s).has_value());
  Shoal third = StartServe(dir.path() + "/data", {"--models", kModel, "--threads", "1"});
  EXPECT_EQ(WaitForReadyz(third.port, 200, 60s), 200);
}

// An HTTP port in use is found before the nats-server starts or any model
// loads, not after.
TEST(E2eServeShutdown, APortInUseExitsBeforeStartingNatsServer) {
  shoal::testing::HeldPort held;
  ASSERT_GT(held.port(), 0);
  const std::string port = std::to_string(held.port());
  shoal::testing::TempDir dir;
  ChildOptions o;
  o.argv = {shoal::testing::ShoalBinary(), "serve", "--data-dir", dir.path() + "/data", "--port", port,
            "--models-dir", shoal::testing::ModelsDir(), "--models", kModel};
  o.stderr_path = dir.path() + "/stderr.log";
  auto child = ChildProcess::Spawn(o);
  auto status = child->Wait(30s);
  ASSERT_TRUE(status.has_value()) << "shoal serve did not exit";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << DescribeWaitStatus(*status);
  std::ifstream err(o.stderr_path);
  const std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("cannot bind HTTP address 127.0.0.1:" + port), std::string::npos) << text;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/data/jetstream")) << "it started a nats-server first";
}

// A `shoal serve` killed outright (SIGKILL, the OOM killer) cannot stop its
// nats-server itself: the kernel sends it SIGTERM when its parent dies.
TEST(E2eServeShutdown, SigkillLeavesNoNatsServerBehind) {
  shoal::testing::TempDir dir;
  Shoal serve = StartServe(dir.path(), {"--models", kModel, "--threads", "1"});
  ASSERT_EQ(WaitForReadyz(serve.port, 200, 60s), 200);
  const pid_t nats = NatsServerChildOf(serve.process->pid());
  ASSERT_GT(nats, 0) << "no nats-server child of shoal serve";
  serve.process->Signal(SIGKILL);
  auto status = serve.process->Wait(15s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << DescribeWaitStatus(*status);
  bool gone = false;
  for (int i = 0; i < 500 && !gone; ++i) {  // 10 s: it flushes its file store first
    gone = !ProcessAlive(nats);
    if (!gone) std::this_thread::sleep_for(20ms);
  }
  if (!gone) ::kill(nats, SIGKILL);  // do not leave it running either way
  EXPECT_TRUE(gone) << "nats-server " << nats << " outlived a SIGKILLed shoal serve";
}

}  // namespace
}  // namespace shoal::e2e
