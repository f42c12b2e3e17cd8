#include "tokenize/wordpiece_tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tokenize/internal/test_data.h"

namespace shoal {
namespace {

using tokenize_internal::LoadReferenceCases;
using tokenize_internal::TestVocabPath;
using Tokens = std::vector<std::string>;

WordPieceOptions CasedOptions() {
  WordPieceOptions options;
  options.lowercase = false;
  options.strip_accents = false;
  return options;
}

std::unique_ptr<WordPieceTokenizer> LoadTestTokenizer(
    const WordPieceOptions& options = {}) {
  auto result = WordPieceTokenizer::FromFile(TestVocabPath(), options);
  EXPECT_TRUE(result.ok()) << result.status().ToString();
  return result.ok() ? std::move(result).value() : nullptr;
}

std::string WriteTempFile(const std::string& name, const std::string& contents) {
  std::filesystem::path path = std::filesystem::path(testing::TempDir()) / name;
  std::ofstream(path, std::ios::binary) << contents;
  return path.string();
}

TEST(WordPieceTokenizer, MatchesReferenceCases) {
  auto cases = LoadReferenceCases();
  ASSERT_GT(cases.size(), 100u) << "missing tests/data/tokenizer/reference.json";
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto tokenizer = LoadTestTokenizer(c.options);
    ASSERT_NE(tokenizer, nullptr);
    EXPECT_EQ(tokenizer->Tokenize(c.text), c.tokens);
    EXPECT_EQ(tokenizer->EncodeNoSpecials(c.text), c.ids);
  }
}

TEST(WordPieceTokenizer, SplitsPunctuation) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("Hello, World!"), (Tokens{"hello", ",", "world", "!"}));
  EXPECT_EQ(tokenizer->Tokenize("a.b-c"), (Tokens{"a", ".", "b", "-", "c"}));
  // Unicode P* is punctuation too; '$' and '^' count through BERT's ASCII ranges.
  EXPECT_EQ(tokenizer->Tokenize("\u00bfque? $5^"),
            (Tokens{"\u00bf", "que", "?", "$", "5", "^"}));
}

TEST(WordPieceTokenizer, SplitsWordsIntoLongestPieces) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("unaffable running"),
            (Tokens{"un", "##aff", "##able", "run", "##ning"}));
  EXPECT_EQ(tokenizer->EncodeNoSpecials("unaffable"),
            (std::vector<int32_t>{tokenizer->TokenToId("un"), tokenizer->TokenToId("##aff"),
                                  tokenizer->TokenToId("##able")}));
}

TEST(WordPieceTokenizer, SplitsApostrophesAndNumbers) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("Don't it\u2019s"),
            (Tokens{"don", "'", "t", "it", "\u2019", "s"}));
  EXPECT_EQ(tokenizer->Tokenize("3.14159 2024"),
            (Tokens{"3", ".", "14", "##15", "##9", "2024"}));
}

TEST(WordPieceTokenizer, LowercasesAndStripsAccents) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("Caf\u00e9 NA\u00cfVE \u00c5ngstr\u00f6m Ti\u1ebfng Vi\u1ec7t"),
            (Tokens{"cafe", "naive", "angstrom", "tieng", "viet"}));
  // Already-decomposed input gives the same result.
  EXPECT_EQ(tokenizer->Tokenize("cafe\u0301"), (Tokens{"cafe"}));
  // U+0130 lowercases to i + U+0307; stripping removes the dot.
  EXPECT_EQ(tokenizer->Tokenize("\u0130STANBUL"), (Tokens{"istanbul"}));
  EXPECT_EQ(tokenizer->Tokenize("\u041f\u0420\u0418\u0412\u0415\u0422"),
            (Tokens{"\u043f\u0440\u0438\u0432\u0435\u0442"}));
}

