// Routes for cross-encoders and classifiers: POST /v1/rerank (Cohere/Jina
// shape), POST /v1/score (vLLM shape) and POST /v1/classify (vLLM shape).
// Each becomes one EmbedJob whose result is one row of floats per input: a
// relevance score (task "score") or one probability per label ("classify").
#include <algorithm>
#include <chrono>
#include <numeric>

#include <nlohmann/json.hpp>

#include "common/json_text.h"
#include "gateway/internal/http_json.h"
#include "gateway/routes.h"

namespace shoal {
namespace {

using internal::AppendFloat;
using internal::AppendFloats;
using internal::AppendJsonString;
using internal::JsonResponse;
using internal::ParseJsonObject;
using internal::ResponseId;
using nlohmann::json;

// Common to the three bodies: a JSON object with a non-empty "model" and an
// optional boolean "truncate" (default `truncate_default`).
Status ParseBody(const HttpRequest& req, bool truncate_default, json* body, EmbedJob* job) {
  RETURN_IF_ERROR(ParseJsonObject(req.body, body));
  auto model = body->find("model");
  if (model == body->end() || !model->is_string() || model->get_ref<const std::string&>().empty())
    return InvalidArgument("'model' is required and must be a non-empty string", "invalid_model");
  job->model = model->get<std::string>();
  job->truncate = truncate_default;
  if (auto t = body->find("truncate"); t != body->end() && !t->is_null()) {
    if (!t->is_boolean()) return InvalidArgument("truncate must be a boolean", "invalid_truncate");
    job->truncate = t->get<bool>();
  }
  return Status::Ok();
}

// `field`: a non-empty string or a non-empty array of them, at most `max`.
Status TextList(const json& body, const char* field, int max, std::vector<std::string>* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null())
    return InvalidArgument(std::string("'") + field + "' is required", "missing_input");
  if (it->is_string()) {
    if (it->get_ref<const std::string&>().empty())
      return InvalidArgument(std::string("'") + field + "' must not be an empty string", "empty_input");
    out->push_back(it->get<std::string>());
    return Status::Ok();
  }
  if (it->is_array() && it->empty())
    return InvalidArgument(std::string("'") + field + "' must not be an empty array", "empty_input");
  if (!it->is_array())
    return InvalidArgument(std::string("'") + field + "' must be a string or a non-empty array of strings",
                           "invalid_input");
  if (static_cast<int>(it->size()) > max)
    return InvalidArgument(std::string("too many inputs in '") + field + "': " + std::to_string(it->size()) +
                               " (at most " + std::to_string(max) + " per request)",
                           "too_many_inputs");
  for (size_t i = 0; i < it->size(); ++i) {
    if (!(*it)[i].is_string())
      return InvalidArgument(std::string("'") + field + "'[" + std::to_string(i) + "] must be a string",
                             "invalid_input");
    if ((*it)[i].get_ref<const std::string&>().empty())
      return InvalidArgument(std::string("'") + field + "'[" + std::to_string(i) + "] is an empty string",
                             "empty_input");
    out->push_back((*it)[i].get<std::string>());
  }
  return Status::Ok();
}

// Fills `firsts` with `query` once per entry of `seconds` (the pairs a
// cross-encoder scores), unless the pairs' text would pass `limit` bytes.
Status PairQuery(const std::string& query, const std::vector<std::string>& seconds, size_t limit,
                 std::vector<std::string>* firsts) {
  size_t bytes = 0;
  for (const std::string& s : seconds) bytes += s.size();
  const size_t n = seconds.size();
  if (bytes > limit || query.size() > (limit - bytes) / n)
    return Status(StatusCode::kPayloadTooLarge,
                  "the query (" + std::to_string(query.size()) + " bytes) paired with each of " + std::to_string(n) +
                      " texts comes to more than " + std::to_string(limit) +
                      " bytes; send a shorter query or fewer texts",
                  "pairs_too_large");
  firsts->assign(n, query);
  return Status::Ok();
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Usage(int64_t prompt_tokens) {
  return "\"usage\":{\"prompt_tokens\":" + std::to_string(prompt_tokens) +
         ",\"total_tokens\":" + std::to_string(prompt_tokens) + "}";
}

}  // namespace

Status Router::Admit(const HttpRequest& req, const std::string& task, EmbedJob* job, CatalogModel* entry) const {
  RETURN_IF_ERROR(CheckModel(job->model, task, entry));
  ASSIGN_OR_RETURN(job->deadline_unix_ms, Deadline(req));
  job->task = task;
  job->client = req.client;
  return Status::Ok();
}

void Router::Rerank(HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  json body;
  EmbedJob job;
  // Long documents are the norm here: cut them unless told otherwise.
  if (Status st = ParseBody(req, /*truncate_default=*/true, &body, &job); !st.ok()) return respond(ErrorResponse(st));
  auto query = body.find("query");
  if (query == body.end() || !query->is_string() || query->get_ref<const std::string&>().empty())
    return respond(ErrorResponse(InvalidArgument("'query' is required and must be a non-empty string", "invalid_query")));
  auto docs = body.find("documents");
  if (docs == body.end() || !docs->is_array() || docs->empty())
    return respond(ErrorResponse(InvalidArgument("'documents' must be a non-empty array", "invalid_documents")));
  if (static_cast<int>(docs->size()) > options_.max_inputs)
    return respond(ErrorResponse(InvalidArgument("too many documents: " + std::to_string(docs->size()) +
                                                     " (at most " + std::to_string(options_.max_inputs) + ")",
                                                 "too_many_inputs")));
  for (size_t i = 0; i < docs->size(); ++i) {
    const json& d = (*docs)[i];
    // A string, or an object with a "text" string (Cohere / Jina).
    const json* text = d.is_string() ? &d : nullptr;
    if (d.is_object()) {
      auto t = d.find("text");
      if (t != d.end() && t->is_string()) text = &*t;
    }
    if (text == nullptr)
      return respond(ErrorResponse(InvalidArgument(
          "documents[" + std::to_string(i) + "] must be a string or an object with a 'text' string",
          "invalid_documents")));
    if (text->get_ref<const std::string&>().empty())
      return respond(
          ErrorResponse(InvalidArgument("documents[" + std::to_string(i) + "] is an empty string", "empty_input")));
    job.texts_pair.push_back(text->get<std::string>());
  }
  size_t top_n = job.texts_pair.size();
  if (auto t = body.find("top_n"); t != body.end() && !t->is_null()) {
    const std::optional<uint64_t> n = IntegerAs<uint64_t>(*t);
    if (!n || *n < 1) return respond(ErrorResponse(InvalidArgument("top_n must be a positive integer", "invalid_top_n")));
    top_n = static_cast<size_t>(std::min<uint64_t>(top_n, *n));
  }
  bool return_documents = true;
  if (auto r = body.find("return_documents"); r != body.end() && !r->is_null()) {
    if (!r->is_boolean())
      return respond(ErrorResponse(InvalidArgument("return_documents must be a boolean", "invalid_return_documents")));
    return_documents = r->get<bool>();
  }
  if (Status st = Admit(req, "score", &job, nullptr); !st.ok()) return respond(ErrorResponse(st, retry));
  if (Status st = PairQuery(query->get_ref<const std::string&>(), job.texts_pair, options_.max_body_bytes,
                            &job.texts);
      !st.ok())
    return respond(ErrorResponse(st));
  std::vector<std::string> documents;
  if (return_documents) documents = job.texts_pair;
  std::string model = job.model;
  submitter_->SubmitEmbed(std::move(job), [respond = std::move(respond), model, top_n, retry,
                                           documents = std::move(documents)](Result<EmbedResult> result) {
    if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
    const EmbedResult& r = *result;
    std::vector<int> order(static_cast<size_t>(r.rows));
    std::iota(order.begin(), order.end(), 0);
    // Highest score first; equal scores keep the documents' order.
    auto score = [&](int i) { return r.data[static_cast<size_t>(i) * r.dim]; };
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score(a) > score(b); });
    order.resize(std::min(order.size(), top_n));
    std::string out = "{\"id\":";
    AppendJsonString(out, ResponseId("rerank"));
    out += ",\"model\":";
    AppendJsonString(out, model);
    out += ",\"results\":[";
    for (size_t k = 0; k < order.size(); ++k) {
      const int i = order[k];
      if (k) out.push_back(',');
      out += "{\"index\":" + std::to_string(i) + ",\"relevance_score\":";
      AppendFloat(out, score(i));
      if (!documents.empty()) {
        out += ",\"document\":{\"text\":";
        AppendJsonString(out, documents[i]);
        out.push_back('}');
      }
      out.push_back('}');
    }
    out += "]," + Usage(r.prompt_tokens) + "}";
    respond(JsonResponse(200, std::move(out)));
  });
}

