#include "common/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/device.h"

namespace shoal {
namespace {

using nlohmann::json;

template <typename T>
void Get(const json& j, const char* key, T& out) {
  if (auto it = j.find(key); it != j.end() && !it->is_null()) out = it->get<T>();
}

}  // namespace

Status ModelConfig::Validate() const {
  if (name.empty()) return InvalidArgument("model config: name is empty");
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
    if (process.max_frame_bytes < 1024) return InvalidArgument("model " + name + ": process.max_frame_bytes must be >= 1024");
    if (process.max_failed_starts < 0)
      return InvalidArgument("model " + name + ": process.max_failed_starts must be >= 0");
  }
  if (max_seq_len < 3 || max_seq_len > 8192)
    return InvalidArgument("model " + name + ": max_seq_len must be in [3, 8192]");
  if (dim < 0) return InvalidArgument("model " + name + ": dim must be >= 0");
  if (pooling != "mean" && pooling != "cls")
    return InvalidArgument("model " + name + ": pooling must be 'mean' or 'cls'");
  if (tokenizer.type != "wordpiece")
    return InvalidArgument("model " + name + ": unsupported tokenizer '" + tokenizer.type + "'");
  if (batching.max_batch_size < 1) return InvalidArgument("model " + name + ": max_batch_size must be >= 1");
  if (batching.max_batch_tokens < max_seq_len)
    return InvalidArgument("model " + name + ": max_batch_tokens must be >= max_seq_len");
  if (batching.max_wait_us < 0) return InvalidArgument("model " + name + ": max_wait_us must be >= 0");
  if (intra_op_threads < 0) return InvalidArgument("model " + name + ": intra_op_threads must be >= 0");
  return Status::Ok();
}

Result<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& dir) {
  ModelConfig c;
  c.dir = dir;
  try {
    json j = json::parse(json_text);
    if (!j.is_object()) return InvalidArgument("model config must be a JSON object");
    Get(j, "name", c.name);
    Get(j, "task", c.task);
    Get(j, "runtime", c.runtime);
    Get(j, "model_file", c.model_file);
    Get(j, "max_seq_len", c.max_seq_len);
    Get(j, "dim", c.dim);
    Get(j, "pooling", c.pooling);
    Get(j, "normalize", c.normalize);
    Get(j, "intra_op_threads", c.intra_op_threads);
    Get(j, "activation", c.activation);
    Get(j, "labels", c.labels);
    if (c.task == "classify" && c.dim == 0) c.dim = static_cast<int>(c.labels.size());
    if (auto t = j.find("tokenizer"); t != j.end() && t->is_object()) {
      Get(*t, "type", c.tokenizer.type);
      Get(*t, "vocab_file", c.tokenizer.vocab_file);
      Get(*t, "lowercase", c.tokenizer.lowercase);
      c.tokenizer.strip_accents = c.tokenizer.lowercase;  // BERT's default
      Get(*t, "strip_accents", c.tokenizer.strip_accents);
      Get(*t, "tokenize_chinese_chars", c.tokenizer.tokenize_chinese_chars);
    }
    if (auto p = j.find("process"); p != j.end() && p->is_object()) {
      Get(*p, "command", c.process.command);
      if (auto e = p->find("env"); e != p->end() && e->is_object())
        for (const auto& [k, v] : e->items()) c.process.env.emplace_back(k, v.get<std::string>());
      Get(*p, "cwd", c.process.cwd);
      Get(*p, "start_timeout_ms", c.process.start_timeout_ms);
      Get(*p, "request_timeout_ms", c.process.request_timeout_ms);
      Get(*p, "max_frame_bytes", c.process.max_frame_bytes);
      Get(*p, "health_interval_ms", c.process.health_interval_ms);
      Get(*p, "max_restart_backoff_ms", c.process.max_restart_backoff_ms);
      Get(*p, "max_failed_starts", c.process.max_failed_starts);
    }
    if (auto p = j.find("sim"); p != j.end() && p->is_object()) {
      Get(*p, "fixed_us", c.sim.fixed_us);
      Get(*p, "per_padded_token_us", c.sim.per_padded_token_us);
      Get(*p, "max_batch_rows", c.sim.max_batch_rows);
      Get(*p, "memory_bytes", c.sim.memory_bytes);
      Get(*p, "load_ms", c.sim.load_ms);
    }
    c.config_json = j.dump();
    if (auto b = j.find("batching"); b != j.end() && b->is_object()) {
      Get(*b, "max_batch_tokens", c.batching.max_batch_tokens);
      Get(*b, "max_batch_size", c.batching.max_batch_size);
      Get(*b, "max_wait_us", c.batching.max_wait_us);
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
  for (const auto& entry : std::filesystem::directory_iterator(repo_dir, ec)) {
    if (entry.is_directory() && std::filesystem::exists(entry.path() / "shoal.json"))
      dirs.push_back(entry.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  std::vector<ModelConfig> out;
  for (const auto& d : dirs) {
    ASSIGN_OR_RETURN(auto c, LoadModelConfig(d));
    for (const auto& o : out)
      if (o.name == c.name) return InvalidArgument("duplicate model name '" + c.name + "' in " + repo_dir);
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
