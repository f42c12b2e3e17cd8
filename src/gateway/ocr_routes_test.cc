// Unit tests of POST /v1/ocr/{model} with a fake queue side: every body form,
// rendering, and each bad input's status and code.
#include <gtest/gtest.h>

#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "gateway/routes.h"

namespace shoal {
namespace {

using nlohmann::json;
using namespace std::string_literals;

const std::string kPng = "\x89PNG\r\n\x1a\n"s + "rest-of-a-png";
const std::string kJpeg = "\xFF\xD8\xFF\xE0"s + "jfif";

// Answers each item with {text: <its bytes' size>, words: [...], width, height}.
class FakeItems : public WorkSubmitter {
 public:
  void SubmitEmbed(EmbedJob, EmbedCallback done) override { done(Internal("not an embed route")); }
  void SubmitItems(ItemJob job, ItemCallback done, PartialCallback) override {
    last = job;
    ++calls;
    if (!error.ok()) return done(error);
    ItemResult r;
    if (!raw_result.empty()) {
      r.items.assign(job.items.size(), raw_result);
      return done(std::move(r));
    }
    for (const std::string& item : job.items) {
      msgpack::sbuffer buf;
      msgpack::packer<msgpack::sbuffer> pk(buf);
      pk.pack_map(4);
      pk.pack("text"s);
      pk.pack(std::to_string(item.size()));
      pk.pack("words"s);
      pk.pack_array(1);
      pk.pack_map(3);
      pk.pack("text"s);
      pk.pack("w"s);
      pk.pack("box"s);
      pk.pack(std::vector<int>{1, 2, 3, 4});
      pk.pack("confidence"s);
      pk.pack(0.5f);
      pk.pack("width"s);
      pk.pack(10);
      pk.pack("height"s);
      pk.pack(20);
      r.items.emplace_back(buf.data(), buf.size());
    }
    done(std::move(r));
  }
  ItemJob last;
  int calls = 0;
  Status error;
  std::string raw_result;  // non-empty: every item's result document, as is
};

class OcrRoutesTest : public ::testing::Test {
 protected:
  OcrRoutesTest() {
    auto snap = std::make_shared<FleetSnapshot>();
    snap->nats_connected = true;
    snap->stream_ok = true;
    CatalogModel ocr;
    ocr.name = "ocr";
    ocr.task = "ocr";
    snap->models["ocr"] = ocr;
    CatalogModel m;
    m.name = "m";
    m.task = "embed";
    m.dim = 4;
    snap->models["m"] = m;
    snapshot_ = snap;
    RouterOptions o;
    o.max_inputs = 4;
    router_ = std::make_unique<Router>(o, &submitter_, [this] { return snapshot_; }, &metrics_, &clock_);
  }

  HttpResponse Get(const std::string& path) {
    HttpRequest req;
    req.method = "GET";
    req.path = path;
    HttpResponse out;
    router_->Handle(std::move(req), [&](HttpResponse r) { out = std::move(r); });
    return out;
  }

  HttpResponse Call(const std::string& path, std::string body, const std::string& content_type,
                    const std::string& accept = "") {
    HttpRequest req;
    req.method = "POST";
    req.path = path;
    req.target = path;
    req.body = std::move(body);
    if (!content_type.empty()) req.headers.emplace_back("content-type", content_type);
    if (!accept.empty()) req.headers.emplace_back("accept", accept);
    HttpResponse out;
    router_->Handle(std::move(req), [&](HttpResponse r) { out = std::move(r); });
    return out;
  }

  static std::string Code(const HttpResponse& r) { return json::parse(r.body)["error"]["code"].get<std::string>(); }

  static std::string Msgpack(const std::vector<std::string>& images, bool many) {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer> pk(buf);
    pk.pack_map(1);
    pk.pack(many ? "images"s : "image"s);
    if (many) pk.pack_array(static_cast<uint32_t>(images.size()));
    for (const auto& i : images) {
      pk.pack_bin(static_cast<uint32_t>(i.size()));
      pk.pack_bin_body(i.data(), static_cast<uint32_t>(i.size()));
    }
    return std::string(buf.data(), buf.size());
  }