TEST(WordPieceTokenizer, LowercasesGreekOneCharacterAtATime) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // BertTokenizer lowers each character on its own, so "ΟΔΟΣ" is "οδοσ", not
  // str.lower()'s "οδος" with a final ς (which the test vocabulary holds as
  // one word: a tokenizer that lowered whole words would give that id).
  EXPECT_EQ(tokenizer->Tokenize("\u039f\u0394\u039f\u03a3 \u03a3"),
            (Tokens{"\u03bf", "##\u03b4", "##\u03bf", "##\u03c3", "\u03c3"}));
  EXPECT_EQ(tokenizer->Tokenize("\u03bf\u03b4\u03bf\u03c2"), (Tokens{"\u03bf\u03b4\u03bf\u03c2"}));
}

TEST(WordPieceTokenizer, KeepsCaseAndAccentsWhenCased) {
  auto tokenizer = LoadTestTokenizer(CasedOptions());
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("Caf\u00e9 Ti\u1ebfng"), (Tokens{"Caf\u00e9", "Ti\u1ebfng"}));
  // NFC first: a decomposed é matches the composed vocabulary entry.
  EXPECT_EQ(tokenizer->Tokenize("Cafe\u0301"), (Tokens{"Caf\u00e9"}));
  EXPECT_EQ(tokenizer->Tokenize("HELLO"), (Tokens{"H", "##E", "##L", "##L", "##O"}));
}

TEST(WordPieceTokenizer, SpacesOutCjkIdeographs) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("\u4e2d\u6587\u5b57"), (Tokens{"\u4e2d", "\u6587", "\u5b57"}));
  EXPECT_EQ(tokenizer->Tokenize("ab\u4e2dcd"), (Tokens{"a", "##b", "\u4e2d", "c", "##d"}));

  WordPieceOptions no_cjk;
  no_cjk.tokenize_chinese_chars = false;
  auto plain = LoadTestTokenizer(no_cjk);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->Tokenize("\u4e2d\u6587\u5b57"), (Tokens{"[UNK]"}));
}

TEST(WordPieceTokenizer, EmojiWithoutVocabEntryIsUnknown) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // U+FE0F is Mn and is stripped; U+1F600 is in the vocabulary, U+1F642 is not.
  EXPECT_EQ(tokenizer->Tokenize("\u2764\ufe0f \U0001f600 \U0001f642"),
            (Tokens{"\u2764", "\U0001f600", "[UNK]"}));
}

TEST(WordPieceTokenizer, LongWordBecomesUnknown) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize(std::string(101, 'a')), (Tokens{"[UNK]"}));
  Tokens at_limit = tokenizer->Tokenize(std::string(100, 'b'));
  ASSERT_EQ(at_limit.size(), 100u);
  EXPECT_EQ(at_limit.front(), "b");
  EXPECT_EQ(at_limit.back(), "##b");
  // The limit counts code points, not bytes.
  auto cased = LoadTestTokenizer(CasedOptions());
  ASSERT_NE(cased, nullptr);
  std::string e_acute_100;
  for (int i = 0; i < 100; ++i) e_acute_100 += "\u00e9";
  EXPECT_EQ(cased->Tokenize(e_acute_100).size(), 100u);
  EXPECT_EQ(cased->Tokenize(e_acute_100 + "\u00e9"), (Tokens{"[UNK]"}));
}

TEST(WordPieceTokenizer, UnmatchablePieceMakesWholeWordUnknown) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // "x" and "##y" match, but nothing matches the snowman that follows.
  EXPECT_EQ(tokenizer->Tokenize("xy\u2603 ok"), (Tokens{"[UNK]", "o", "##k"}));
}

TEST(WordPieceTokenizer, NormalisesWhitespaceAndDropsControls) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize(" hello\tworld\r\nthe\u00a0quick\u3000fox\u2028dog  "),
            (Tokens{"hello", "world", "the", "quick", "fox", "dog"}));
  // NUL, other C0 controls, zero-width space, BOM and soft hyphen vanish
  // without splitting the word; U+000B is a control, not a space, for BERT.
  EXPECT_EQ(tokenizer->Tokenize(std::string("hel\0lo", 6) + "\x01 wor\u200bld\ufeff do\u00adg"),
            (Tokens{"hello", "world", "dog"}));
  EXPECT_EQ(tokenizer->Tokenize("fo\x0bx"), (Tokens{"fox"}));
}

