#include "tokenize/internal/basic_tokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tokenize/internal/test_data.h"

namespace shoal::tokenize_internal {
namespace {

using Pieces = std::vector<std::string>;

BasicTokenizerOptions ToBasicOptions(const WordPieceOptions& o) {
  return {.lowercase = o.lowercase,
          .strip_accents = o.strip_accents,
          .tokenize_chinese_chars = o.tokenize_chinese_chars};
}

TEST(BasicTokenizer, MatchesReferenceBasicTokens) {
  auto cases = LoadReferenceCases();
  ASSERT_GT(cases.size(), 100u) << "missing tests/data/tokenizer/reference.json";
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    BasicTokenizer basic(ToBasicOptions(c.options));
    EXPECT_EQ(basic.SplitToStrings(c.text), c.basic);
  }
}

TEST(BasicTokenizer, ReportsCodePointBoundaries) {
  struct Recorder : PieceSink {
    std::vector<std::vector<uint32_t>> bounds;
    void OnPiece(std::string_view, std::span<const uint32_t> b) override {
      bounds.emplace_back(b.begin(), b.end());
    }
  } recorder;
  BasicTokenizer basic(BasicTokenizerOptions{.lowercase = false, .strip_accents = false});
  basic.Split("a\u00e9\u4e2d\U0001f600!", &recorder);
  // "aé", "中", "😀", "!"
  ASSERT_EQ(recorder.bounds.size(), 4u);
  EXPECT_EQ(recorder.bounds[0], (std::vector<uint32_t>{0, 1, 3}));
  EXPECT_EQ(recorder.bounds[1], (std::vector<uint32_t>{0, 3}));
  EXPECT_EQ(recorder.bounds[2], (std::vector<uint32_t>{0, 4}));
  EXPECT_EQ(recorder.bounds[3], (std::vector<uint32_t>{0, 1}));
}

TEST(BasicTokenizer, StripsAccentsWithoutLowercasing) {
  BasicTokenizer basic(BasicTokenizerOptions{.lowercase = false, .strip_accents = true});
  EXPECT_EQ(basic.SplitToStrings("Caf\u00e9 \u00c5NGSTR\u00d6M"), (Pieces{"Cafe", "ANGSTROM"}));
}

}  // namespace
}  // namespace shoal::tokenize_internal
