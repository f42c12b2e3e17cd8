// BasicTokenizer: the first half of BERT tokenization, as Hugging Face's
// BasicTokenizer does it: clean the text, put spaces around CJK ideographs,
// split on whitespace, NFC, lower-case, strip accents and split punctuation
// off. Hands each resulting piece to a sink as UTF-8 with its code point
// boundaries, ready for the WordPiece step.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenize/internal/unicode_text.h"

namespace shoal::tokenize_internal {

struct BasicTokenizerOptions {
  bool lowercase = true;
  bool strip_accents = true;  // applied whether or not lowercase is set
  bool tokenize_chinese_chars = true;
};

class PieceSink {
 public:
  virtual ~PieceSink() = default;
  // One non-empty piece. `boundaries` holds the byte offset of each code
  // point in `utf8` followed by utf8.size(), so it has one entry more than
  // the piece has code points. Both views are valid only during the call.
  virtual void OnPiece(std::string_view utf8,
                       std::span<const uint32_t> boundaries) = 0;
  // Pieces of more code points than this (0: no bound) reach OnLongPiece
  // instead, with their length only. A sink with no use for their text
  // (WordPiece makes any piece over max_input_chars_per_word one [UNK])
  // spares building it: 5 bytes per character, 1.25 GiB for a 256 MiB word.
  virtual size_t long_piece_chars() const { return 0; }
  virtual void OnLongPiece(size_t chars) { (void)chars; }
  // True once the sink needs no more pieces: Split stops at the next word
  // boundary (or part boundary of a giant word: see Split).
  virtual bool full() const { return false; }
};

class BasicTokenizer {
 public:
  explicit BasicTokenizer(const BasicTokenizerOptions& options);

  // Splits `text` (UTF-8; invalid bytes are dropped like U+FFFD) and calls
  // sink->OnPiece for every piece in order. Thread-safe: no shared mutable
  // state; allocates only per-call scratch buffers.
  //
  // A word (a run without whitespace) is read kMaxWordChars code points at
  // a time, so a text that is one giant word needs no more than that in
  // memory (4-8 bytes a code point), not 4-8 times the text: each such part
  // is split as a word of its own. Only words longer than that differ from
  // BERT's reference tokenizer (a piece running across a part boundary
  // comes out as two).
  void Split(std::string_view text, PieceSink* sink) const;
  static constexpr size_t kMaxWordChars = size_t{1} << 20;

  // The pieces as strings, for tests and debugging.
  std::vector<std::string> SplitToStrings(std::string_view text) const;

 private:
  struct Scratch {
    std::u32string word;
    std::u32string temp;
    std::string utf8;
    std::vector<uint32_t> boundaries;
  };

  // Normalises scratch->word (one whitespace-delimited word) and emits its
  // punctuation-split pieces.
  void FlushWord(bool ascii, Scratch* scratch, PieceSink* sink) const;
  static void Emit(const char32_t* begin, const char32_t* end, Scratch* scratch,
                   PieceSink* sink);

  BasicTokenizerOptions options_;
  const CodePointInfo* bmp_;  // process-wide table, never freed
};

}  // namespace shoal::tokenize_internal