TEST(WordPieceTokenizer, EmptyAndBlankInputGiveNoPieces) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_TRUE(tokenizer->Tokenize("").empty());
  EXPECT_TRUE(tokenizer->Tokenize(" \t\n\r\u00a0\u3000 ").empty());
  Encoding encoding = tokenizer->Encode("", 16);
  EXPECT_EQ(encoding.ids, (std::vector<int32_t>{101, 102}));
  EXPECT_EQ(encoding.full_length, 2);
  EXPECT_FALSE(encoding.truncated);
}

TEST(WordPieceTokenizer, InvalidUtf8IsDroppedNotFatal) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("hel\xfflo w\xe2\x82orld \xed\xa0\x80x \xc0\xafy \xf0\x9f\x98"),
            (Tokens{"hello", "world", "x", "y"}));
  // Random bytes: anything goes, except crashing or emitting unknown ids.
  std::mt19937 rng(7);
  for (int round = 0; round < 2000; ++round) {
    std::string bytes(rng() % 64, '\0');
    for (char& b : bytes) b = static_cast<char>(rng());
    for (int32_t id : tokenizer->EncodeNoSpecials(bytes)) {
      ASSERT_GE(id, 0);
      ASSERT_LT(static_cast<size_t>(id), tokenizer->vocab_size());
    }
  }
}

TEST(WordPieceTokenizer, SpecialTokenTextIsOrdinaryText) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->Tokenize("[SEP]"), (Tokens{"[", "s", "##e", "##p", "]"}));
}

TEST(WordPieceTokenizer, EncodeAddsClsAndSep) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  Encoding encoding = tokenizer->Encode("hello world", 0);
  EXPECT_EQ(encoding.ids, (std::vector<int32_t>{101, tokenizer->TokenToId("hello"),
                                                tokenizer->TokenToId("world"), 102}));
  EXPECT_EQ(encoding.full_length, 4);
  EXPECT_FALSE(encoding.truncated);
}

TEST(WordPieceTokenizer, EncodeTruncatesToMaxLen) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const int32_t hello = tokenizer->TokenToId("hello");
  const int32_t world = tokenizer->TokenToId("world");
  const std::string text = "hello world the quick";  // four pieces

  Encoding cut = tokenizer->Encode(text, 4);
  EXPECT_EQ(cut.ids, (std::vector<int32_t>{101, hello, world, 102}));
  EXPECT_EQ(cut.full_length, 6);
  EXPECT_TRUE(cut.truncated);

  Encoding exact = tokenizer->Encode(text, 6);
  EXPECT_EQ(exact.ids.size(), 6u);
  EXPECT_FALSE(exact.truncated);

  Encoding minimal = tokenizer->Encode(text, 1);
  EXPECT_EQ(minimal.ids, (std::vector<int32_t>{101, 102}));
  EXPECT_TRUE(minimal.truncated);
  EXPECT_EQ(minimal.full_length, 6);

  EXPECT_EQ(tokenizer->Encode(text, 0).ids.size(), 6u);
}

TEST(WordPieceTokenizer, EncodePairFramesBothTextsWithSegmentStart) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const int32_t hello = tokenizer->TokenToId("hello");
  const int32_t world = tokenizer->TokenToId("world");
  const int32_t the = tokenizer->TokenToId("the");
  Encoding pair = tokenizer->EncodePair("hello world", "the", 0);
  EXPECT_EQ(pair.ids, (std::vector<int32_t>{101, hello, world, 102, the, 102}));
  EXPECT_EQ(pair.second_start, 4);
  EXPECT_EQ(pair.full_length, 6);
  EXPECT_FALSE(pair.truncated);
  EXPECT_EQ(tokenizer->Encode("hello", 0).second_start, 0);
}

