// Strict UTF-8 decoding and encoding (Unicode 14, table 3-7). Invalid input
// never fails: each byte that does not start a well-formed sequence decodes
// to U+FFFD on its own, which resynchronises exactly where Python's
// bytes.decode("utf-8", "replace") does.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace shoal {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// C0, DEL and C1: characters a terminal may act on rather than show.
inline constexpr bool IsControl(char32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }

// Decodes the code point starting at text[*pos] and advances *pos past it
// (by one byte for an invalid sequence). Requires *pos < text.size().
inline char32_t DecodeUtf8(std::string_view text, size_t* pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = *pos;
  unsigned char b0 = s[i];
  if (b0 < 0x80) {
    *pos = i + 1;
    return b0;
  }
  auto cont = [&](size_t k, unsigned char lo, unsigned char hi) {
    return i + k < n && s[i + k] >= lo && s[i + k] <= hi;
  };
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (cont(1, 0x80, 0xBF)) {
      *pos = i + 2;
      return (char32_t{b0} & 0x1F) << 6 | (s[i + 1] & 0x3F);
    }
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    unsigned char lo = b0 == 0xE0 ? 0xA0 : 0x80;
    unsigned char hi = b0 == 0xED ? 0x9F : 0xBF;
    if (cont(1, lo, hi) && cont(2, 0x80, 0xBF)) {
      *pos = i + 3;
      return (char32_t{b0} & 0x0F) << 12 | char32_t{s[i + 1] & 0x3Fu} << 6 |
             (s[i + 2] & 0x3F);
    }
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    unsigned char lo = b0 == 0xF0 ? 0x90 : 0x80;
    unsigned char hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (cont(1, lo, hi) && cont(2, 0x80, 0xBF) && cont(3, 0x80, 0xBF)) {
      *pos = i + 4;
      return (char32_t{b0} & 0x07) << 18 | char32_t{s[i + 1] & 0x3Fu} << 12 |
             char32_t{s[i + 2] & 0x3Fu} << 6 | (s[i + 3] & 0x3F);
    }
  }
  *pos = i + 1;
  return kReplacementChar;
}

// True if `text` is entirely well-formed UTF-8.
inline bool IsValidUtf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t start = pos;
    if (DecodeUtf8(text, &pos) == kReplacementChar && pos - start != 3) return false;
  }
  return true;
}

// Appends the UTF-8 encoding of a valid scalar value.
inline void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace shoal