void Router::Score(HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  json body;
  EmbedJob job;
  if (Status st = ParseBody(req, /*truncate_default=*/true, &body, &job); !st.ok()) return respond(ErrorResponse(st));
  std::vector<std::string> first, second;
  Status st = TextList(body, "text_1", options_.max_inputs, &first);
  if (st.ok()) st = TextList(body, "text_2", options_.max_inputs, &second);
  if (!st.ok()) return respond(ErrorResponse(st));
  // 1:1, 1:N (text_1 repeated) or N:N (zipped), as vLLM.
  if (first.size() != 1 && first.size() != second.size()) {
    return respond(ErrorResponse(InvalidArgument(
        "text_1 and text_2 must pair 1:1, 1:N or N:N; got " + std::to_string(first.size()) + ":" +
            std::to_string(second.size()),
        "invalid_input")));
  }
  if (st = Admit(req, "score", &job, nullptr); !st.ok()) return respond(ErrorResponse(st, retry));
  if (first.size() == 1 && second.size() > 1) {
    std::string query = std::move(first.front());
    if (st = PairQuery(query, second, options_.max_body_bytes, &first); !st.ok()) return respond(ErrorResponse(st));
  }
  job.texts = std::move(first);
  job.texts_pair = std::move(second);
  std::string model = job.model;
  submitter_->SubmitEmbed(std::move(job), [respond = std::move(respond), model, retry](Result<EmbedResult> result) {
    if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
    const EmbedResult& r = *result;
    std::string out = "{\"id\":";
    AppendJsonString(out, ResponseId("score"));
    out += ",\"object\":\"list\",\"created\":" + std::to_string(UnixSeconds()) + ",\"model\":";
    AppendJsonString(out, model);
    out += ",\"data\":[";
    for (int i = 0; i < r.rows; ++i) {
      if (i) out.push_back(',');
      out += "{\"index\":" + std::to_string(i) + ",\"object\":\"score\",\"score\":";
      AppendFloat(out, r.data[static_cast<size_t>(i) * r.dim]);
      out.push_back('}');
    }
    out += "]," + Usage(r.prompt_tokens) + "}";
    respond(JsonResponse(200, std::move(out)));
  });
}

