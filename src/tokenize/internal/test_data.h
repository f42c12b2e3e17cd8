// Test-only helpers: locate tests/data/tokenizer and read the reference cases
// written by scripts/reference_wordpiece.py.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenize/wordpiece_tokenizer.h"

namespace shoal::tokenize_internal {

// SHOAL_SOURCE_DIR when the test runs under CTest, else relative to this file.
inline std::filesystem::path TokenizerTestDataDir() {
  std::filesystem::path root;
  if (const char* dir = std::getenv("SHOAL_SOURCE_DIR"); dir != nullptr && *dir) {
    root = dir;
  } else {
    root = std::filesystem::path(__FILE__).parent_path() / ".." / ".." / "..";
  }
  return root / "tests" / "data" / "tokenizer";
}

inline std::string TestVocabPath() {
  return (TokenizerTestDataDir() / "vocab.txt").string();
}

struct ReferenceCase {
  std::string name;
  std::string text;  // raw bytes, possibly invalid UTF-8
  WordPieceOptions options;
  std::vector<std::string> basic;
  std::vector<std::string> tokens;
  std::vector<int32_t> ids;
};

inline std::string HexToBytes(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

// Empty on a missing or malformed file; callers assert non-empty.
inline std::vector<ReferenceCase> LoadReferenceCases() {
  std::ifstream in(TokenizerTestDataDir() / "reference.json");
  if (!in) return {};
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  std::vector<ReferenceCase> cases;
  if (!doc.is_array()) return cases;
  for (const auto& item : doc) {
    ReferenceCase c;
    c.name = item.at("name").get<std::string>();
    c.text = item.contains("text_hex") ? HexToBytes(item.at("text_hex").get<std::string>())
                                       : item.at("text").get<std::string>();
    if (item.contains("options")) {
      const auto& o = item.at("options");
      c.options.lowercase = o.value("lowercase", c.options.lowercase);
      c.options.strip_accents = o.value("strip_accents", c.options.strip_accents);
      c.options.tokenize_chinese_chars =
          o.value("tokenize_chinese_chars", c.options.tokenize_chinese_chars);
      c.options.max_input_chars_per_word =
          o.value("max_input_chars_per_word", c.options.max_input_chars_per_word);
    }
    c.basic = item.at("basic").get<std::vector<std::string>>();
    c.tokens = item.at("tokens").get<std::vector<std::string>>();
    c.ids = item.at("ids").get<std::vector<int32_t>>();
    cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace shoal::tokenize_internal