  FakeClock clock_;
  MetricsRegistry metrics_;
  FakeItems submitter_;
  std::shared_ptr<const FleetSnapshot> snapshot_;
  std::unique_ptr<Router> router_;
};

TEST_F(OcrRoutesTest, RawImageBodyRendersListShape) {
  auto r = Call("/v1/ocr/ocr", kPng, "image/png");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.task, "ocr");
  EXPECT_EQ(submitter_.last.model, "ocr");
  ASSERT_EQ(submitter_.last.items, std::vector<std::string>{kPng});
  EXPECT_GT(submitter_.last.deadline_unix_ms, 0);
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["model"], "ocr");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["index"], 0);
  EXPECT_EQ(j["data"][0]["text"], std::to_string(kPng.size()));
  EXPECT_EQ(j["data"][0]["width"], 10);
  EXPECT_EQ(j["data"][0]["height"], 20);
  EXPECT_EQ(j["data"][0]["words"][0]["box"], json({1, 2, 3, 4}));
  EXPECT_EQ(j["data"][0]["words"][0]["confidence"], 0.5);
}

TEST_F(OcrRoutesTest, MsgpackOneOrManyImages) {
  auto r = Call("/v1/ocr/ocr", Msgpack({kPng}, false), "application/msgpack");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.items, std::vector<std::string>{kPng});
  r = Call("/v1/ocr/ocr", Msgpack({kPng, kJpeg}, true), "application/x-msgpack");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.items, (std::vector<std::string>{kPng, kJpeg}));
  EXPECT_EQ(json::parse(r.body)["data"][1]["index"], 1);
}

TEST_F(OcrRoutesTest, MultipartPartsNamedImageOrFile) {
  const std::string body = "--XyZ\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
                           "Content-Type: image/png\r\n\r\n" + kPng +
                           "\r\n--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhello"
                           // A quoted value may hold ';' and '=': this part is "note".
                           "\r\n--XyZ\r\nContent-Disposition: form-data; filename=\"x;name=image;\"; "
                           "name=\"note\"\r\n\r\nnot an image"
                           "\r\n--XyZ\r\nContent-Disposition: form-data; filename=\"q\\\"; name=image\"; "
                           "name = \"note\"\r\n\r\nnot an image either"
                           "\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jpg\"\r\n\r\n" +
                           kJpeg + "\r\n--XyZ--\r\n";
  auto r = Call("/v1/ocr/ocr", body, "multipart/form-data; boundary=XyZ");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.items, (std::vector<std::string>{kPng, kJpeg}));
}

TEST_F(OcrRoutesTest, JsonBase64AndDataUrls) {
  // base64 of kPng and kJpeg.
  const std::string png64 = "iVBORw0KGgpyZXN0LW9mLWEtcG5n";
  const std::string jpg64 = "/9j/4GpmaWY=";
  auto r = Call("/v1/ocr/ocr", json{{"image", png64}}.dump(), "application/json");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.items, std::vector<std::string>{kPng});
  r = Call("/v1/ocr/ocr", json{{"images", {"data:image/png;base64," + png64, jpg64}}}.dump(), "application/json");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(submitter_.last.items, (std::vector<std::string>{kPng, kJpeg}));
}

TEST_F(OcrRoutesTest, MsgpackResponseWhenAccepted) {
  auto r = Call("/v1/ocr/ocr", kPng, "image/png", "application/msgpack");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "application/msgpack");
  auto h = msgpack::unpack(r.body.data(), r.body.size());
  std::map<std::string, msgpack::object> top;
  h.get().convert(top);
  EXPECT_EQ(top.at("object").as<std::string>(), "list");
  std::vector<std::map<std::string, msgpack::object>> data;
  top.at("data").convert(data);
  ASSERT_EQ(data.size(), 1u);
  EXPECT_EQ(data[0].at("index").as<int>(), 0);
  EXPECT_EQ(data[0].at("width").as<int>(), 10);
}

