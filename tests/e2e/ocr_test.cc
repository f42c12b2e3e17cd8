// End to end: `shoal serve` with the demo OCR model (real nats-server -js,
// real worker on Tesseract, real gateway) driven over HTTP with the images
// rendered by scripts/make_ocr_images.py. The 5 MiB image crosses the queue
// through the blob store (a local directory under the data dir).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "e2e/http_client.h"
#include "e2e/shoal_cluster.h"
#include "support/test_env.h"

namespace shoal::e2e {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Base64(const std::string& in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s : {18, 12, 6, 0}) out.push_back(k[(v >> s) & 63]);
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    out += {k[v >> 18], k[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {k[v >> 18], k[(v >> 12) & 63], k[(v >> 6) & 63], '='};
  }
  return out;
}

std::string Norm(std::string w) {
  std::string out;
  for (char c : w)
    if (!std::ispunct(static_cast<unsigned char>(c))) out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return out;
}

// The manifest's words for `file`.
std::vector<std::string> ExpectedWords(const std::string& file) {
  auto m = json::parse(Slurp(shoal::testing::SourceDir() + "/testdata/ocr/manifest.json"));
  for (const auto& img : m["images"])
    if (img["file"] == file) return img["words"].get<std::vector<std::string>>();
  return {};
}

// At least 90% of the expected words are among the recognised ones.
void ExpectWords(const json& item, const std::string& file) {
  std::multiset<std::string> got;
  for (const auto& w : item["words"]) got.insert(Norm(w["text"].get<std::string>()));
  const auto want = ExpectedWords(file);
  ASSERT_FALSE(want.empty()) << "no manifest entry for " << file << " (run scripts/setup.sh)";
  size_t found = 0;
  for (const auto& w : want) found += got.count(Norm(w)) > 0;
  EXPECT_GE(found * 10, want.size() * 9) << file << ": " << found << " of " << want.size() << " words; text: "
                                         << item["text"];
}

class E2eOcr : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new shoal::testing::TempDir();
    serve_ = new Shoal(StartServe(dir_->path(), {"--models", "ocr-eng,tiny-bert", "--threads", "1",
                                                 "--max-body-bytes", std::to_string(kMaxBody)}));
    ready_status_ = WaitForReadyz(serve_->port, 200, 120s);
  }
  static void TearDownTestSuite() {
    delete serve_;
    serve_ = nullptr;
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(ready_status_, 200) << "/readyz never became 200"; }

  static HttpResult Post(const std::string& body, const std::string& content_type,
                         const std::string& model = "ocr-eng") {
    HttpCall c;
    c.method = "POST";
    c.target = "/v1/ocr/" + model;
    c.body = body;
    c.content_type = content_type;
    // OCR of the 5 MiB page takes seconds, many more on a loaded machine:
    // the request's own deadline must not be the default 30 s.
    c.headers = {{"Shoal-Timeout-Ms", "110000"}};
    c.timeout = 120s;
    return Http(serve_->port, c);
  }
  static std::string Image(const std::string& file) {
    return Slurp(shoal::testing::SourceDir() + "/testdata/ocr/" + file);
  }
  static std::string Code(const HttpResult& r) {
    auto j = json::parse(r.body, nullptr, false);
    return j.is_discarded() ? "<not json>" : j["error"]["code"].get<std::string>();
  }
  static std::string BlobDir() { return dir_->path() + "/blobs"; }
  static size_t BlobFiles() {
    size_t n = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(BlobDir(), ec)) n += e.is_regular_file();
    return n;
  }
  static double Metric(const std::string& line_prefix) {
    auto m = HttpGet(serve_->port, "/metrics");
    std::istringstream in(m.body);
    std::string line;
    while (std::getline(in, line))
      if (line.rfind(line_prefix + " ", 0) == 0) return std::stod(line.substr(line_prefix.size() + 1));
    return 0;
  }

  static constexpr int kMaxBody = 12 << 20;
  static shoal::testing::TempDir* dir_;
  static Shoal* serve_;
  static int ready_status_;
};

shoal::testing::TempDir* E2eOcr::dir_ = nullptr;
Shoal* E2eOcr::serve_ = nullptr;
int E2eOcr::ready_status_ = 0;

TEST_F(E2eOcr, MsgpackImage) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  const std::string png = Image("eng.png");
  pk.pack_map(1);
  pk.pack(std::string("image"));
  pk.pack_bin(static_cast<uint32_t>(png.size()));
  pk.pack_bin_body(png.data(), static_cast<uint32_t>(png.size()));
  auto r = Post(std::string(buf.data(), buf.size()), "application/msgpack");
  ASSERT_EQ(r.status, 200) << r.error << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["model"], "ocr-eng");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["index"], 0);
  EXPECT_EQ(j["data"][0]["width"], 1003);
  EXPECT_EQ(j["data"][0]["height"], 336);
  EXPECT_EQ(j["data"][0]["words"][0]["box"].size(), 4u);
  ExpectWords(j["data"][0], "eng.png");
}