TEST(WordPieceTokenizer, EncodePairTruncatesLongestFirst) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const int32_t hello = tokenizer->TokenToId("hello");
  const int32_t world = tokenizer->TokenToId("world");
  const int32_t the = tokenizer->TokenToId("the");
  const int32_t quick = tokenizer->TokenToId("quick");
  // a: 4 pieces, b: 1 piece, limit 6 leaves 3 pieces: a loses two.
  Encoding cut = tokenizer->EncodePair("hello world the quick", "the", 6);
  EXPECT_EQ(cut.ids, (std::vector<int32_t>{101, hello, world, 102, the, 102}));
  EXPECT_TRUE(cut.truncated);
  EXPECT_EQ(cut.full_length, 8);
  EXPECT_EQ(cut.second_start, 4);
  // Equal lengths: b gives up the first piece.
  Encoding even = tokenizer->EncodePair("hello world", "the quick", 6);
  EXPECT_EQ(even.ids, (std::vector<int32_t>{101, hello, world, 102, the, 102}));
  EXPECT_EQ(std::count(even.ids.begin(), even.ids.end(), quick), 0);
  // Nothing left for either text: still framed.
  Encoding tiny = tokenizer->EncodePair("hello", "world", 1);
  EXPECT_EQ(tiny.ids, (std::vector<int32_t>{101, 102, 102}));
  EXPECT_EQ(tiny.second_start, 2);
}

// With stop_when_truncated a long text gives the same ids, read only as far
// as it is kept (full_length then only says it was longer than max_len).
TEST(WordPieceTokenizer, StoppingAtTheTruncationGivesTheSameIds) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::string long_text;
  for (int i = 0; i < 1000; ++i) long_text += "hello world the quick ";
  const Encoding whole = tokenizer->Encode(long_text, 8);
  const Encoding stopped = tokenizer->Encode(long_text, 8, true);
  EXPECT_EQ(stopped.ids, whole.ids);
  EXPECT_TRUE(stopped.truncated);
  EXPECT_EQ(whole.full_length, 4002);
  EXPECT_GT(stopped.full_length, 8);
  EXPECT_LT(stopped.full_length, 20) << "read the whole text";
  // Texts that fit are read whole either way.
  EXPECT_EQ(tokenizer->Encode("hello world", 8, true).full_length, 4);
  EXPECT_FALSE(tokenizer->Encode("hello world", 8, true).truncated);
  // Pairs: longest_first gives the same cut however much longer a text
  // over the budget is, one of them long or both.
  const std::vector<std::string> texts = {"the", "hello world", "hello world the quick", long_text};
  for (int max_len : {3, 6, 7, 9, 12})
    for (const std::string& a : texts)
      for (const std::string& b : texts) {
        SCOPED_TRACE(std::to_string(max_len) + " " + std::to_string(a.size()) + " " + std::to_string(b.size()));
        const Encoding all = tokenizer->EncodePair(a, b, max_len);
        const Encoding cut = tokenizer->EncodePair(a, b, max_len, true);
        EXPECT_EQ(cut.ids, all.ids);
        EXPECT_EQ(cut.second_start, all.second_start);
        EXPECT_EQ(cut.truncated, all.truncated);
      }
  EXPECT_LT(tokenizer->EncodePair(long_text, long_text, 12, true).full_length, 40) << "read the whole texts";
}

TEST(WordPieceTokenizer, CountTokensMatchesEncode) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  for (const auto& c : LoadReferenceCases()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(tokenizer->CountTokens(c.text), tokenizer->Encode(c.text, 8).full_length);
  }
  EXPECT_EQ(tokenizer->CountTokens(""), 2);
}

TEST(WordPieceTokenizer, SpecialIdsComeFromVocab) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->pad_id(), 0);
  EXPECT_EQ(tokenizer->unk_id(), 100);
  EXPECT_EQ(tokenizer->cls_id(), 101);
  EXPECT_EQ(tokenizer->sep_id(), 102);
  EXPECT_EQ(tokenizer->vocab_size(), 509u);
  EXPECT_EQ(tokenizer->IdToToken(103), "[MASK]");
  EXPECT_EQ(tokenizer->IdToToken(-1), "");
  EXPECT_EQ(tokenizer->IdToToken(509), "");
  EXPECT_EQ(tokenizer->TokenToId("no-such-token"), -1);
}

