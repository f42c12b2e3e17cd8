// Router: the gateway's HTTP API on Shoal's own request/response structs.
// Validates and transcodes requests (JSON or MessagePack) into EmbedJobs and
// ItemJobs for a WorkSubmitter and renders results in OpenAI (embeddings,
// completions, chat completions, streamed as server-sent events on request),
// Cohere/Jina (rerank) or vLLM (score, classify) shape. Every error
// is JSON {error:{message,type,code}} with the matching HTTP status.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/status.h"
#include "gateway/dispatcher.h"
#include "gateway/fleet_control.h"
#include "gateway/fleet_view.h"
#include "gateway/http.h"

namespace shoal {

struct RouterOptions {
  int max_inputs = 2048;                // inputs per request (OpenAI's limit)
  int64_t default_timeout_ms = 30000;   // deadline when the client sets none
  int64_t max_timeout_ms = 300000;
  int64_t retry_after_s = 1;            // on 429 / 503
  // A request for a model no live worker has loaded waits in the queue
  // while a worker loads it (true), or gets 503 model_loading with
  // Retry-After at once while the load is asked for (false).
  bool wait_for_load = true;
  // The HTTP body limit (the gateway sets it), also held to what a body
  // becomes: the text bytes of a rerank or 1:N score request once its
  // query is paired with each document (over: 413 pairs_too_large), and
  // the JSON text of a MessagePack body for a JSON route (over: 413
  // payload_too_large; escaping makes up to six bytes of one).
  size_t max_body_bytes = size_t{256} << 20;
  Status Validate() const;
};

using FleetSnapshotFn = std::function<std::shared_ptr<const FleetSnapshot>()>;

class Router {
 public:
  // `submitter` and `metrics` must outlive the router. Thread-safe.
  Router(const RouterOptions& options, WorkSubmitter* submitter, FleetSnapshotFn fleet,
         MetricsRegistry* metrics, const Clock* clock = nullptr);
  void Handle(HttpRequest&& request, HttpResponder respond);
  // Enables POST /v1/models/{model}/{load|unload|pin|unpin}; must outlive
  // the router. Without it those routes answer 503.
  void SetModelController(ModelController* control) { control_ = control; }
  // Counts an error answered outside any route (shoal_http_errors_total):
  // what the HTTP server refuses itself, a MessagePack body that does not
  // decode.
  void CountError(std::string_view code) { errors_->Get(code)->Inc(); }

 private:
  void Embeddings(HttpRequest&& req, HttpResponder respond);
  void Encode(const std::string& model, HttpRequest&& req, HttpResponder respond);
  // Cross-encoder and classifier routes (task_routes.cc).
  void Rerank(HttpRequest&& req, HttpResponder respond);
  void Score(HttpRequest&& req, HttpResponder respond);
  void Classify(HttpRequest&& req, HttpResponder respond);
  // POST /v1/ocr/{model} (ocr_routes.cc).
  void Ocr(const std::string& model, HttpRequest&& req, HttpResponder respond);
  // The encoded images of an OCR request in any of its body forms; moves
  // a raw image body out of `req`. Checks count and format magic.
  Status ImagesFromRequest(HttpRequest& req, std::vector<std::string>* images) const;
  // Generators (generate_routes.cc): `endpoint` is "completions" or
  // "chat/completions".
  void Generate(const std::string& endpoint, HttpRequest&& req, HttpResponder respond);
  // Checks job->model (its task must be `task`, see CheckModel) and the
  // request's deadline, and fills job->task and job->deadline_unix_ms.
  Status Admit(const HttpRequest& req, const std::string& task, EmbedJob* job, CatalogModel* entry) const;
  HttpResponse Models(const std::string& only = {}) const;
  HttpResponse Workers() const;
  void ModelAction(const std::string& model, const std::string& action, HttpRequest&& req, HttpResponder respond);
  HttpResponse Ready() const;
  // Deadline from the Shoal-Timeout-Ms header or the default.
  Result<int64_t> Deadline(const HttpRequest& req) const;
  // NotFound for an unknown model, InvalidArgument "wrong_task" when it
  // does another task, 503 "model_loading" in no-wait mode; fills `entry`.
  Status CheckModel(const std::string& model, const std::string& task, CatalogModel* entry) const;
  HttpResponder Instrument(const std::string& route, HttpResponder respond);

  RouterOptions options_;
  WorkSubmitter* submitter_;
  ModelController* control_ = nullptr;
  FleetSnapshotFn fleet_;
  MetricsRegistry* metrics_;
  const Clock* clock_;
  // A route's metrics, looked up once: the latency histogram, and its
  // request counters by status code, each made on first use.
  struct RouteMetrics {
    std::string route;
    Histogram* latency = nullptr;
    std::array<std::atomic<Counter*>, 500> by_status{};  // index: status - 100
    Counter* Requests(MetricsRegistry& metrics, int status);
  };
  std::map<std::string, std::unique_ptr<RouteMetrics>> route_metrics_;  // by route, made once
  // shoal_http_errors_total by error code. A runtime passes on an
  // upstream's own codes, any strings: bounded (see ErrorCodeCounters).
  ErrorCodeCounters* errors_;
};

// The OpenAI-shaped error body and status for `status`; adds Retry-After on
// 429 and 503.
HttpResponse ErrorResponse(const Status& status, int64_t retry_after_s = 1);

}  // namespace shoal
