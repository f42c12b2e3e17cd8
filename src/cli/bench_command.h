// `shoal bench`: a load generator and reporter for a Shoal gateway, or any
// OpenAI-compatible /v1/embeddings endpoint (plain http:// only). Open loop
// (Poisson arrivals at one rate or a sweep of rates) or closed loop (N
// concurrent clients); Zipf or uniform model popularity; input lengths from
// a distribution. Prints live progress on stderr and a summary on stdout,
// and writes results.json and SVG plots. main.cc registers it with
// AddBenchCommand and runs it when parsed.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace shoal {

struct BenchCommandFlags {
  std::string url = "http://127.0.0.1:8080";  // http://host[:port][/prefix]
  std::string path = "/v1/embeddings";
  // Load levels: exactly one of these (none: --closed 8).
  std::string closed;  // "N" or "N1,N2,..." concurrent clients
  std::string rate;    // "R" requests/s, Poisson arrivals
  std::string rates;   // "R1,R2,..."
  std::string sweep;   // "START:STOP:STEPS", evenly spaced rates
  double duration_s = 10;  // measured window per load level
  double warmup_s = 2;     // unmeasured lead-in per load level
  std::string models;      // comma-separated; empty: GET /v1/models
  std::string popularity = "uniform";
  std::string input_words = "fixed:16";
  int batch = 1;  // inputs per request
  std::string out_dir = "shoal-bench";
  std::string api_key;  // empty: SHOAL_BENCH_API_KEY, then OPENAI_API_KEY
  int max_connections = 1024;
  int threads = 1;  // closed loop client threads
  int pool = 4096;  // distinct requests built ahead of time
  uint64_t seed = 1;
  std::string workers_path = "/v1/workers";  // utilisation source; "" or "off": none
  bool quiet = false;  // no live progress
};

// Adds `shoal bench` with its options (each with a flag and a SHOAL_BENCH_*
// environment variable) to `app`; `flags` must outlive parsing. Returns the
// subcommand, so the caller can test ->parsed().
CLI::App* AddBenchCommand(CLI::App* app, BenchCommandFlags* flags);

// Runs the benchmark (blocks for about (warm-up + duration) per load level),
// prints progress to stderr (rewriting one line when it is a terminal) and a
// summary to stdout. Returns the exit code: 0 when results were written,
// 1 when the target could not be used (unreachable, no models, every request
// failed) or the results could not be written, 2 on bad usage.
int RunBenchCommand(const BenchCommandFlags& flags);
// The same, printing to `out` and `err`; `err_is_tty` chooses '\r' progress
// (tests).
int RunBenchCommand(const BenchCommandFlags& flags, std::ostream& out, std::ostream& err, bool err_is_tty);

}  // namespace shoal