TEST_F(E2eOcr, MultipartImages) {
  const std::string b = "shoal-e2e-boundary";
  std::string body;
  for (const char* f : {"eng.png", "eng.jpg"}) {
    body += "--" + b + "\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + f +
            "\"\r\nContent-Type: application/octet-stream\r\n\r\n" + Image(f) + "\r\n";
  }
  body += "--" + b + "--\r\n";
  auto r = Post(body, "multipart/form-data; boundary=" + b);
  ASSERT_EQ(r.status, 200) << r.error << r.body;
  auto j = json::parse(r.body);
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][1]["index"], 1);
  ExpectWords(j["data"][0], "eng.png");
  ExpectWords(j["data"][1], "eng.jpg");
}

// A client that leaves a many-image request stops it: the images whose
// turn had not come are not read.
TEST_F(E2eOcr, AClientThatLeavesStopsTheImagesNotYetRead) {
  const std::string cancelled = "shoal_worker_cancelled_total{model=\"ocr-eng\"}";
  const std::string batches = "shoal_worker_batches_total{model=\"ocr-eng\"}";
  const double cancelled_before = Metric(cancelled);
  const double batches_before = Metric(batches);
  // In batches of 4 (models/ocr-eng): 16 batches, many more than can be
  // read while the cancel travels, on any machine.
  constexpr int kImages = 64;
  json body = {{"images", json::array()}};
  for (int i = 0; i < kImages; ++i) body["images"].push_back(Base64(Image("eng.png")));
  const int fd = PostAndKeepOpen(serve_->port, "/v1/ocr/ocr-eng", body.dump(), "application/json",
                                 {{"Shoal-Timeout-Ms", "110000"}});
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(shoal::testing::Eventually([&] { return Metric(batches) > batches_before; }, 60s))
      << "no image was read";
  ::close(fd);
  EXPECT_TRUE(shoal::testing::Eventually([&] { return Metric(cancelled) > cancelled_before; }, 60s))
      << "every image was read";
}

TEST_F(E2eOcr, Base64JsonAndDataUrl) {
  json body = {{"images", {Base64(Image("eng.png")), "data:image/tiff;base64," + Base64(Image("eng.tif"))}}};
  auto r = Post(body.dump(), "application/json");
  ASSERT_EQ(r.status, 200) << r.error << r.body;
  auto j = json::parse(r.body);
  ASSERT_EQ(j["data"].size(), 2u);
  ExpectWords(j["data"][0], "eng.png");
  ExpectWords(j["data"][1], "eng.tif");
}

TEST_F(E2eOcr, LargeImageTravelsThroughTheBlobStore) {
  const std::string big = Image("large.png");
  ASSERT_GT(big.size(), size_t{5} << 20);
  const double before = Metric("shoal_blob_offloaded_total{kind=\"request\"}");
  auto r = Post(big, "image/png");
  ASSERT_EQ(r.status, 200) << r.error << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["data"][0]["width"], 2200);
  ExpectWords(j["data"][0], "large.png");
  EXPECT_EQ(Metric("shoal_blob_offloaded_total{kind=\"request\"}"), before + 1);
  // The gateway deletes the blob once it has answered (on its blob thread).
  for (int i = 0; i < 200 && BlobFiles() > 0; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(BlobFiles(), 0u);
}

TEST_F(E2eOcr, BadInputsGetTheirStatusAndCode) {
  struct Case {
    std::string body, type, model;
    int status;
    std::string code;
  } cases[] = {
      {"just some text", "image/png", "ocr-eng", 400, "invalid_image"},
      {"GIF89a\x01\x00\x01\x00", "image/gif", "ocr-eng", 415, "unsupported_image_format"},
      {Image("eng.png"), "text/plain", "ocr-eng", 415, "unsupported_media_type"},
      {"{}", "application/json", "ocr-eng", 400, "missing_image"},
      {Image("eng.png"), "image/png", "no-such-model", 404, "model_not_found"},
      {Image("eng.png"), "image/png", "tiny-bert", 400, "wrong_task"},
      // PNG signature, then garbage: only the worker's decoder can tell.
      {std::string("\x89PNG\r\n\x1a\n", 8) + std::string(4000, 'x'), "image/png", "ocr-eng", 400, "invalid_image"},
  };
  for (const auto& c : cases) {
    auto r = Post(c.body, c.type, c.model);
    EXPECT_EQ(r.status, c.status) << c.type << " " << c.model << ": " << r.error << r.body.substr(0, 300);
    if (!c.code.empty()) {
      EXPECT_EQ(Code(r), c.code) << r.body.substr(0, 300);
    }
  }
  // Of several images, the message names the one the worker's decoder
  // refused, as the gateway's own checks do.
  const std::string b = "shoal-e2e-boundary";
  std::string body;
  for (const std::string& image : {Image("eng.png"), std::string("\x89PNG\r\n\x1a\n", 8) + std::string(4000, 'x')})
    body += "--" + b + "\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\n" + image + "\r\n";
  body += "--" + b + "--\r\n";
  auto r = Post(body, "multipart/form-data; boundary=" + b);
  EXPECT_EQ(r.status, 400) << r.error << r.body.substr(0, 300);
  EXPECT_EQ(Code(r), "invalid_image");
  const json j = json::parse(r.body, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.body.substr(0, 300);
  EXPECT_EQ(j["error"]["message"].get<std::string>().rfind("image 1: ", 0), 0u) << r.body.substr(0, 300);
}

}  // namespace
}  // namespace shoal::e2e
