// Starting the `shoal` binary's subcommands for end-to-end tests, and the
// checks every such test needs: readiness polling and decoding embedding
// responses (float JSON, base64, MessagePack).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "e2e/http_client.h"
#include "e2e/process.h"

namespace shoal::e2e {

using Vectors = std::vector<std::vector<float>>;

// A started `shoal` process and the HTTP port it announced (0 for a worker).
struct Shoal {
  std::unique_ptr<ChildProcess> process;
  int port = 0;
};

// `shoal serve --data-dir <data_dir> --port 0 --models-dir <models> <extra...>`;
// waits for "Shoal is serving ... at http://127.0.0.1:PORT". Throws on failure.
Shoal StartServe(const std::string& data_dir, const std::vector<std::string>& extra);
// `shoal gateway --nats-url <url> --port 0 <extra...>`; waits for its port.
Shoal StartGateway(const std::string& nats_url, const std::vector<std::string>& extra = {});
// `shoal worker --nats-url <url> --models-dir <models> --models tiny-bert
// <extra...>`; waits for "shoal worker <id> ready".
Shoal StartWorker(const std::string& nats_url, const std::vector<std::string>& extra = {});

// `shoal worker --nats-url <url> --models-dir <repository> <extra...>`
// (every model of the repository is in its catalog).
Shoal StartFleetWorker(const std::string& nats_url, const std::string& repository,
                       const std::vector<std::string>& extra = {});

// Runs `shoal <args...>` to completion (up to `timeout`); its exit code
// (-1 when it did not exit normally) and stdout.
struct CliRun {
  int exit_code = -1;
  std::string out;
};
CliRun RunShoal(const std::vector<std::string>& args,
                std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

// Polls GET /readyz until it answers `want_status` (200 or 503) or `timeout`
// passes. Returns the last status seen.
int WaitForReadyz(int port, int want_status, std::chrono::milliseconds timeout);

// Decodes a base64 string of float32 little-endian values.
std::vector<float> DecodeBase64Floats(const std::string& b64);
double L2Norm(const std::vector<float>& v);
// Largest absolute component difference (infinity when sizes differ).
double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b);

// An OpenAI /v1/embeddings body, float or base64 rows, in `index` order.
struct OpenAiEmbeddings {
  Vectors rows;
  std::vector<int64_t> indices;  // as sent, in array order
  std::string model;
  int64_t prompt_tokens = 0;
  int64_t total_tokens = 0;
};
// Throws std::runtime_error on a malformed body.
OpenAiEmbeddings ParseOpenAiEmbeddings(const std::string& body);

// POST /v1/embeddings with {"model": model, "input": texts}; expects 200
// (throws otherwise) and returns the rows.
OpenAiEmbeddings EmbedOrThrow(int port, const std::string& model, const std::vector<std::string>& texts,
                              std::chrono::milliseconds timeout = std::chrono::milliseconds(30000));

// The error.code of a JSON error body, or "" when there is none.
std::string ErrorCode(const std::string& body);

}  // namespace shoal::e2e
