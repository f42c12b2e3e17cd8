#include "tokenize/internal/unicode_text.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

namespace shoal::tokenize_internal {
namespace {

struct PropertyRange {
  char32_t first;
  uint16_t flags;
  uint8_t ccc;
};

struct CodePointMapping {
  char32_t cp;
  uint16_t offset;  // into the matching pool
  uint8_t length;
};

struct Composition {
  char32_t first;
  char32_t second;
  char32_t composite;
};

#include "tokenize/internal/unicode_tables.inc"

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161,
                   kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28,
                   kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

CodePointInfo Pack(const PropertyRange& r) {
  return static_cast<CodePointInfo>(r.flags) |
         (static_cast<CodePointInfo>(r.ccc) << 16);
}

std::unique_ptr<CodePointInfo[]> BuildBmpTable() {
  auto table = std::make_unique<CodePointInfo[]>(0x10000);
  const size_t n = std::size(kPropertyRanges);
  for (size_t i = 0; i < n && kPropertyRanges[i].first < 0x10000; ++i) {
    char32_t end = i + 1 < n ? std::min<char32_t>(kPropertyRanges[i + 1].first, 0x10000)
                             : 0x10000;
    std::fill(table.get() + kPropertyRanges[i].first, table.get() + end,
              Pack(kPropertyRanges[i]));
  }
  return table;
}

// Binary search in a table sorted by `cp`; nullptr when absent.
const CodePointMapping* FindMapping(const CodePointMapping* begin,
                                    const CodePointMapping* end, char32_t cp) {
  const CodePointMapping* it = std::lower_bound(
      begin, end, cp,
      [](const CodePointMapping& m, char32_t c) { return m.cp < c; });
  return it != end && it->cp == cp ? it : nullptr;
}

// Appends the full canonical decomposition of every code point, then puts
// each run of non-starters into canonical order (a stable sort by class).
void DecomposeCanonical(const std::u32string& in, std::u32string* out,
                        const CodePointInfo* bmp) {
  out->clear();
  for (char32_t cp : in) {
    if (cp >= kSBase && cp < kSBase + kSCount) {
      char32_t s = cp - kSBase;
      out->push_back(kLBase + s / kNCount);
      out->push_back(kVBase + (s % kNCount) / kTCount);
      if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
      continue;
    }
    if (!(InfoOf(bmp, cp) & kHasDecomposition)) {
      out->push_back(cp);
      continue;
    }
    const CodePointMapping* m =
        FindMapping(std::begin(kDecompositions), std::end(kDecompositions), cp);
    if (m == nullptr) {
      out->push_back(cp);
      continue;
    }
    out->append(kDecompositionPool + m->offset, m->length);
  }
  // Runs of non-starters are a handful of marks long in real text, but a
  // client's text can be one run of millions (alternating classes made an
  // insertion sort quadratic: minutes per MiB): a stable sort per run.
  std::vector<std::pair<uint8_t, char32_t>> run;
  const size_t n = out->size();
  for (size_t i = 0; i < n;) {
    run.clear();
    size_t j = i;
    for (; j < n; ++j) {
      const uint8_t ccc = CombiningClassOf(InfoOf(bmp, (*out)[j]));
      if (ccc == 0) break;
      run.emplace_back(ccc, (*out)[j]);
    }
    if (run.empty()) {
      ++i;
      continue;
    }
    if (run.size() > 1) {
      std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t k = 0; k < run.size(); ++k) (*out)[i + k] = run[k].second;
    }
    i = j;
  }
}

char32_t ComposePair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 &&
      b > kTBase && b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const Composition* begin = std::begin(kCompositions);
  const Composition* end = std::end(kCompositions);
  const Composition* it = std::lower_bound(
      begin, end, std::make_pair(a, b), [](const Composition& c, const auto& key) {
        return c.first != key.first ? c.first < key.first : c.second < key.second;
      });
  if (it != end && it->first == a && it->second == b) return it->composite;
  return 0;
}

}  // namespace

const CodePointInfo* BmpInfoTable() {
  static const std::unique_ptr<CodePointInfo[]> table = BuildBmpTable();
  return table.get();
}

CodePointInfo AstralInfo(char32_t cp) {
  if (cp > 0x10FFFF) return kDrop;
  const PropertyRange* end = std::end(kPropertyRanges);
  const PropertyRange* it = std::upper_bound(
      std::begin(kPropertyRanges), end, cp,
      [](char32_t c, const PropertyRange& r) { return c < r.first; });
  return Pack(*(it - 1));  // the first range starts at 0, so it > begin
}

const char* UnicodeVersion() { return kUnicodeVersion; }

void ToLowerFull(const std::u32string& in, std::u32string* out) {
  const CodePointInfo* bmp = BmpInfoTable();
  out->clear();
  for (char32_t cp : in) {
    if (cp < 0x80) {
      out->push_back(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp);
      continue;
    }
    if (!(InfoOf(bmp, cp) & kHasLower)) {
      out->push_back(cp);
    } else if (const CodePointMapping* m = FindMapping(
                   std::begin(kLowerMappings), std::end(kLowerMappings), cp)) {
      out->append(kLowerPool + m->offset, m->length);
    } else {
      out->push_back(cp);
    }
  }
}

void StripAccents(const std::u32string& in, std::u32string* out) {
  const CodePointInfo* bmp = BmpInfoTable();
  DecomposeCanonical(in, out, bmp);
  std::erase_if(*out, [bmp](char32_t cp) { return (InfoOf(bmp, cp) & kMn) != 0; });
}

void ComposeNfc(const std::u32string& in, std::u32string* out) {
  const CodePointInfo* bmp = BmpInfoTable();
  DecomposeCanonical(in, out, bmp);
  std::u32string& s = *out;
  if (s.empty()) return;
  // UAX #15 canonical composition: a mark composes with the last starter
  // unless a mark of the same or higher class sits between them.
  size_t starter = 0;
  char32_t starter_cp = s[0];
  int last_class = CombiningClassOf(InfoOf(bmp, starter_cp));
  if (last_class != 0) last_class = 256;  // leading non-starter: nothing composes
  size_t write = 1;
  for (size_t read = 1; read < s.size(); ++read) {
    char32_t cp = s[read];
    int cls = CombiningClassOf(InfoOf(bmp, cp));
    char32_t composite = ComposePair(starter_cp, cp);
    if (composite != 0 && (last_class < cls || last_class == 0)) {
      s[starter] = composite;
      starter_cp = composite;
      continue;
    }
    if (cls == 0) {
      starter = write;
      starter_cp = cp;
    }
    last_class = cls;
    s[write++] = cp;
  }
  s.resize(write);
}

}  // namespace shoal::tokenize_internal
