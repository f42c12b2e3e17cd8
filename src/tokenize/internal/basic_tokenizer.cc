#include "tokenize/internal/basic_tokenizer.h"

#include <utility>

#include "common/utf8.h"

namespace shoal::tokenize_internal {

BasicTokenizer::BasicTokenizer(const BasicTokenizerOptions& options)
    : options_(options), bmp_(BmpInfoTable()) {}

void BasicTokenizer::Split(std::string_view text, PieceSink* sink) const {
  Scratch scratch;
  bool ascii = true;
  size_t pos = 0;
  while (pos < text.size()) {
    char32_t cp = DecodeUtf8(text, &pos);
    CodePointInfo info = InfoOf(bmp_, cp);
    if (info & kDrop) continue;  // a dropped char joins its neighbours
    if (info & kSpace) {
      FlushWord(ascii, &scratch, sink);
      if (sink->full()) return;
      ascii = true;
      continue;
    }
    if ((info & kCjk) && options_.tokenize_chinese_chars) {
      FlushWord(ascii, &scratch, sink);
      scratch.word.push_back(cp);
      FlushWord(false, &scratch, sink);
      if (sink->full()) return;
      ascii = true;
      continue;
    }
    scratch.word.push_back(cp);
    ascii = ascii && cp < 0x80;
    if (scratch.word.size() >= kMaxWordChars) {
      FlushWord(ascii, &scratch, sink);
      if (sink->full()) return;
      ascii = true;
    }
  }
  FlushWord(ascii, &scratch, sink);
}

void BasicTokenizer::FlushWord(bool ascii, Scratch* scratch, PieceSink* sink) const {
  std::u32string& word = scratch->word;
  if (word.empty()) return;
  if (ascii) {
    // NFC, accent stripping and every other lower mapping are no-ops here.
    if (options_.lowercase) {
      for (char32_t& c : word) {
        if (c >= 'A' && c <= 'Z') c += 32;
      }
    }
  } else {
    // The same order as BertTokenizer.tokenize: lower() one character at a
    // time over the text, then BasicTokenizer's NFC and per word lower()
    // (a no-op by then: NFC of lower-case text is lower-case) and
    // _run_strip_accents().
    if (options_.lowercase) {
      ToLowerFull(word, &scratch->temp);
      word.swap(scratch->temp);
    }
    for (char32_t c : word) {
      if (MayNeedNfc(InfoOf(bmp_, c))) {
        ComposeNfc(word, &scratch->temp);
        word.swap(scratch->temp);
        break;
      }
    }
    if (options_.strip_accents) {
      StripAccents(word, &scratch->temp);
      word.swap(scratch->temp);
    }
  }
  const char32_t* start = word.data();
  const char32_t* end = word.data() + word.size();
  for (const char32_t* p = start; p != end; ++p) {
    if (InfoOf(bmp_, *p) & kPunct) {
      Emit(start, p, scratch, sink);
      Emit(p, p + 1, scratch, sink);
      start = p + 1;
    }
  }
  Emit(start, end, scratch, sink);
  word.clear();
}

void BasicTokenizer::Emit(const char32_t* begin, const char32_t* end,
                          Scratch* scratch, PieceSink* sink) {
  if (begin == end) return;
  const size_t chars = static_cast<size_t>(end - begin);
  if (const size_t limit = sink->long_piece_chars(); limit > 0 && chars > limit) return sink->OnLongPiece(chars);
  scratch->utf8.clear();
  scratch->boundaries.clear();
  for (const char32_t* p = begin; p != end; ++p) {
    scratch->boundaries.push_back(static_cast<uint32_t>(scratch->utf8.size()));
    AppendUtf8(*p, &scratch->utf8);
  }
  scratch->boundaries.push_back(static_cast<uint32_t>(scratch->utf8.size()));
  sink->OnPiece(scratch->utf8, scratch->boundaries);
}

std::vector<std::string> BasicTokenizer::SplitToStrings(std::string_view text) const {
  struct Collector : PieceSink {
    std::vector<std::string> pieces;
    void OnPiece(std::string_view utf8, std::span<const uint32_t>) override {
      pieces.emplace_back(utf8);
    }
  } collector;
  Split(text, &collector);
  return std::move(collector.pieces);
}

}  // namespace shoal::tokenize_internal
