#include "common/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "common/device.h"
#include "common/json_text.h"
#include "common/utf8.h"

namespace shoal {
namespace {

using nlohmann::json;

// A config error that names its key; ParseModelConfig reports it.
struct ConfigError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

std::string Quoted(const std::string& where, const char* key) { return "'" + where + key + "'"; }

// Reads j[key] (`where` prefixes the key in errors: "batching.") into `out`
// when present and not null. Another type, or a number that is not whole or
// does not fit `out`, is an error naming the key: nlohmann would convert
// "256.9" to 256, wrap 4294967552 to 256, and say "type must be number"
// without saying which.
template <typename T>
void Get(const json& j, const std::string& where, const char* key, T& out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  const json& v = *it;
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) throw ConfigError(Quoted(where, key) + " must be true or false, not " + v.dump());
    out = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    const std::optional<T> n = IntegerAs<T>(v);
    if (!n) {
      throw ConfigError(Quoted(where, key) + " must be a whole number in [" +
                        std::to_string(std::numeric_limits<T>::min()) + ", " +
                        std::to_string(std::numeric_limits<T>::max()) + "], not " + v.dump());
    }
    out = *n;
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) throw ConfigError(Quoted(where, key) + " must be a number, not " + v.dump());
    out = v.get<double>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) throw ConfigError(Quoted(where, key) + " must be a string, not " + v.dump());
    out = v.get<std::string>();
  } else {
    static_assert(std::is_same_v<T, std::vector<std::string>>);
    if (!v.is_array() || !std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); }))
      throw ConfigError(Quoted(where, key) + " must be an array of strings, not " + v.dump());
    out = v.get<std::vector<std::string>>();
  }
}

// j[key] when it is an object, nullptr when absent or null; another type is
// an error (a block that is not an object was silently ignored).
const json* Block(const json& j, const std::string& where, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  if (!it->is_object()) throw ConfigError(Quoted(where, key) + " must be an object, not " + it->dump());
  return &*it;
}

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// Keys of `j` outside `known` are an error, so a typo ("max_seq_length")
// does not fall back to a default unnoticed; the nearest known key is
// suggested.
void RejectUnknownKeys(const json& j, const std::string& where, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : j.items()) {
    if (std::any_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) continue;
    std::string message = "unknown key '" + where + key + "'";
    const char* nearest = nullptr;
    size_t best = 4;  // suggest only close ones
    for (const char* k : known) {
      const size_t d = EditDistance(key, k);
      if (d < best) best = d, nearest = k;
    }
    if (nearest != nullptr) message += " (did you mean '" + where + nearest + "'?)";
    throw ConfigError(message);
  }
}

}  // namespace

