// TesseractRuntime: the "tesseract" Runtime over the committed demo model
// models/ocr-eng and the rendered images in testdata/ocr.
#include "runtime/ocr/tesseract_runtime.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <msgpack.hpp>

#include "common/clock.h"

namespace shoal {
namespace {

std::string Source() {
  const char* v = std::getenv("SHOAL_SOURCE_DIR");
  return v && *v ? v : SHOAL_DEFAULT_SOURCE_DIR;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ModelConfig OcrEng() {
  auto c = LoadModelConfig(Source() + "/models/ocr-eng");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : ModelConfig{};
}

TEST(TesseractRuntime, RecognisesEachItemIntoOneDocument) {
  TesseractRuntime rt;
  ASSERT_TRUE(rt.Load(OcrEng()).ok());
  EXPECT_TRUE(rt.TakesItems());
  EXPECT_GT(rt.MemoryBytes(), 0);
  const std::string png = Slurp(Source() + "/testdata/ocr/eng.png");
  ASSERT_FALSE(png.empty()) << "run scripts/setup.sh to render testdata/ocr";
  auto r = rt.RunItems({png, Slurp(Source() + "/testdata/ocr/eng.jpg")}, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 2u);
  struct Want {
    const char* first_line;
    int width, height;
    size_t words;
  };
  const Want want[] = {{"quick brown fox", 1003, 336, 31}, {"Reading text from photos", 930, 266, 21}};
  for (size_t i = 0; i < 2; ++i) {
    const std::string& doc = (*r)[i];
    auto h = msgpack::unpack(doc.data(), doc.size());
    std::map<std::string, msgpack::object> m;
    h.get().convert(m);
    EXPECT_NE(m.at("text").as<std::string>().find(want[i].first_line), std::string::npos);
    EXPECT_EQ(m.at("width").as<int>(), want[i].width);
    EXPECT_EQ(m.at("height").as<int>(), want[i].height);
    const auto& words = m.at("words").via.array;
    EXPECT_GE(words.size, want[i].words - 2);
    ASSERT_GT(words.size, 0u);
    std::map<std::string, msgpack::object> w0;
    words.ptr[0].convert(w0);
    EXPECT_FALSE(w0.at("text").as<std::string>().empty());
    EXPECT_EQ(w0.at("box").as<std::vector<int>>().size(), 4u);
    EXPECT_GT(w0.at("confidence").as<float>(), 0.5f);
    // The first word opens the page's first block and line; the last one
    // is on the last line, at least as far on in both.
    EXPECT_EQ(w0.at("block").as<int>(), 0);
    EXPECT_EQ(w0.at("line").as<int>(), 0);
    std::map<std::string, msgpack::object> last;
    words.ptr[words.size - 1].convert(last);
    EXPECT_GE(last.at("block").as<int>(), 0);
    EXPECT_GT(last.at("line").as<int>(), 0);
  }
}

// A bad image gets the engine's error as its own result; the batch's other
// images keep theirs (they are not recognised again one by one).
TEST(TesseractRuntime, ABadImageFailsAloneWithTheEngineError) {
  TesseractRuntime rt;
  ASSERT_TRUE(rt.Load(OcrEng()).ok());
  auto r = rt.RunItems({Slurp(Source() + "/testdata/ocr/eng.png"), "not an image"}, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_TRUE(ParseItemError((*r)[0]).ok());
  EXPECT_FALSE((*r)[0].empty());
  const Status bad = ParseItemError((*r)[1]);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_EQ(bad.reason(), "invalid_image");
}

// An image whose caller's deadline has passed is not recognised: it gets
// DeadlineExceeded as its item error, and the others their results.
TEST(TesseractRuntime, AnImagePastItsDeadlineFailsAlone) {
  TesseractRuntime rt;
  ASSERT_TRUE(rt.Load(OcrEng()).ok());
  const std::string png = Slurp(Source() + "/testdata/ocr/eng.png");
  const int64_t now = SystemClock::Get()->NowUnixMs();
  auto r = rt.RunItemsBefore({png, png, png}, {now - 1, 0, now + 600000}, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ(ParseItemError((*r)[0]).code(), StatusCode::kDeadlineExceeded) << ParseItemError((*r)[0]).ToString();
  EXPECT_TRUE(ParseItemError((*r)[1]).ok());
  EXPECT_TRUE(ParseItemError((*r)[2]).ok());
  EXPECT_EQ((*r)[1], (*r)[2]);  // the same page read the same way
}

TEST(TesseractRuntime, RefusesTokenBatchesAndOtherTasks) {
  TesseractRuntime rt;
  ModelConfig c = OcrEng();
  EXPECT_EQ(rt.RunItems({"x"}, {}).status().code(), StatusCode::kUnavailable);
  c.task = "embed";
  EXPECT_EQ(rt.Load(c).reason(), "wrong_task");
  ASSERT_TRUE(rt.Load(OcrEng()).ok());
  EXPECT_EQ(rt.Run(TokenBatch{}).status().reason(), "wrong_task");
}

TEST(TesseractRuntime, IsRegisteredAsTesseract) {
  auto rt = CreateRuntime("tesseract");
  ASSERT_TRUE(rt.ok());
  ASSERT_TRUE((*rt)->Load(OcrEng()).ok());
  EXPECT_TRUE((*rt)->TakesItems());
}

TEST(TesseractRuntime, BadOcrOptionsFailTheLoad) {
  ModelConfig c = OcrEng();
  c.config_json = R"({"name":"x","task":"ocr","runtime":"tesseract","ocr":{"languages":"klingon"}})";
  TesseractRuntime rt;
  Status st = rt.Load(c);
  EXPECT_FALSE(st.ok());
}

}  // namespace
}  // namespace shoal
