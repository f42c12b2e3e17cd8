// Routes for generators served by an upstream (runtime "openai"):
// POST /v1/completions and POST /v1/chat/completions, OpenAI-compatible.
// The request document travels to the worker as one MessagePack item with
// "endpoint" added; the answer is the upstream's, with the model name
// rewritten to Shoal's. With "stream": true the answer is server-sent
// events, one per upstream event, then "data: [DONE]".
#include <memory>
#include <mutex>

#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "common/json_text.h"
#include "gateway/internal/http_json.h"
#include "gateway/routes.h"

namespace shoal {
namespace {

using internal::JsonResponse;
using internal::ParseJsonObject;
using nlohmann::json;

// Decodes one MessagePack result document and puts Shoal's model name in.
Result<json> ResultDoc(std::string_view doc, const std::string& model) {
  // Anything on NATS can publish to a reply subject; nlohmann's reader
  // recurses once per level. A worker passes on upstream answers within
  // kMaxAnswerValues, map keys not counted; this walk counts them.
  if (Status bounded = CheckBoundedMsgpack(doc, "the worker's result",
                                           MsgpackBoundsFor(kMaxAnswerValues), /*binary_allowed=*/true);
      !bounded.ok()) {
    return Status(StatusCode::kBadGateway, bounded.message(), "upstream_error");
  }
  json j = json::from_msgpack(doc, true, false);
  if (j.is_discarded() || !j.is_object())
    return Status(StatusCode::kBadGateway, "the worker returned a result that is not a MessagePack map",
                  "upstream_error");
  if (j.contains("model")) j["model"] = model;
  return j;
}

// A reply with other than the one result a generate request has (the
// dispatcher refuses those already; kept so that this route does not index
// past them).
Status NotOneResult(size_t n) {
  return Status(StatusCode::kBadGateway, "expected one result, got " + std::to_string(n), "bad_worker_reply");
}

// One streamed answer: the HTTP response starts with the first event, so an
// error before any output still gets its own status code.
struct SseAnswer {
  std::mutex mu;
  HttpResponder respond;                 // guarded by mu; empty once used
  std::shared_ptr<HttpBodyStream> body;  // guarded by mu; set once started
  // Guarded by mu. Set by Done(): a partial can still come after it (the
  // request answered at its deadline, or the gateway stopping, while the
  // partial was on its way) and is dropped.
  bool finished = false;
  std::string model;
  int64_t retry_after_s = 1;

  // Answers with `r`, once. Requires mu.
  void RespondLocked(HttpResponse r) {
    HttpResponder once = std::move(respond);
    respond = nullptr;
    once(std::move(r));
  }
  // Requires mu.
  void StartLocked() {
    if (body) return;
    body = std::make_shared<HttpBodyStream>();
    HttpResponse r;
    r.content_type = "text/event-stream";
    r.stream = body;
    RespondLocked(std::move(r));
  }
  // Events written so far; guarded by mu. The worker's end marker says
  // how many it sent, so events lost on the way (an event too large to
  // publish, a reply subscription that fell behind) are not ended with
  // [DONE] as if the output were whole.
  int64_t events = 0;

