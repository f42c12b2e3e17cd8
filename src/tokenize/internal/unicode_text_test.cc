#include "tokenize/internal/unicode_text.h"

#include <gtest/gtest.h>

#include <string>

#include "common/utf8.h"

namespace shoal::tokenize_internal {
namespace {

std::u32string Lower(const std::u32string& s) {
  std::u32string out;
  ToLowerFull(s, &out);
  return out;
}
std::u32string Strip(const std::u32string& s) {
  std::u32string out;
  StripAccents(s, &out);
  return out;
}
std::u32string Nfc(const std::u32string& s) {
  std::u32string out;
  ComposeNfc(s, &out);
  return out;
}

TEST(UnicodeText, ReportsPythonUnicodeVersion) {
  EXPECT_STREQ(UnicodeVersion(), "14.0.0");
}

TEST(UnicodeText, ClassifiesCodePoints) {
  EXPECT_TRUE(InfoOf(U'\0') & kDrop);
  EXPECT_TRUE(InfoOf(0xFFFD) & kDrop);
  EXPECT_TRUE(InfoOf(0x200B) & kDrop);    // Cf
  EXPECT_TRUE(InfoOf(0xE000) & kDrop);    // Co
  EXPECT_TRUE(InfoOf(0x0378) & kDrop);    // Cn
  EXPECT_FALSE(InfoOf(U'\t') & kDrop);
  EXPECT_TRUE(InfoOf(U'\t') & kSpace);
  EXPECT_TRUE(InfoOf(0x3000) & kSpace);
  EXPECT_TRUE(InfoOf(0x2028) & kSpace);   // str.split() breaks on it
  EXPECT_TRUE(InfoOf(U'$') & kPunct);
  EXPECT_TRUE(InfoOf(0x2014) & kPunct);   // em dash, Pd
  EXPECT_FALSE(InfoOf(0x20AC) & kPunct);  // euro sign, Sc
  EXPECT_TRUE(InfoOf(0x4E2D) & kCjk);
  EXPECT_TRUE(InfoOf(0x2F800) & kCjk);
  EXPECT_FALSE(InfoOf(0x3042) & kCjk);    // hiragana is not in BERT's ranges
  EXPECT_TRUE(InfoOf(0x0301) & kMn);
  EXPECT_EQ(CombiningClassOf(InfoOf(0x0301)), 230);
  EXPECT_EQ(CombiningClassOf(InfoOf(0x0323)), 220);
  EXPECT_TRUE(InfoOf(0x10FFFF) & kDrop);
  EXPECT_TRUE(InfoOf(0x110000) & kDrop);
}

TEST(UnicodeText, LowercasesLikePython) {
  EXPECT_EQ(Lower(U"ABC \u00c0\u0178\u0130"), U"abc \u00e0\u00ff\u0069\u0307");
  EXPECT_EQ(Lower(U"\u0391\u0392\u0393"), U"\u03b1\u03b2\u03b3");
  EXPECT_EQ(Lower(U"\u0401\u042f"), U"\u0451\u044f");
  EXPECT_EQ(Lower(U"\u1e9e\u212a\u2126"), U"\u00df\u006b\u03c9");
  EXPECT_EQ(Lower(U"\U00010400"), U"\U00010428");  // Deseret
  // One code point at a time, as BertTokenizer lowers: Σ is σ wherever it
  // stands (str.lower() of the whole word would end it with ς).
  EXPECT_EQ(Lower(U"\u039f\u03a3"), U"\u03bf\u03c3");
  EXPECT_EQ(Lower(U"\u03a3\u039f"), U"\u03c3\u03bf");
  EXPECT_EQ(Lower(U"\u039f\u03a3\u0301"), U"\u03bf\u03c3\u0301");
}

TEST(UnicodeText, StripsAccentsThroughNfd) {
  EXPECT_EQ(Strip(U"\u00e9\u00c5\u1ebf\u1ec7\u01d5"), U"eAeeU");
  EXPECT_EQ(Strip(U"\u0301"), U"");
  EXPECT_EQ(Strip(U"\ud55c"), U"\u1112\u1161\u11ab");  // Hangul to jamo
  EXPECT_EQ(Strip(U"\u212b"), U"A");                   // singleton
  EXPECT_EQ(Strip(U"\ufb01"), U"\ufb01");              // compatibility only
  // Canonical order applies to the marks that survive (Mc, class 226 > 216).
  EXPECT_EQ(Strip(U"\U0001d16d\U0001d165"), U"\U0001d165\U0001d16d");
  // One run of 200,000 marks of alternating classes (a client can send
  // that): still ordered, lower class first, each class in its own order.
  // An insertion sort took about 10^10 steps here.
  std::u32string run;
  for (int i = 0; i < 100000; ++i) run += U"\U0001d16d\U0001d165";
  const std::u32string ordered = Strip(U"x" + run + U"y");
  ASSERT_EQ(ordered.size(), run.size() + 2);
  EXPECT_EQ(ordered, U"x" + std::u32string(100000, U'\U0001d165') + std::u32string(100000, U'\U0001d16d') + U"y");
}

TEST(UnicodeText, ComposesNfc) {
  EXPECT_EQ(Nfc(U"e\u0301"), U"\u00e9");
  EXPECT_EQ(Nfc(U"a\u0323\u0302"), U"\u1ead");
  EXPECT_EQ(Nfc(U"a\u0302\u0323"), U"\u1ead");
  EXPECT_EQ(Nfc(U"\u1112\u1161\u11ab"), U"\ud55c");
  EXPECT_EQ(Nfc(U"\u212b"), U"\u00c5");
  EXPECT_EQ(Nfc(U"\uf900"), U"\u8c48");
  EXPECT_EQ(Nfc(U"\u0915\u093c"), U"\u0915\u093c");  // excluded composite
  EXPECT_EQ(Nfc(U"\u09c7\u09be"), U"\u09cb");        // two starters
  EXPECT_EQ(Nfc(U"\u0301e"), U"\u0301e");
  EXPECT_EQ(Nfc(U""), U"");
}

TEST(Utf8, DecodesInvalidBytesToReplacementOneByOne) {
  auto decode_all = [](std::string_view s) {
    std::u32string out;
    size_t pos = 0;
    while (pos < s.size()) out.push_back(DecodeUtf8(s, &pos));
    return out;
  };
  EXPECT_EQ(decode_all("a\u00e9\u4e2d\U0001f600"), U"a\u00e9\u4e2d\U0001f600");
  EXPECT_EQ(decode_all("\xc3\x28"), U"\ufffd(");
  EXPECT_EQ(decode_all("\xe2\x82"), U"\ufffd\ufffd");
  EXPECT_EQ(decode_all("\xed\xa0\x80"), U"\ufffd\ufffd\ufffd");  // surrogate
  EXPECT_EQ(decode_all("\xc0\xaf"), U"\ufffd\ufffd");            // overlong
  EXPECT_EQ(decode_all("\xf4\x90\x80\x80"), U"\ufffd\ufffd\ufffd\ufffd");
  EXPECT_TRUE(IsValidUtf8("\xef\xbf\xbd"));
  EXPECT_FALSE(IsValidUtf8("\xff"));
}

}  // namespace
}  // namespace shoal::tokenize_internal
