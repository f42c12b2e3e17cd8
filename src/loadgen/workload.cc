#include "loadgen/workload.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/json_text.h"
#include "loadgen/http_load.h"

namespace shoal::loadgen {
namespace {

// Common English words, nearly all single WordPiece tokens in BERT-style
// vocabularies, so words and tokens stay close.
constexpr const char* kWords[] = {
    "the",     "of",      "and",    "to",      "in",     "is",      "was",    "for",     "on",     "as",
    "with",    "by",      "he",     "at",      "from",   "his",     "an",     "were",    "are",    "which",
    "this",    "also",    "be",     "had",     "first",  "or",      "one",    "their",   "its",    "new",
    "after",   "but",     "who",    "not",     "they",   "have",    "her",    "she",     "two",    "been",
    "other",   "when",    "there",  "all",     "during", "into",    "school", "time",    "may",    "years",
    "more",    "most",    "only",   "over",    "city",   "some",    "world",  "would",   "where",  "later",
    "up",      "such",    "used",   "many",    "can",    "state",   "about",  "national", "out",   "known",
    "university", "united", "then", "made",    "number", "system",  "while",  "between", "three",  "american",
    "under",   "part",    "film",   "game",    "house",  "water",   "river",  "music",   "team",   "season",
    "small",   "model",   "fleet",  "fish",    "sea",    "light",   "north",  "south",   "west",   "east",
    "long",    "high",    "early",  "life",    "work",   "group",   "family", "country", "public", "war",
    "before",  "since",   "several", "because", "through", "church", "day",   "well",    "four",   "government",
    "area",    "name",    "born",   "same",    "village", "album",  "second", "each",    "both",   "home",
    "released", "began",  "local",  "book",    "station", "general", "series", "county", "line",   "major",
    "around",  "power",   "back",   "end",     "following", "company", "place", "final",  "club",  "members",
    "million", "road",    "list",   "until",   "history", "age",    "center", "based",   "party",  "best",
    "served",  "order",   "form",   "side",    "being",  "great",   "large",  "old",     "island", "top",
    "data",    "ocean",   "queue",  "server",  "batch",  "worker",  "gateway", "network", "memory", "device",
};
constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);

Result<double> ParseNumber(const std::string& text, const std::string& what) {
  if (text.empty()) return InvalidArgument(what + ": missing number");
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(v)) return InvalidArgument(what + ": '" + text + "' is not a number");
  return v;
}

std::vector<std::string> SplitColons(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ':');) out.push_back(part);
  if (!s.empty() && s.back() == ':') out.emplace_back();
  return out;
}

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

}  // namespace

std::string Popularity::ToString() const { return kind == Kind::kUniform ? "uniform" : "zipf:" + Num(s); }

Result<Popularity> ParsePopularity(const std::string& spec) {
  const std::string usage = "bad popularity '" + spec + "': use uniform or zipf:S with S > 0 (e.g. zipf:1.1)";
  Popularity p;
  if (spec == "uniform") return p;
  if (spec == "zipf") {
    p.kind = Popularity::Kind::kZipf;
    p.s = 1.1;
    return p;
  }
  if (spec.rfind("zipf:", 0) != 0) return InvalidArgument(usage);
  auto s = ParseNumber(spec.substr(5), usage);
  if (!s.ok()) return InvalidArgument(usage);
  if (!(*s > 0)) return InvalidArgument(usage);
  p.kind = Popularity::Kind::kZipf;
  p.s = *s;
  return p;
}

Result<ModelSampler> ModelSampler::Create(size_t num_models, const Popularity& popularity) {
  if (num_models == 0) return InvalidArgument("no models to send requests to");
  std::vector<double> w(num_models, 1.0);
  if (popularity.kind == Popularity::Kind::kZipf) {
    for (size_t k = 0; k < num_models; ++k) w[k] = 1.0 / std::pow(static_cast<double>(k + 1), popularity.s);
  }
  ModelSampler m;
  double total = 0;
  for (double x : w) total += x;
  double acc = 0;
  for (double x : w) {
    acc += x / total;
    m.cdf_.push_back(acc);
  }
  m.cdf_.back() = 1.0;
  return m;
}

size_t ModelSampler::Sample(std::mt19937_64& rng) const {
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  const auto it = std::upper_bound(cdf_.begin(), cdf_.end(), u);
  return std::min(static_cast<size_t>(it - cdf_.begin()), cdf_.size() - 1);
}

double ModelSampler::Probability(size_t i) const {
  if (i >= cdf_.size()) return 0;
  return i == 0 ? cdf_[0] : cdf_[i] - cdf_[i - 1];
}

