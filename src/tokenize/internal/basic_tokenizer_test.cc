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

// Records pieces as their text, and pieces over `bound` code points as
// "<length>".
struct BoundedSink : PieceSink {
  explicit BoundedSink(size_t bound) : bound(bound) {}
  size_t bound;
  std::vector<std::string> seen;
  size_t long_piece_chars() const override { return bound; }
  void OnLongPiece(size_t chars) override { seen.push_back("<" + std::to_string(chars) + ">"); }
  void OnPiece(std::string_view utf8, std::span<const uint32_t>) override { seen.emplace_back(utf8); }
};

// A sink that bounds piece length gets longer pieces as a length only
// (their text is never built), in order with the others.
TEST(BasicTokenizer, PiecesOverTheSinksBoundArriveAsALengthOnly) {
  BoundedSink sink(3);
  BasicTokenizer basic(BasicTokenizerOptions{});
  basic.Split("abc abcd,\u00e9\u00e9\u00e9\u00e9 x", &sink);
  EXPECT_EQ(sink.seen, (std::vector<std::string>{"abc", "<4>", ",", "<4>", "x"}));
}

// A word is read kMaxWordChars code points at a time, each part split as a
// word of its own: a text that is one giant word never needs 4-8 times its
// size in memory. (Only words longer than that differ from the reference.)
TEST(BasicTokenizer, AGiantWordIsReadInPartsOfBoundedSize) {
  BoundedSink sink(100);
  constexpr size_t kPart = BasicTokenizer::kMaxWordChars;
  BasicTokenizer basic(BasicTokenizerOptions{});
  basic.Split(std::string(2 * kPart + 5, 'a') + " b", &sink);
  EXPECT_EQ(sink.seen, (std::vector<std::string>{"<" + std::to_string(kPart) + ">", "<" + std::to_string(kPart) + ">",
                                                  "aaaaa", "b"}));
  // Words up to the bound are one word, as before.
  sink.seen.clear();
  basic.Split(std::string(kPart - 1, 'a') + ".b", &sink);
  EXPECT_EQ(sink.seen, (std::vector<std::string>{"<" + std::to_string(kPart - 1) + ">", ".", "b"}));
}

// Lower-cased before NFC, as BertTokenizer does: h + U+0331 composes to
// U+1E96, while capital H + U+0331 has no composite and would stay two code
// points if NFC came first. (Stripping accents would hide the order.)
TEST(BasicTokenizer, LowercasesBeforeNfc) {
  BasicTokenizer basic(BasicTokenizerOptions{.lowercase = true, .strip_accents = false});
  EXPECT_EQ(basic.SplitToStrings("H\u0331 J\u030c \u00c5"), (Pieces{"\u1e96", "\u01f0", "\u00e5"}));
}

TEST(BasicTokenizer, StripsAccentsWithoutLowercasing) {
  BasicTokenizer basic(BasicTokenizerOptions{.lowercase = false, .strip_accents = true});
  EXPECT_EQ(basic.SplitToStrings("Caf\u00e9 \u00c5NGSTR\u00d6M"), (Pieces{"Cafe", "ANGSTROM"}));
}

}  // namespace
}  // namespace shoal::tokenize_internal