void Router::Classify(HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  json body;
  EmbedJob job;
  if (Status st = ParseBody(req, /*truncate_default=*/false, &body, &job); !st.ok()) return respond(ErrorResponse(st));
  if (Status st = TextList(body, "input", options_.max_inputs, &job.texts); !st.ok()) return respond(ErrorResponse(st));
  CatalogModel entry;
  if (Status st = Admit(req, "classify", &job, &entry); !st.ok()) return respond(ErrorResponse(st, retry));
  std::string model = job.model;
  submitter_->SubmitEmbed(std::move(job), [respond = std::move(respond), model, retry,
                                           labels = std::move(entry.labels)](Result<EmbedResult> result) {
    if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
    const EmbedResult& r = *result;
    std::string out = "{\"id\":";
    AppendJsonString(out, ResponseId("classify"));
    out += ",\"object\":\"list\",\"created\":" + std::to_string(UnixSeconds()) + ",\"model\":";
    AppendJsonString(out, model);
    out += ",\"data\":[";
    for (int i = 0; i < r.rows; ++i) {
      const float* probs = r.data.data() + static_cast<size_t>(i) * r.dim;
      const int best = static_cast<int>(std::max_element(probs, probs + r.dim) - probs);
      if (i) out.push_back(',');
      out += "{\"index\":" + std::to_string(i) + ",\"label\":";
      // Unnamed columns are called as Hugging Face names them.
      AppendJsonString(out, best < static_cast<int>(labels.size()) ? labels[best] : "LABEL_" + std::to_string(best));
      out += ",\"probs\":";
      AppendFloats(out, probs, r.dim);
      out += ",\"num_classes\":" + std::to_string(r.dim) + "}";
    }
    out += "]," + Usage(r.prompt_tokens) + "}";
    respond(JsonResponse(200, std::move(out)));
  });
}

}  // namespace shoal