int LengthDistribution::Sample(std::mt19937_64& rng) const {
  double v = a;
  switch (kind) {
    case Kind::kFixed:
      break;
    case Kind::kUniform:
      v = static_cast<double>(
          std::uniform_int_distribution<int64_t>(static_cast<int64_t>(a), static_cast<int64_t>(b))(rng));
      break;
    case Kind::kLognormal: {
      // mean = exp(mu + sigma^2 / 2)
      const double mu = std::log(a) - b * b / 2;
      v = std::round(std::lognormal_distribution<double>(mu, b)(rng));
      break;
    }
  }
  return static_cast<int>(std::clamp(v, 1.0, static_cast<double>(kMaxWords)));
}

double LengthDistribution::Mean() const {
  return kind == Kind::kUniform ? (a + b) / 2 : a;
}

std::string LengthDistribution::ToString() const {
  switch (kind) {
    case Kind::kFixed:
      return "fixed:" + Num(a);
    case Kind::kUniform:
      return "uniform:" + Num(a) + ":" + Num(b);
    case Kind::kLognormal:
      return "lognormal:" + Num(a) + ":" + Num(b);
  }
  return "";
}

Result<LengthDistribution> ParseLengthDistribution(const std::string& spec) {
  const std::string usage = "bad input length '" + spec +
                            "': use fixed:N, uniform:A:B or lognormal:MEAN:SIGMA (words; 1 <= N, A <= B <= " +
                            std::to_string(LengthDistribution::kMaxWords) + ", MEAN >= 1, SIGMA >= 0)";
  const auto parts = SplitColons(spec);
  if (parts.empty()) return InvalidArgument(usage);
  std::vector<double> nums;
  for (size_t i = 1; i < parts.size(); ++i) {
    auto v = ParseNumber(parts[i], usage);
    if (!v.ok()) return InvalidArgument(usage);
    nums.push_back(*v);
  }
  const double max = LengthDistribution::kMaxWords;
  auto whole = [](double v) { return v == std::floor(v); };
  LengthDistribution d;
  if (parts[0] == "fixed" && nums.size() == 1 && whole(nums[0]) && nums[0] >= 1 && nums[0] <= max) {
    d.kind = LengthDistribution::Kind::kFixed;
    d.a = nums[0];
    return d;
  }
  if (parts[0] == "uniform" && nums.size() == 2 && whole(nums[0]) && whole(nums[1]) && nums[0] >= 1 &&
      nums[0] <= nums[1] && nums[1] <= max) {
    d.kind = LengthDistribution::Kind::kUniform;
    d.a = nums[0];
    d.b = nums[1];
    return d;
  }
  if (parts[0] == "lognormal" && nums.size() == 2 && nums[0] >= 1 && nums[0] <= max && nums[1] >= 0 &&
      nums[1] <= 4) {
    d.kind = LengthDistribution::Kind::kLognormal;
    d.a = nums[0];
    d.b = nums[1];
    return d;
  }
  return InvalidArgument(usage);
}

std::string MakeText(int words, std::mt19937_64& rng) {
  std::uniform_int_distribution<size_t> pick(0, kNumWords - 1);
  std::string out;
  out.reserve(static_cast<size_t>(words) * 7);
  for (int i = 0; i < words; ++i) {
    if (i) out += ' ';
    out += kWords[pick(rng)];
  }
  return out;
}

std::string EmbeddingsBody(const std::string& model, const std::vector<std::string>& texts) {
  nlohmann::json body = {{"model", model}, {"input", texts}};
  return DumpJson(body);  // names and texts from flags and files need not be UTF-8
}

Status WorkloadOptions::Validate() const {
  if (models.empty()) return InvalidArgument("no models to send requests to");
  for (const auto& m : models) {
    if (m.empty()) return InvalidArgument("empty model name");
  }
  if (inputs_per_request < 1) return InvalidArgument("inputs per request must be >= 1");
  if (pool_size < 1) return InvalidArgument("request pool size must be >= 1");
  if (path.empty() || path.front() != '/') return InvalidArgument("request path must start with '/': '" + path + "'");
  if (api_key.find_first_of("\r\n") != std::string::npos) return InvalidArgument("API key contains a line break");
  return Status::Ok();
}

Result<Workload> BuildWorkload(const WorkloadOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  ASSIGN_OR_RETURN(ModelSampler sampler, ModelSampler::Create(options.models.size(), options.popularity));
  std::mt19937_64 rng(options.seed);
  const std::string headers = options.api_key.empty() ? "" : "Authorization: Bearer " + options.api_key + "\r\n";
  Workload w;
  w.requests.reserve(static_cast<size_t>(options.pool_size));
  for (int i = 0; i < options.pool_size; ++i) {
    const size_t model = sampler.Sample(rng);
    std::vector<std::string> texts;
    for (int j = 0; j < options.inputs_per_request; ++j) {
      const int words = options.lengths.Sample(rng);
      w.total_words += words;
      texts.push_back(MakeText(words, rng));
    }
    w.requests.push_back(
        JsonPostRequest(options.host_header, options.path, EmbeddingsBody(options.models[model], texts), headers));
    w.tags.push_back(static_cast<int>(model));
    w.inputs.push_back(options.inputs_per_request);
  }
  return w;
}

}  // namespace shoal::loadgen
