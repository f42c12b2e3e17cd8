// The socket-free parts of `shoal models`: URL path encoding, parsing the
// gateway's /v1/models and action answers, and rendering them as text.
// Pure functions, unit-tested without a gateway; only src/cli uses them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace shoal::cli::internal {

// True for load | unload | pin | unpin.
bool IsModelAction(const std::string& action);
// The usage text printed on bad usage (exit 2).
std::string ModelsUsage();

// Percent-encodes `segment` for one URL path segment: RFC 3986 unreserved
// characters (A-Z a-z 0-9 - . _ ~) stay as they are, every other byte
// becomes %XX (upper-case hex), '/' '%' '?' '#' and spaces included.
std::string EncodePathSegment(std::string_view segment);

// "512 B", "1.5 KiB", "11.8 MiB", "2.0 GiB"; "-" when negative (unknown).
std::string FormatBytes(int64_t bytes);
// "never" when `then_unix_ms` <= 0, "just now" when not in the past, else
// "3s ago", "5m ago", "2h ago", "4d ago".
std::string FormatAgo(int64_t then_unix_ms, int64_t now_unix_ms);

// One worker's view of a model in GET /v1/models.
struct WorkerModelRow {
  std::string worker;
  std::string state;
  bool pinned = false;
  int64_t memory_bytes = -1;       // -1: not reported
  int64_t measured_bytes = 0;      // at its last load there; 0: never loaded or not reported
  int64_t last_used_unix_ms = 0;   // 0: never used
  std::string error;               // set when the state is failed
};

struct ModelRow {
  std::string id;
  std::string state;  // summary over all workers
  std::string error;  // model-level error, if the gateway gives one
  std::vector<WorkerModelRow> workers;
};

// Parses a GET /v1/models body. kBadGateway when it is not JSON or not
// shaped like {"data":[{"id":...}, ...]}; missing optional fields get the
// defaults above.
Result<std::vector<ModelRow>> ParseModelList(std::string_view body);

// A table with one line per (model, worker): MODEL STATE WORKER PINNED
// MEMORY "LAST USED", and an ERROR column when some row has an error. A
// model without workers gets one line with its state and "-" elsewhere.
// With `worker_filter` set, only that worker's lines are shown (models it
// does not have are left out). "(no models)" when there is nothing to show.
std::string RenderModelsTable(const std::vector<ModelRow>& models, int64_t now_unix_ms,
                              const std::string& worker_filter = {});

// The outcome of POST /v1/models/{model}/{action}, one line per worker.
struct ActionSummary {
  std::vector<std::string> lines;  // "loaded m on w1 (ok)", "load m failed on w2: ..."
  int succeeded = 0;
  int failed = 0;
  // unload / unpin found no worker with the model loaded / pinned: done.
  bool nothing_to_do = false;
};

// Parses an action answer ({"results":[{"worker","ok","state"|"error"}]}).
// kBadGateway when it is not shaped like one. `action` and `model` name the
// request, for the lines.
Result<ActionSummary> SummarizeAction(std::string_view body, const std::string& action, const std::string& model);

// 0 when at least one worker answered and every answer is ok, else 1.
int ActionExitCode(const ActionSummary& summary);

// "error: <message> (<code>, HTTP <status>)" from an OpenAI-shaped error
// body; "error: <body text> (HTTP <status>)" when the body is not one.
std::string FormatHttpError(int http_status, std::string_view body);

}  // namespace shoal::cli::internal