TEST(WordPieceTokenizer, RepeatedTokenMapsToLastId) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // vocab.txt lists "dog" twice; the last line wins, as in Hugging Face.
  EXPECT_EQ(tokenizer->TokenToId("dog"), 508);
  EXPECT_EQ(tokenizer->EncodeNoSpecials("dog"), (std::vector<int32_t>{508}));
}

TEST(WordPieceTokenizer, FromFileMissingFileIsNotFound) {
  auto result = WordPieceTokenizer::FromFile("/nonexistent/vocab.txt", {});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNotFound);
}

TEST(WordPieceTokenizer, FromFileEmptyVocabIsInvalidArgument) {
  auto result = WordPieceTokenizer::FromFile(WriteTempFile("empty_vocab.txt", ""), {});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
}

TEST(WordPieceTokenizer, FromFileInvalidUtf8IsInvalidArgument) {
  auto result = WordPieceTokenizer::FromFile(
      WriteTempFile("bad_vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\nab\xff\n"), {});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
}

TEST(WordPieceTokenizer, FromFileAcceptsCrLfAndByteOrderMark) {
  auto result = WordPieceTokenizer::FromFile(
      WriteTempFile("crlf_vocab.txt", "\xEF\xBB\xBF[PAD]\r\n[UNK]\r[CLS]\n[SEP]\r\n\r\nhi"), {});
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  const auto& tokenizer = *result.value();
  EXPECT_EQ(tokenizer.pad_id(), 0);
  EXPECT_EQ(tokenizer.unk_id(), 1);
  EXPECT_EQ(tokenizer.cls_id(), 2);
  EXPECT_EQ(tokenizer.sep_id(), 3);
  EXPECT_EQ(tokenizer.IdToToken(4), "");  // the blank line keeps its id
  EXPECT_EQ(tokenizer.TokenToId("hi"), 5);
  EXPECT_EQ(tokenizer.vocab_size(), 6u);
}

TEST(WordPieceTokenizer, FromVocabRequiresSpecialTokens) {
  const std::vector<std::string> full = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"};
  ASSERT_TRUE(WordPieceTokenizer::FromVocab(full, {}).ok());
  for (size_t drop = 0; drop < 4; ++drop) {
    std::vector<std::string> vocab = full;
    vocab.erase(vocab.begin() + static_cast<std::ptrdiff_t>(drop));
    auto result = WordPieceTokenizer::FromVocab(vocab, {});
    ASSERT_FALSE(result.ok()) << full[drop];
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << full[drop];
    EXPECT_NE(result.status().message().find(full[drop]), std::string::npos);
  }
  auto empty = WordPieceTokenizer::FromVocab({}, {});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
}

TEST(WordPieceTokenizer, FromFileMissingSpecialTokenIsInvalidArgument) {
  auto result = WordPieceTokenizer::FromFile(
      WriteTempFile("no_sep_vocab.txt", "[PAD]\n[UNK]\n[CLS]\nhello\n"), {});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
}

TEST(WordPieceTokenizer, RejectsInvalidOptions) {
  WordPieceOptions options;
  options.max_input_chars_per_word = 0;
  EXPECT_EQ(options.Validate().code(), StatusCode::kInvalidArgument);
  auto result = WordPieceTokenizer::FromFile(TestVocabPath(), options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(WordPieceOptions{}.Validate().ok());
}

TEST(WordPieceTokenizer, IsSafeToShareAcrossThreads) {
  auto tokenizer = LoadTestTokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> expected;
  for (const auto& c : LoadReferenceCases()) {
    texts.push_back(c.text);
    expected.push_back(tokenizer->EncodeNoSpecials(c.text));
  }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) {
          if (tokenizer->EncodeNoSpecials(texts[i]) != expected[i]) ++mismatches[t];
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace shoal
