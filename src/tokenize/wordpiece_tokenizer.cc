#include "tokenize/wordpiece_tokenizer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "tokenize/internal/basic_tokenizer.h"
#include "common/utf8.h"

namespace shoal {
namespace {

using tokenize_internal::BasicTokenizer;
using tokenize_internal::BasicTokenizerOptions;
using tokenize_internal::PieceSink;

constexpr std::string_view kSuffixPrefix = "##";

// Splits on \n, \r\n and \r like Python's universal-newline readlines().
std::vector<std::string> SplitLines(std::string_view text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\n' && text[i] != '\r') continue;
    lines.emplace_back(text.substr(start, i - start));
    if (text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
    start = i + 1;
  }
  if (start < text.size()) lines.emplace_back(text.substr(start));
  return lines;
}

// Sinks for ForEachId: where the ids of the text go.
struct IdVectorSink {
  std::vector<int32_t>* ids;
  void Add(int32_t id) { ids->push_back(id); }
  bool full() const { return false; }
};

struct CountingSink {
  int count = 0;
  void Add(int32_t) { ++count; }
  bool full() const { return false; }
};

// Keeps ids up to `keep` and counts the rest; with `stop`, wants no more
// once it has had more than `keep`.
struct TruncatingSink {
  std::vector<int32_t>* ids;
  size_t keep;
  bool stop = false;
  int count = 0;
  void Add(int32_t id) {
    if (static_cast<size_t>(count) < keep) ids->push_back(id);
    ++count;
  }
  bool full() const { return stop && static_cast<size_t>(count) > keep; }
};

}  // namespace

Status WordPieceOptions::Validate() const {
  if (max_input_chars_per_word < 1) {
    return InvalidArgument("max_input_chars_per_word must be at least 1, got " +
                           std::to_string(max_input_chars_per_word));
  }
  if (unk_token.empty() || cls_token.empty() || sep_token.empty() ||
      pad_token.empty()) {
    return InvalidArgument("special token strings must not be empty");
  }
  return Status::Ok();
}

Result<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::FromFile(
    const std::string& vocab_path, const WordPieceOptions& options) {
  std::error_code ec;
  if (std::filesystem::is_directory(vocab_path, ec)) {
    return InvalidArgument("vocab path is a directory: " + vocab_path);
  }
  std::ifstream in(vocab_path, std::ios::binary);
  if (!in) {
    return NotFound("cannot open vocab file " + vocab_path + ": " +
                    std::strerror(errno));
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return InvalidArgument("cannot read vocab file " + vocab_path);
  std::string text = std::move(buffer).str();
  std::string_view view = text;
  if (view.starts_with("\xEF\xBB\xBF")) view.remove_prefix(3);
  if (!IsValidUtf8(view)) {
    return InvalidArgument("vocab file is not valid UTF-8: " + vocab_path);
  }
  auto result = FromVocab(SplitLines(view), options);
  if (!result.ok()) {
    return Status(result.status().code(),
                  vocab_path + ": " + result.status().message());
  }
  return result;
}

Result<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::FromVocab(
    std::vector<std::string> vocab, const WordPieceOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  if (vocab.empty()) return InvalidArgument("vocabulary is empty");
  if (vocab.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgument("vocabulary has more than 2^31-1 tokens");
  }
  for (size_t i = 0; i < vocab.size(); ++i) {
    if (!IsValidUtf8(vocab[i])) {
      return InvalidArgument("vocabulary token " + std::to_string(i) +
                             " is not valid UTF-8");
    }
  }
  std::unique_ptr<WordPieceTokenizer> tokenizer(
      new WordPieceTokenizer(std::move(vocab), options));
  const std::pair<const std::string*, int32_t*> specials[] = {
      {&options.unk_token, &tokenizer->unk_id_},
      {&options.cls_token, &tokenizer->cls_id_},
      {&options.sep_token, &tokenizer->sep_id_},
      {&options.pad_token, &tokenizer->pad_id_},
  };
  for (const auto& [token, id] : specials) {
    *id = tokenizer->TokenToId(*token);
    if (*id < 0) {
      return InvalidArgument("vocabulary has no special token " + *token);
    }
  }
  return tokenizer;
}

WordPieceTokenizer::WordPieceTokenizer(std::vector<std::string> vocab,
                                       const WordPieceOptions& options)
    : options_(options), vocab_(std::move(vocab)) {
  // Keys view into vocab_, which never changes after this point.
  word_ids_.reserve(vocab_.size());
  for (size_t i = 0; i < vocab_.size(); ++i) {
    std::string_view token = vocab_[i];
    auto id = static_cast<int32_t>(i);
    word_ids_.insert_or_assign(token, id);
    max_word_bytes_ = std::max(max_word_bytes_, token.size());
    if (token.starts_with(kSuffixPrefix) && token.size() > kSuffixPrefix.size()) {
      std::string_view suffix = token.substr(kSuffixPrefix.size());
      suffix_ids_.insert_or_assign(suffix, id);
      max_suffix_bytes_ = std::max(max_suffix_bytes_, suffix.size());
    }
  }
  basic_ = std::make_unique<const BasicTokenizer>(BasicTokenizerOptions{
      .lowercase = options_.lowercase,
      .strip_accents = options_.strip_accents,
      .tokenize_chinese_chars = options_.tokenize_chinese_chars,
  });
}

WordPieceTokenizer::~WordPieceTokenizer() = default;

template <typename Sink>
void WordPieceTokenizer::ForEachId(std::string_view text, Sink& sink) const {
  // Greedy longest-match-first over code point boundaries, as in HF's
  // WordpieceTokenizer; candidates longer than the longest vocabulary entry
  // are skipped without a lookup. A word's pieces are collected first so an
  // unmatchable word becomes a single [UNK].
  struct WordPieceSink : PieceSink {
    const WordPieceTokenizer* self;
    Sink* out;
    std::vector<int32_t> pieces;
    size_t long_piece_chars() const override {
      return static_cast<size_t>(self->options_.max_input_chars_per_word);
    }
    void OnLongPiece(size_t) override { out->Add(self->unk_id_); }
    bool full() const override { return out->full(); }
    void OnPiece(std::string_view utf8,
                 std::span<const uint32_t> bounds) override {
      const size_t chars = bounds.size() - 1;
      if (chars > static_cast<size_t>(self->options_.max_input_chars_per_word)) {
        out->Add(self->unk_id_);
        return;
      }
      pieces.clear();
      size_t start = 0;
      while (start < chars) {
        const bool first = start == 0;
        const auto& ids = first ? self->word_ids_ : self->suffix_ids_;
        const size_t max_bytes = first ? self->max_word_bytes_ : self->max_suffix_bytes_;
        size_t end = chars;
        while (end > start && bounds[end] - bounds[start] > max_bytes) --end;
        int32_t found = -1;
        for (; end > start; --end) {
          auto it = ids.find(utf8.substr(bounds[start], bounds[end] - bounds[start]));
          if (it != ids.end()) {
            found = it->second;
            break;
          }
        }
        if (found < 0) {
          out->Add(self->unk_id_);
          return;
        }
        pieces.push_back(found);
        start = end;
      }
      for (int32_t id : pieces) out->Add(id);
    }
  } wordpiece;
  wordpiece.self = this;
  wordpiece.out = &sink;
  basic_->Split(text, &wordpiece);
}

std::vector<std::string> WordPieceTokenizer::Tokenize(std::string_view text) const {
  std::vector<std::string> tokens;
  for (int32_t id : EncodeNoSpecials(text)) tokens.push_back(vocab_[id]);
  return tokens;
}

std::vector<int32_t> WordPieceTokenizer::EncodeNoSpecials(std::string_view text) const {
  std::vector<int32_t> ids;
  IdVectorSink sink{&ids};
  ForEachId(text, sink);
  return ids;
}

Encoding WordPieceTokenizer::Encode(std::string_view text, int max_len, bool stop_when_truncated) const {
  Encoding encoding;
  const size_t keep = max_len <= 0 ? std::numeric_limits<size_t>::max()
                                   : static_cast<size_t>(std::max(max_len, 2) - 2);
  encoding.ids.push_back(cls_id_);
  TruncatingSink sink{&encoding.ids, keep, stop_when_truncated};
  ForEachId(text, sink);
  encoding.ids.push_back(sep_id_);
  encoding.full_length = sink.count + 2;
  encoding.truncated = static_cast<size_t>(sink.count) > keep;
  return encoding;
}

Encoding WordPieceTokenizer::EncodePair(std::string_view a, std::string_view b, int max_len,
                                        bool stop_when_truncated) const {
  // Neither text keeps more than the whole budget, so only that much of
  // each is stored; the sinks still count every piece for full_length
  // (with stop_when_truncated, up to one text over the budget: longest_first
  // cuts a text that alone is over the budget to the same length however
  // much longer it is).
  const size_t budget = max_len <= 0 ? std::numeric_limits<size_t>::max()
                                     : static_cast<size_t>(std::max(max_len, 3) - 3);
  std::vector<int32_t> first, second;
  TruncatingSink sink_a{&first, budget, stop_when_truncated}, sink_b{&second, budget, stop_when_truncated};
  ForEachId(a, sink_a);
  ForEachId(b, sink_b);
  Encoding encoding;
  encoding.full_length = sink_a.count + sink_b.count + 3;
  if (max_len > 0 && encoding.full_length > max_len) {
    encoding.truncated = true;
    // longest_first: one piece at a time from the longer text (from b on a
    // tie), as transformers' truncate_sequences does.
    size_t na = static_cast<size_t>(sink_a.count), nb = static_cast<size_t>(sink_b.count);
    while (na + nb > budget) {
      if (na > nb) {
        --na;
      } else {
        --nb;
      }
    }
    first.resize(std::min(na, first.size()));
    second.resize(std::min(nb, second.size()));
  }
  encoding.ids.reserve(first.size() + second.size() + 3);
  encoding.ids.push_back(cls_id_);
  encoding.ids.insert(encoding.ids.end(), first.begin(), first.end());
  encoding.ids.push_back(sep_id_);
  encoding.second_start = static_cast<int>(encoding.ids.size());
  encoding.ids.insert(encoding.ids.end(), second.begin(), second.end());
  encoding.ids.push_back(sep_id_);
  return encoding;
}

int WordPieceTokenizer::CountTokens(std::string_view text) const {
  CountingSink sink;
  ForEachId(text, sink);
  return sink.count + 2;
}

const std::string& WordPieceTokenizer::IdToToken(int32_t id) const {
  static const std::string kEmpty;
  if (id < 0 || static_cast<size_t>(id) >= vocab_.size()) return kEmpty;
  return vocab_[id];
}

int32_t WordPieceTokenizer::TokenToId(std::string_view token) const {
  auto it = word_ids_.find(token);
  return it == word_ids_.end() ? -1 : it->second;
}

}  // namespace shoal
