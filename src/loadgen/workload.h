// Workload: what `shoal bench` sends. Model popularity (uniform or Zipf),
// input lengths in words (fixed, uniform or lognormal) and inputs per
// request, drawn from one seeded generator into a pool of ready-made OpenAI
// /v1/embeddings requests that the load generator sends in turn. The same
// options and seed always give the same requests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"

namespace shoal::loadgen {

// Which model a request goes to: "uniform", or "zipf:S" (S > 0; "zipf"
// alone is zipf:1.1) where the model of rank k (1-based, in the order the
// models are listed) has weight 1/k^S.
struct Popularity {
  enum class Kind { kUniform, kZipf };
  Kind kind = Kind::kUniform;
  double s = 0;
  std::string ToString() const;
};
// InvalidArgument naming the accepted forms when `spec` is not one of them.
Result<Popularity> ParsePopularity(const std::string& spec);

// Draws model indices 0..n-1 with the given popularity (inverse CDF over
// the cumulative weights). Immutable after creation; thread-safe.
class ModelSampler {
 public:
  static Result<ModelSampler> Create(size_t num_models, const Popularity& popularity);
  size_t Sample(std::mt19937_64& rng) const;
  // Exact probability of index i.
  double Probability(size_t i) const;
  size_t size() const { return cdf_.size(); }

 private:
  std::vector<double> cdf_;  // cdf_.back() == 1
};

// Words per input: "fixed:N", "uniform:A:B" (inclusive) or
// "lognormal:MEAN:SIGMA" (MEAN words on average, SIGMA of the underlying
// normal). Samples are at least 1 and at most kMaxWords.
struct LengthDistribution {
  static constexpr int kMaxWords = 8192;
  enum class Kind { kFixed, kUniform, kLognormal };
  Kind kind = Kind::kFixed;
  double a = 16;  // fixed: N; uniform: A; lognormal: MEAN
  double b = 0;   // uniform: B; lognormal: SIGMA
  int Sample(std::mt19937_64& rng) const;
  double Mean() const;  // analytic, before clamping
  std::string ToString() const;
};
Result<LengthDistribution> ParseLengthDistribution(const std::string& spec);

// `words` words from a fixed list of common English words, drawn with `rng`,
// separated by single spaces.
std::string MakeText(int words, std::mt19937_64& rng);

struct WorkloadOptions {
  std::vector<std::string> models;  // in rank order for Zipf
  Popularity popularity;
  LengthDistribution lengths;
  int inputs_per_request = 1;  // texts in each request's "input" list
  std::string host_header;     // value of the Host header
  std::string path = "/v1/embeddings";
  std::string api_key;  // non-empty: Authorization: Bearer <key>
  int pool_size = 4096;  // requests built ahead of time, then sent in turn
  uint64_t seed = 1;
  Status Validate() const;
};

struct Workload {
  std::vector<std::string> requests;  // raw HTTP/1.1 requests
  std::vector<int> tags;              // model index of each request
  std::vector<int> inputs;            // inputs in each request
  int64_t total_words = 0;            // over the pool
};

// Builds the pool. Deterministic for given options.
Result<Workload> BuildWorkload(const WorkloadOptions& options);

// The JSON body of one request: {"model": model, "input": [texts...]} (a
// list even for one text).
std::string EmbeddingsBody(const std::string& model, const std::vector<std::string>& texts);

}  // namespace shoal::loadgen