TEST_F(OcrRoutesTest, EveryBadInputGetsItsStatusAndCode) {
  struct Case {
    std::string path, body, type;
    int status;
    std::string code;
  } cases[] = {
      {"/v1/ocr/nope", kPng, "image/png", 404, "model_not_found"},
      {"/v1/ocr/m", kPng, "image/png", 400, "wrong_task"},
      {"/v1/ocr/ocr", "hello, not an image", "image/png", 400, "invalid_image"},
      {"/v1/ocr/ocr", "", "image/png", 400, "invalid_image"},
      {"/v1/ocr/ocr", "GIF89a....", "image/gif", 415, "unsupported_image_format"},
      {"/v1/ocr/ocr", "RIFF\x10\0\0\0WEBPVP8 "s, "image/webp", 415, "unsupported_image_format"},
      {"/v1/ocr/ocr", kPng, "text/plain", 415, "unsupported_media_type"},
      {"/v1/ocr/ocr", "{}", "application/json", 400, "missing_image"},
      {"/v1/ocr/ocr", R"({"image": "***"})", "application/json", 400, "invalid_image"},
      {"/v1/ocr/ocr", R"({"image": 5})", "application/json", 400, "invalid_image"},
      {"/v1/ocr/ocr", R"({"images": []})", "application/json", 400, "invalid_image"},
      {"/v1/ocr/ocr", R"({"image": "data:image/png,abc"})", "application/json", 400, "invalid_image"},
      {"/v1/ocr/ocr", "not json", "application/json", 400, "invalid_json"},
      {"/v1/ocr/ocr", "\xc1", "application/msgpack", 400, "invalid_msgpack"},
      {"/v1/ocr/ocr", "\x81\xa6images\xdd\xff\xff\xff\xff"s, "application/msgpack", 400, "invalid_msgpack"},
      {"/v1/ocr/ocr", "\x81\xa6images"s + std::string(1000, '\x91'), "application/msgpack", 400, "nesting_too_deep"},
      {"/v1/ocr/ocr", Msgpack({}, true), "application/msgpack", 400, "invalid_image"},
      {"/v1/ocr/ocr", Msgpack({kPng, kPng, kPng, kPng, kPng}, true), "application/msgpack", 400, "too_many_inputs"},
      {"/v1/ocr/ocr", "--a\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\nv\r\n--a--", "multipart/form-data; boundary=a",
       400, "missing_image"},
      {"/v1/ocr/ocr", "garbage", "multipart/form-data", 400, "invalid_multipart"},
      {"/v1/ocr/", kPng, "image/png", 400, "invalid_model"},
  };
  for (const auto& c : cases) {
    auto r = Call(c.path, c.body, c.type);
    EXPECT_EQ(r.status, c.status) << c.path << " " << c.type << " " << c.body << ": " << r.body;
    EXPECT_EQ(Code(r), c.code) << c.path << " " << c.type << " " << c.body;
  }
  EXPECT_EQ(submitter_.calls, 0);
}

TEST_F(OcrRoutesTest, WorkerErrorsKeepTheirStatus) {
  submitter_.error = InvalidArgument("image 0: not a PNG after all", "invalid_image");
  auto r = Call("/v1/ocr/ocr", kPng, "image/png");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Code(r), "invalid_image");
  submitter_.error = Status(StatusCode::kBadGateway, "blob gone", "blob_not_found");
  r = Call("/v1/ocr/ocr", kPng, "image/png");
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(Code(r), "blob_not_found");
}

// A result document nested deeper than any OCR result (anything on NATS
// can publish to the gateway's reply subject) is refused before it is
// rendered: the rendering recurses once per level. Like any reply the
// gateway cannot use, it is 502 bad_worker_reply.
TEST_F(OcrRoutesTest, ResultsNestedTooDeepAreRefusedNotRendered) {
  submitter_.raw_result = "\x81\xa4text"s;  // {"text": [[[...1]]]}
  for (int i = 0; i < 1000; ++i) submitter_.raw_result += '\x91';
  submitter_.raw_result += '\x01';
  for (const std::string accept : {"", "application/msgpack"}) {
    SCOPED_TRACE(accept);
    auto r = Call("/v1/ocr/ocr", kPng, "image/png", accept);
    EXPECT_EQ(r.status, 502);
    const json body = accept.empty() ? json::parse(r.body) : json::from_msgpack(r.body);
    EXPECT_EQ(body["error"]["code"], "bad_worker_reply");
    EXPECT_NE(body["error"]["message"].get<std::string>().find("deep"), std::string::npos) << body.dump();
  }
  submitter_.raw_result = "\x91\x01"s;  // [1]: not a map
  auto r = Call("/v1/ocr/ocr", kPng, "image/png");
  EXPECT_EQ(r.status, 502);
  EXPECT_EQ(Code(r), "bad_worker_reply");
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("not a map"), std::string::npos) << r.body;
}

// An OCR model takes images, not tokens: /v1/models gives it no width and
// no token limit, which an embedding model has.
TEST_F(OcrRoutesTest, ModelsListsNoTokenFieldsForOcr) {
  const HttpResponse out = Get("/v1/models");
  ASSERT_EQ(out.status, 200) << out.body;
  const auto j = nlohmann::json::parse(out.body);
  ASSERT_EQ(j["data"].size(), 2u);  // by id: m, ocr
  EXPECT_EQ(j["data"][0]["dim"], 4);
  EXPECT_TRUE(j["data"][0].contains("max_seq_len"));
  EXPECT_EQ(j["data"][1]["task"], "ocr");
  EXPECT_FALSE(j["data"][1].contains("dim"));
  EXPECT_FALSE(j["data"][1].contains("max_seq_len"));
}

TEST_F(OcrRoutesTest, OnlyPost) {
  EXPECT_EQ(Get("/v1/ocr/ocr").status, 405);
}

}  // namespace
}  // namespace shoal