Status ModelConfig::Validate() const {
  if (name.empty()) return InvalidArgument("model config: name is empty");
  // A model's queue consumer is "shoal_" + the name with every byte other
  // than a letter, digit, '_' or '-' written as three (wire::ModelToToken);
  // JetStream keeps consumer names, and their directories, to 255 bytes.
  for (size_t pos = 0; pos < name.size();) {
    if (IsControl(DecodeUtf8(name, &pos))) return InvalidArgument("model config: the name has a control character");
  }
  size_t token_bytes = 0;
  for (unsigned char c : name) token_bytes += KeptInModelToken(c) ? 1 : 3;
  if (token_bytes > kMaxNameTokenBytes) {
    return InvalidArgument("model " + name + ": the name is too long: its queue form takes " +
                           std::to_string(token_bytes) + " bytes, at most " + std::to_string(kMaxNameTokenBytes) +
                           " (letters, digits, '_' and '-' take one byte, any other byte three)");
  }
  if (task != "embed" && task != "score" && task != "classify" && task != "ocr" && task != "generate")
    return InvalidArgument("model " + name + ": unsupported task '" + task +
                           "' (embed, score, classify, ocr or generate)");
  if (!activation.empty() && activation != "none" && activation != "sigmoid" && activation != "softmax")
    return InvalidArgument("model " + name + ": activation must be 'none', 'sigmoid' or 'softmax'");
  if (auto d = ParseDevice(device); !d.ok()) return InvalidArgument("model " + name + ": " + d.status().message(), "invalid_device");
  if (task == "score" && dim > 1)
    return InvalidArgument("model " + name + ": a score model returns one value per pair (dim 1)");
  if (!labels.empty() && dim > 0 && static_cast<int>(labels.size()) != dim)
    return InvalidArgument("model " + name + ": " + std::to_string(labels.size()) + " labels for dim " +
                           std::to_string(dim));
  if (runtime != "torchscript" && runtime != "null" && runtime != "process" && runtime != "sim" &&
      runtime != "tesseract" && runtime != "openai")
    return InvalidArgument("model " + name + ": unknown runtime '" + runtime + "'");
  if (runtime == "sim") {
    if (sim.fixed_us < 0 || !(sim.per_padded_token_us >= 0) || sim.max_batch_rows < 0 || sim.memory_bytes < 0 ||
        sim.load_ms < 0)
      return InvalidArgument("model " + name + ": sim costs must be >= 0");
    if (dim <= 0) return InvalidArgument("model " + name + ": runtime 'sim' needs dim > 0");
  }
  if (runtime == "process") {
    if (process.command.empty() || process.command.front().empty())
      return InvalidArgument("model " + name + ": runtime 'process' needs process.command");
    if (process.start_timeout_ms < 1 || process.request_timeout_ms < 1 || process.health_interval_ms < 10 ||
        process.max_restart_backoff_ms < 1)
      return InvalidArgument("model " + name + ": process timeouts must be positive (health_interval_ms >= 10)");
    constexpr int64_t kDayMs = 24 * 3600 * 1000;
    if (process.start_timeout_ms > kDayMs || process.request_timeout_ms > kDayMs ||
        process.health_interval_ms > kDayMs || process.max_restart_backoff_ms > kDayMs)
      return InvalidArgument("model " + name + ": process timeouts must be at most a day (86400000 ms)");
    if (process.max_frame_bytes < 1024 || process.max_frame_bytes > (int64_t{1} << 31))
      return InvalidArgument("model " + name + ": process.max_frame_bytes must be in [1024, 2147483648]");
    if (process.max_failed_starts < 0)
      return InvalidArgument("model " + name + ": process.max_failed_starts must be >= 0");
  }
  if (max_seq_len < 3 || max_seq_len > 8192)
    return InvalidArgument("model " + name + ": max_seq_len must be in [3, 8192]");
  if (dim < 0 || dim > kMaxDim) return InvalidArgument("model " + name + ": dim must be in [0, 1048576]");
  if (pooling != "mean" && pooling != "cls")
    return InvalidArgument("model " + name + ": pooling must be 'mean' or 'cls'");
  if (tokenizer.type != "wordpiece")
    return InvalidArgument("model " + name + ": unsupported tokenizer '" + tokenizer.type + "'");
  if (batching.max_batch_size < 1 || batching.max_batch_size > kMaxBatchSize)
    return InvalidArgument("model " + name + ": max_batch_size must be in [1, 65536]");
  if (batching.max_batch_tokens < max_seq_len)
    return InvalidArgument("model " + name + ": max_batch_tokens must be >= max_seq_len");
  if (batching.max_wait_us < 0 || batching.max_wait_us > kMaxWaitUs)
    return InvalidArgument("model " + name + ": max_wait_us must be in [0, 60000000] (a minute)");
  if (intra_op_threads < 0) return InvalidArgument("model " + name + ": intra_op_threads must be >= 0");
  return Status::Ok();
}

