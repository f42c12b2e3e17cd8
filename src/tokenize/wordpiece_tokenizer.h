// WordPieceTokenizer: turns text into BERT input ids exactly as Hugging
// Face's (slow, Python) BertTokenizer does: BasicTokenizer (clean, CJK
// spacing, NFC, lower-case, accent stripping, punctuation split) followed by
// greedy longest-match-first WordPiece. Workers build one per model and call
// it from any number of threads.
//
// Deliberate differences from BertTokenizer.tokenize(): special-token
// strings in the input ("[SEP]") are not recognised, they are tokenized like
// any other text; the vocabulary file's line breaks and a leading byte order
// mark are handled as described at FromFile(). Character data is Unicode
// 14.0 (what Python 3.11 ships), covering every script, not just Latin.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace shoal {

namespace tokenize_internal {
class BasicTokenizer;
}

struct WordPieceOptions {
  bool lowercase = true;
  // Independent of `lowercase` (BertTokenizer's strip_accents=None means
  // "follow do_lower_case": set both false for cased models).
  bool strip_accents = true;
  bool tokenize_chinese_chars = true;
  int max_input_chars_per_word = 100;  // longer pieces become unk_token
  std::string unk_token = "[UNK]";
  std::string cls_token = "[CLS]";
  std::string sep_token = "[SEP]";
  std::string pad_token = "[PAD]";

  Status Validate() const;
};

struct Encoding {
  std::vector<int32_t> ids;
  // Tokens incl. [CLS]/[SEP] before truncation; with stop_when_truncated,
  // a lower bound once truncated (more than max_len).
  int full_length = 0;
  bool truncated = false;
  // A pair ([CLS] a [SEP] b [SEP]): index of b's first token, where the
  // token type switches to 1. 0 for a single text.
  int second_start = 0;
};

class WordPieceTokenizer {
 public:
  // Reads a vocab.txt: one token per line, id = line number (0-based).
  // Lines end in \n, \r\n or \r (Python's universal newlines); a trailing
  // line break adds no token; a leading UTF-8 byte order mark is skipped.
  // Errors: NotFound if the file cannot be opened; InvalidArgument for an
  // empty vocabulary, invalid UTF-8, a missing unk/cls/sep/pad token or
  // invalid options. Blocks on file I/O.
  static Result<std::unique_ptr<WordPieceTokenizer>> FromFile(
      const std::string& vocab_path, const WordPieceOptions& options);
  // `vocab[i]` gets id i; a repeated token maps to its last id (as in HF).
  // Errors as for FromFile, without the I/O ones.
  static Result<std::unique_ptr<WordPieceTokenizer>> FromVocab(
      std::vector<std::string> vocab, const WordPieceOptions& options);

  ~WordPieceTokenizer();
  WordPieceTokenizer(const WordPieceTokenizer&) = delete;
  WordPieceTokenizer& operator=(const WordPieceTokenizer&) = delete;

  // All methods below are const and thread-safe. Input is UTF-8; an invalid
  // byte is treated as U+FFFD, which cleaning drops, so no input fails.

  // Word pieces ("un", "##aff", "##able"), without [CLS]/[SEP].
  std::vector<std::string> Tokenize(std::string_view text) const;
  // Ids of Tokenize(text).
  std::vector<int32_t> EncodeNoSpecials(std::string_view text) const;
  // [CLS] ids [SEP]. If that is longer than max_len, keeps the first
  // max_len-2 pieces, then [SEP], and sets truncated. max_len <= 0 means no
  // limit; [CLS] and [SEP] are always present, so max_len 1 acts like 2.
  // `stop_when_truncated`: stop reading the text at the first word boundary
  // past what is kept (the same ids; full_length then only says the text
  // was longer): a long document cut to 512 tokens is not tokenized whole.
  Encoding Encode(std::string_view text, int max_len, bool stop_when_truncated = false) const;
  // A pair for cross-encoders: [CLS] a [SEP] b [SEP]. If longer than
  // max_len, drops pieces from the end of the longer text first (Hugging
  // Face's "longest_first"), and sets truncated. max_len <= 0: no limit; at
  // least one piece of each non-empty text is kept when max_len allows.
  // `stop_when_truncated`: as for Encode; each text is read only until it
  // alone is over the budget, which gives the same ids.
  Encoding EncodePair(std::string_view a, std::string_view b, int max_len, bool stop_when_truncated = false) const;
  // Encode(text, 0).full_length without building the id vector.
  int CountTokens(std::string_view text) const;

  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }
  size_t vocab_size() const { return vocab_.size(); }
  const WordPieceOptions& options() const { return options_; }

  // The token string for `id`; an empty string if id is out of range.
  const std::string& IdToToken(int32_t id) const;
  // The id of an exact vocabulary entry, or -1.
  int32_t TokenToId(std::string_view token) const;

 private:
  WordPieceTokenizer(std::vector<std::string> vocab, const WordPieceOptions& options);
  template <typename Sink>
  void ForEachId(std::string_view text, Sink& sink) const;

  WordPieceOptions options_;
  std::vector<std::string> vocab_;  // id -> token; owns the maps' keys
  std::unordered_map<std::string_view, int32_t> word_ids_;    // every token
  std::unordered_map<std::string_view, int32_t> suffix_ids_;  // "##x", keyed "x"
  size_t max_word_bytes_ = 0;
  size_t max_suffix_bytes_ = 0;
  int32_t unk_id_ = -1;
  int32_t cls_id_ = -1;
  int32_t sep_id_ = -1;
  int32_t pad_id_ = -1;
  std::unique_ptr<const tokenize_internal::BasicTokenizer> basic_;
};

}  // namespace shoal