  // False once nobody reads the rest: the client is gone, or the answer
  // has ended (the request may be stopped).
  bool Event(std::string_view chunk) {
    auto ev = ResultDoc(chunk, model);
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return false;
    if (!ev.ok()) {
      FailLocked(ev.status());
      return false;
    }
    StartLocked();
    ++events;
    return body->Write("data: " + DumpJson(*ev) + "\n\n");
  }
  // Ends the answer with `status`: its own response before any event, else
  // an error event in OpenAI's shape and no [DONE]. Requires mu.
  void FailLocked(const Status& status) {
    finished = true;
    if (!body) return RespondLocked(ErrorResponse(status, retry_after_s));
    body->Write("data: " + ErrorResponse(status, retry_after_s).body + "\n\n");
    body->Close();
  }
  void Done(Result<ItemResult> result) {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return;
    if (!result.ok()) return FailLocked(result.status());
    if (result->items.size() != 1) return FailLocked(NotOneResult(result->items.size()));
    auto doc = ResultDoc(result->items[0], model);
    if (!doc.ok()) return FailLocked(doc.status());
    auto object = doc->find("object");
    const bool stream_end = object != doc->end() && object->is_string() && *object == "shoal.stream.end";
    if (!stream_end && !body) {
      // The upstream did not stream: answer its whole response.
      finished = true;
      return RespondLocked(JsonResponse(200, DumpJson(*doc)));
    }
    if (stream_end) {
      auto sent = doc->find("events");
      if (sent != doc->end() && sent->is_number_integer() && sent->get<int64_t>() != events) {
        return FailLocked(Status(StatusCode::kBadGateway,
                                 "the stream lost events on the way: " + std::to_string(events) + " of " +
                                     std::to_string(sent->get<int64_t>()) + " arrived",
                                 "stream_interrupted"));
      }
    }
    finished = true;
    StartLocked();
    body->Write("data: [DONE]\n\n");
    body->Close();
  }
};

}  // namespace

void Router::Generate(const std::string& endpoint, HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  json body;
  if (Status st = ParseJsonObject(req.body, &body); !st.ok()) return respond(ErrorResponse(st));
  auto model_it = body.find("model");
  if (model_it == body.end() || !model_it->is_string() || model_it->get_ref<const std::string&>().empty())
    return respond(ErrorResponse(InvalidArgument("'model' is required and must be a non-empty string", "invalid_model")));
  const std::string model = model_it->get<std::string>();
  if (endpoint == "chat/completions") {
    auto m = body.find("messages");
    if (m == body.end() || !m->is_array() || m->empty())
      return respond(ErrorResponse(InvalidArgument("'messages' must be a non-empty array", "invalid_messages")));
  } else {
    auto p = body.find("prompt");
    if (p == body.end() || !(p->is_string() || p->is_array()))
      return respond(ErrorResponse(InvalidArgument("'prompt' is required (a string or an array)", "invalid_prompt")));
  }
  bool stream = false;
  if (auto s = body.find("stream"); s != body.end() && !s->is_null()) {
    if (!s->is_boolean()) return respond(ErrorResponse(InvalidArgument("stream must be a boolean", "invalid_stream")));
    stream = s->get<bool>();
  }
  if (Status st = CheckModel(model, "generate", nullptr); !st.ok()) return respond(ErrorResponse(st, retry));
  auto deadline = Deadline(req);
  if (!deadline.ok()) return respond(ErrorResponse(deadline.status()));
  body["endpoint"] = endpoint;
  ItemJob job;
  job.task = "generate";
  job.model = model;
  job.deadline_unix_ms = *deadline;
  job.items.emplace_back();
  json::to_msgpack(body, job.items.back());
  // A client that leaves stops its generation (ItemJob::client).
  job.client = req.client;

  if (!stream) {
    submitter_->SubmitItems(std::move(job), [respond = std::move(respond), model, retry](Result<ItemResult> result) {
      if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
      if (result->items.size() != 1) return respond(ErrorResponse(NotOneResult(result->items.size())));
      auto doc = ResultDoc(result->items[0], model);
      if (!doc.ok()) return respond(ErrorResponse(doc.status(), retry));
      respond(JsonResponse(200, DumpJson(*doc)));
    });
    return;
  }
  auto answer = std::make_shared<SseAnswer>();
  answer->respond = std::move(respond);
  answer->model = model;
  answer->retry_after_s = retry;
  submitter_->SubmitItems(
      std::move(job), [answer](Result<ItemResult> result) { answer->Done(std::move(result)); },
      [answer](size_t, std::string_view chunk) { return answer->Event(chunk); });
}

}  // namespace shoal
