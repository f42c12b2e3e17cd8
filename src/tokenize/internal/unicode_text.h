// Unicode character data for the BERT basic tokenizer: per-code-point
// properties, full lower-casing, NFC composition and accent stripping (NFD,
// then drop Mn), all from tables generated out of Python's unicodedata so the
// results match what Hugging Face's Python tokenizer computes. Every function
// is thread-safe; none allocates except by growing the output it is given.
#pragma once

#include <cstdint>
#include <string>

namespace shoal::tokenize_internal {

// Property bits; must match the constants in gen_unicode_tables.py.
enum CodePointFlag : uint32_t {
  kDrop = 1u << 0,           // removed by cleaning: NUL, U+FFFD, C* but \t\n\r
  kSpace = 1u << 1,          // splits words: BERT whitespace or str.isspace()
  kCjk = 1u << 2,            // BERT's _is_chinese_char ranges
  kPunct = 1u << 3,          // ASCII symbol ranges or category P*
  kMn = 1u << 4,             // nonspacing mark, dropped by accent stripping
  // Bits 5 and 6 are unused.
  kHasLower = 1u << 7,       // str.lower() changes it
  kHasDecomposition = 1u << 8,  // NFD changes it
  kNfcCheck = 1u << 9,       // may take part in NFC reordering/composition
};

// Packed properties: flags in the low 16 bits, canonical combining class in
// bits 16..23.
using CodePointInfo = uint32_t;

// Dense table for the BMP (built once, on first use; thread-safe).
const CodePointInfo* BmpInfoTable();
CodePointInfo AstralInfo(char32_t cp);  // cp >= 0x10000

inline CodePointInfo InfoOf(const CodePointInfo* bmp, char32_t cp) {
  return cp < 0x10000 ? bmp[cp] : AstralInfo(cp);
}
inline CodePointInfo InfoOf(char32_t cp) { return InfoOf(BmpInfoTable(), cp); }
inline uint8_t CombiningClassOf(CodePointInfo info) {
  return static_cast<uint8_t>(info >> 16);
}

// The Unicode version the tables were generated from, e.g. "14.0.0".
const char* UnicodeVersion();

// Python's str.lower() of each code point of `in` on its own, appended to
// `out` (which is cleared first): full mappings (U+0130 becomes two code
// points), no context (U+03A3 always becomes σ, never the final ς). This is
// how BertTokenizer lower-cases: one character at a time, before NFC.
void ToLowerFull(const std::u32string& in, std::u32string* out);

// NFD of `in` with every Mn code point removed (BERT's _run_strip_accents).
void StripAccents(const std::u32string& in, std::u32string* out);

// NFC of `in`, written to `out`.
void ComposeNfc(const std::u32string& in, std::u32string* out);

// False for code points that can never make NFC change a string; a word
// made only of those is already NFC and can skip ComposeNfc.
inline bool MayNeedNfc(CodePointInfo info) { return (info & kNfcCheck) != 0; }

}  // namespace shoal::tokenize_internal