Result<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& dir) {
  ModelConfig c;
  c.dir = dir;
  try {
    json j = json::parse(json_text);
    if (!j.is_object()) return InvalidArgument("model config must be a JSON object");
    Get(j, "", "name", c.name);
    Get(j, "", "task", c.task);
    Get(j, "", "runtime", c.runtime);
    // A "process" runtime gets the whole file and may read keys of its own.
    if (c.runtime != "process") {
      RejectUnknownKeys(j, "", {"name", "task", "runtime", "model_file", "max_seq_len", "dim", "pooling", "normalize",
                                "intra_op_threads", "activation", "labels", "tokenizer", "batching", "process", "sim",
                                "ocr", "openai"});
    }
    Get(j, "", "model_file", c.model_file);
    Get(j, "", "max_seq_len", c.max_seq_len);
    Get(j, "", "dim", c.dim);
    Get(j, "", "pooling", c.pooling);
    Get(j, "", "normalize", c.normalize);
    Get(j, "", "intra_op_threads", c.intra_op_threads);
    Get(j, "", "activation", c.activation);
    Get(j, "", "labels", c.labels);
    if (c.task == "classify" && c.dim == 0) c.dim = static_cast<int>(c.labels.size());
    if (const json* t = Block(j, "", "tokenizer")) {
      RejectUnknownKeys(*t, "tokenizer.", {"type", "vocab_file", "lowercase", "strip_accents", "tokenize_chinese_chars"});
      Get(*t, "tokenizer.", "type", c.tokenizer.type);
      Get(*t, "tokenizer.", "vocab_file", c.tokenizer.vocab_file);
      Get(*t, "tokenizer.", "lowercase", c.tokenizer.lowercase);
      c.tokenizer.strip_accents = c.tokenizer.lowercase;  // BERT's default
      Get(*t, "tokenizer.", "strip_accents", c.tokenizer.strip_accents);
      Get(*t, "tokenizer.", "tokenize_chinese_chars", c.tokenizer.tokenize_chinese_chars);
    }
    if (const json* p = Block(j, "", "process")) {  // its runtime's own keys pass through
      Get(*p, "process.", "command", c.process.command);
      if (const json* e = Block(*p, "process.", "env")) {
        for (const auto& [k, v] : e->items()) {
          if (!v.is_string()) throw ConfigError("'process.env." + k + "' must be a string, not " + v.dump());
          // The worker sets these itself; a name with '=' or NUL would
          // set a variable other than the one it names.
          if (k.empty() || k.find_first_of(std::string("=\0", 2)) != std::string::npos)
            throw ConfigError("'process.env' has a variable name that is empty or holds '=' or NUL");
          if (k == "SHOAL_RUNTIME_SOCKET" || k == "SHOAL_MODEL_DIR")
            throw ConfigError("'process.env." + k + "' is set by the worker, not the config");
          c.process.env.emplace_back(k, v.get<std::string>());
        }
      }
      Get(*p, "process.", "cwd", c.process.cwd);
      Get(*p, "process.", "start_timeout_ms", c.process.start_timeout_ms);
      Get(*p, "process.", "request_timeout_ms", c.process.request_timeout_ms);
      Get(*p, "process.", "max_frame_bytes", c.process.max_frame_bytes);
      Get(*p, "process.", "health_interval_ms", c.process.health_interval_ms);
      Get(*p, "process.", "max_restart_backoff_ms", c.process.max_restart_backoff_ms);
      Get(*p, "process.", "max_failed_starts", c.process.max_failed_starts);
    }
    if (const json* p = Block(j, "", "sim")) {
      RejectUnknownKeys(*p, "sim.", {"fixed_us", "per_padded_token_us", "max_batch_rows", "memory_bytes", "load_ms"});
      Get(*p, "sim.", "fixed_us", c.sim.fixed_us);
      Get(*p, "sim.", "per_padded_token_us", c.sim.per_padded_token_us);
      Get(*p, "sim.", "max_batch_rows", c.sim.max_batch_rows);
      Get(*p, "sim.", "memory_bytes", c.sim.memory_bytes);
      Get(*p, "sim.", "load_ms", c.sim.load_ms);
    }
    c.config_json = j.dump();
    if (const json* b = Block(j, "", "batching")) {
      RejectUnknownKeys(*b, "batching.", {"max_batch_tokens", "max_batch_size", "max_wait_us"});
      Get(*b, "batching.", "max_batch_tokens", c.batching.max_batch_tokens);
      Get(*b, "batching.", "max_batch_size", c.batching.max_batch_size);
      Get(*b, "batching.", "max_wait_us", c.batching.max_wait_us);
    }
  } catch (const std::exception& e) {
    return InvalidArgument(std::string("model config: ") + e.what());
  }
  RETURN_IF_ERROR(c.Validate());
  return c;
}

std::string ModelConfig::EffectiveActivation() const {
  if (!activation.empty()) return activation;
  if (task == "score") return "sigmoid";
  if (task == "classify") return "softmax";
  return "none";
}

Result<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = dir + "/shoal.json";
  std::ifstream in(path);
  if (!in) return NotFound("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto abs = std::filesystem::absolute(dir).lexically_normal().string();
  if (!abs.empty() && abs.back() == '/') abs.pop_back();
  auto r = ParseModelConfig(ss.str(), abs);
  if (!r.ok()) return Status(r.status().code(), path + ": " + r.status().message());
  return r;
}

Result<std::vector<ModelConfig>> LoadModelRepository(const std::string& repo_dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(repo_dir, ec))
    return NotFound("model repository " + repo_dir + " is not a directory");
  std::vector<std::string> dirs;
  std::filesystem::directory_iterator it(repo_dir, ec);
  if (ec) return Unavailable("cannot read model repository " + repo_dir + ": " + ec.message());
  // Error-code forms throughout: an entry that cannot be examined (a
  // lost+found of another user, a symlink loop) is not a model, and must not
  // throw out of here.
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    std::error_code entry_ec;
    const auto& entry = *it;
    if (!entry.is_directory(entry_ec) || entry_ec) continue;
    if (std::filesystem::is_regular_file(entry.path() / "shoal.json", entry_ec) && !entry_ec)
      dirs.push_back(entry.path().string());
  }
  if (ec) return Unavailable("cannot read model repository " + repo_dir + ": " + ec.message());
  std::sort(dirs.begin(), dirs.end());
  std::vector<ModelConfig> out;
  for (const auto& d : dirs) {
    ASSIGN_OR_RETURN(auto c, LoadModelConfig(d));
    for (const auto& o : out)
      if (o.name == c.name)
        return InvalidArgument("duplicate model name '" + c.name + "' in " + o.dir + " and " + c.dir);
    out.push_back(std::move(c));
  }
  return out;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j = {{"name", c.name},
            {"task", c.task},
            {"runtime", c.runtime},
            {"max_seq_len", c.max_seq_len},
            {"dim", c.dim},
            {"pooling", c.pooling},
            {"normalize", c.normalize},
            {"activation", c.EffectiveActivation()},
            {"labels", c.labels},
            {"batching",
             {{"max_batch_tokens", c.batching.max_batch_tokens},
              {"max_batch_size", c.batching.max_batch_size},
              {"max_wait_us", c.batching.max_wait_us}}}};
  return j.dump();
}

}  // namespace shoal
