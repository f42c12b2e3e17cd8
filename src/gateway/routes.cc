#include "gateway/routes.h"

#include <charconv>
#include <cmath>
#include <cstring>

#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "common/json_text.h"
#include "common/log.h"
#include "gateway/internal/http_json.h"

namespace shoal {
namespace {

using nlohmann::json;
using internal::AppendFloats;
using internal::AppendJsonString;
using internal::JsonResponse;
using internal::ParseJsonObject;


void AppendBase64(std::string& out, const unsigned char* data, size_t len) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  size_t i = 0;
  for (; i + 2 < len; i += 3) {
    uint32_t v = (data[i] << 16) | (data[i + 1] << 8) | data[i + 2];
    out.push_back(k[v >> 18]);
    out.push_back(k[(v >> 12) & 63]);
    out.push_back(k[(v >> 6) & 63]);
    out.push_back(k[v & 63]);
  }
  if (i + 1 == len) {
    uint32_t v = data[i] << 16;
    out.push_back(k[v >> 18]);
    out.push_back(k[(v >> 12) & 63]);
    out += "==";
  } else if (i + 2 == len) {
    uint32_t v = (data[i] << 16) | (data[i + 1] << 8);
    out.push_back(k[v >> 18]);
    out.push_back(k[(v >> 12) & 63]);
    out.push_back(k[(v >> 6) & 63]);
    out.push_back('=');
  }
}

// Decodes %XX escapes; false on a malformed escape.
bool PercentDecode(const std::string& in, std::string* out) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    if (i + 2 >= in.size()) return false;
    const int hi = hex(in[i + 1]), lo = hex(in[i + 2]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return true;
}

// Fills job->texts or job->token_ids from an OpenAI-style `input` value:
// string | [string] | [int] | [[int]].
Status InputsFromJson(const json& input, int max_inputs, EmbedJob* job) {
  auto token_row = [](const json& arr, size_t idx, std::vector<int32_t>* row) -> Status {
    if (arr.empty()) return InvalidArgument("input[" + std::to_string(idx) + "] is an empty token array", "empty_input");
    row->reserve(arr.size());
    for (const auto& t : arr) {
      if (!t.is_number_integer()) return InvalidArgument("token arrays must hold integers", "invalid_input");
      // Unsigned values past INT64_MAX (JSON, or a MessagePack uint64) must
      // not wrap into range.
      const std::optional<int32_t> id = IntegerAs<int32_t>(t);
      if (!id || *id < 0) return InvalidArgument("token id " + t.dump() + " is out of range", "invalid_token_id");
      row->push_back(*id);
    }
    return Status::Ok();
  };
  if (input.is_string()) {
    if (input.get_ref<const std::string&>().empty()) return InvalidArgument("input must not be an empty string", "empty_input");
    job->texts.push_back(input.get<std::string>());
    return Status::Ok();
  }
  if (!input.is_array())
    return InvalidArgument("input must be a string, an array of strings, or token arrays", "invalid_input");
  if (input.empty()) return InvalidArgument("input must not be an empty array", "empty_input");
  if (input[0].is_number_integer()) {  // one pre-tokenized input
    std::vector<int32_t> row;
    RETURN_IF_ERROR(token_row(input, 0, &row));
    job->token_ids.push_back(std::move(row));
    return Status::Ok();
  }
  if (static_cast<int>(input.size()) > max_inputs)
    return InvalidArgument("too many inputs: " + std::to_string(input.size()) + " (at most " +
                               std::to_string(max_inputs) + " per request)",
                           "too_many_inputs");
  const bool strings = input[0].is_string();
  for (size_t i = 0; i < input.size(); ++i) {
    const auto& item = input[i];
    if (strings) {
      if (!item.is_string())
        return InvalidArgument("input[" + std::to_string(i) + "] must be a string like the others", "invalid_input");
      if (item.get_ref<const std::string&>().empty())
        return InvalidArgument("input[" + std::to_string(i) + "] is an empty string", "empty_input");
      job->texts.push_back(item.get<std::string>());
    } else if (item.is_array()) {
      std::vector<int32_t> row;
      RETURN_IF_ERROR(token_row(item, i, &row));
      job->token_ids.push_back(std::move(row));
    } else {
      return InvalidArgument("input[" + std::to_string(i) + "] must be a string or an array of token ids",
                             "invalid_input");
    }
  }
  return Status::Ok();
}

// The same, from a MessagePack value.
Status InputsFromMsgpack(const msgpack::object& input, int max_inputs, EmbedJob* job) {
  if (input.type == msgpack::type::STR) {
    if (input.via.str.size == 0) return InvalidArgument("inputs must not be an empty string", "empty_input");
    job->texts.emplace_back(input.via.str.ptr, input.via.str.size);
    return Status::Ok();
  }
  if (input.type != msgpack::type::ARRAY)
    return InvalidArgument("inputs must be a string, an array of strings, or token arrays", "invalid_input");
  const auto& arr = input.via.array;
  if (arr.size == 0) return InvalidArgument("inputs must not be an empty array", "empty_input");
  const auto token_row = [](const msgpack::object& ids, std::vector<int32_t>* row) -> Status {
    for (uint32_t k = 0; k < ids.via.array.size; ++k) {
      const auto& t = ids.via.array.ptr[k];
      if (t.type != msgpack::type::POSITIVE_INTEGER || t.via.u64 > INT32_MAX)
        return InvalidArgument("token ids must be non-negative 32-bit integers", "invalid_token_id");
      row->push_back(static_cast<int32_t>(t.via.u64));
    }
    return Status::Ok();
  };
  if (arr.ptr[0].type == msgpack::type::POSITIVE_INTEGER || arr.ptr[0].type == msgpack::type::NEGATIVE_INTEGER) {
    // One pre-tokenized input, as in JSON.
    std::vector<int32_t> row;
    RETURN_IF_ERROR(token_row(input, &row));
    job->token_ids.push_back(std::move(row));
    return Status::Ok();
  }
  if (static_cast<int>(arr.size) > max_inputs)
    return InvalidArgument("too many inputs: " + std::to_string(arr.size) + " (at most " +
                               std::to_string(max_inputs) + " per request)",
                           "too_many_inputs");
  for (uint32_t i = 0; i < arr.size; ++i) {
    const auto& item = arr.ptr[i];
    if (item.type == msgpack::type::STR) {
      if (!job->token_ids.empty()) return InvalidArgument("inputs mix strings and token arrays", "invalid_input");
      if (item.via.str.size == 0)
        return InvalidArgument("inputs[" + std::to_string(i) + "] is an empty string", "empty_input");
      job->texts.emplace_back(item.via.str.ptr, item.via.str.size);
    } else if (item.type == msgpack::type::ARRAY) {
      if (!job->texts.empty()) return InvalidArgument("inputs mix strings and token arrays", "invalid_input");
      if (item.via.array.size == 0)
        return InvalidArgument("inputs[" + std::to_string(i) + "] is an empty token array", "empty_input");
      std::vector<int32_t> row;
      RETURN_IF_ERROR(token_row(item, &row));
      job->token_ids.push_back(std::move(row));
    } else {
      return InvalidArgument("inputs[" + std::to_string(i) + "] must be a string or an array of token ids",
                             "invalid_input");
    }
  }
  return Status::Ok();
}

// Keeps the first `dims` components of every row, re-normalised when the
// model normalises (Matryoshka-style shortening, as OpenAI's `dimensions`).
void Shorten(EmbedResult* r, int dims, bool normalize) {
  if (dims <= 0 || dims >= r->dim) return;
  std::vector<float> out(static_cast<size_t>(r->rows) * dims);
  for (int i = 0; i < r->rows; ++i) {
    const float* src = r->data.data() + static_cast<size_t>(i) * r->dim;
    float* dst = out.data() + static_cast<size_t>(i) * dims;
    double norm = 0;
    for (int k = 0; k < dims; ++k) {
      dst[k] = src[k];
      norm += static_cast<double>(src[k]) * src[k];
    }
    if (normalize && norm > 0) {
      const float inv = static_cast<float>(1.0 / std::sqrt(norm));
      for (int k = 0; k < dims; ++k) dst[k] *= inv;
    }
  }
  r->data = std::move(out);
  r->dim = dims;
}

// Routes that read and write MessagePack natively (binary fields); every
// other route gets the generic transcoding in Router::Handle.
bool NativeMsgpackRoute(std::string_view path) {
  for (std::string_view prefix : {"/v1/encode/", "/v1/ocr/"})
    if (path.substr(0, prefix.size()) == prefix) return true;
  return false;
}

// DumpJson(j) into *out while it fits `max_bytes`; returns the length of
// the whole text (more than `max_bytes`: *out is incomplete). The same
// serializer as DumpJson, writing into a bounded string, so a body is
// serialized once and never past the limit; but a string that is not
// well-formed UTF-8 throws json::type_error (316), as a JSON body with one
// is refused.
size_t DumpJsonWithin(const json& j, size_t max_bytes, std::string* out) {
  struct Bounded final : nlohmann::detail::output_adapter_protocol<char> {
    Bounded(std::string* out, size_t max) : out(out), max(max) {}
    std::string* out;
    size_t max;
    size_t n = 0;
    void write_character(char c) override { write_characters(&c, 1); }
    void write_characters(const char* s, std::size_t length) override {
      if (n + length <= max) out->append(s, length);
      n += length;
    }
  };
  out->clear();
  auto bounded = std::make_shared<Bounded>(out, max_bytes);
  nlohmann::detail::serializer<json> serializer(bounded, ' ', json::error_handler_t::strict);
  serializer.dump(j, /*pretty_print=*/false, /*ensure_ascii=*/false, /*indent_step=*/0);
  return bounded->n;
}

// A MessagePack request body for a JSON route, as JSON text: the handlers
// parse one format. Binary fields have no JSON form: refused before the
// body is decoded. A body whose text would pass `max_bytes` is refused,
// and no more than that is ever written.
Status MsgpackBodyToJson(std::string* body, size_t max_bytes) {
  RETURN_IF_ERROR(internal::CheckMsgpackBody(*body, /*binary_allowed=*/false));
  json j = json::from_msgpack(*body, /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return InvalidArgument("request body is not valid MessagePack", "invalid_msgpack");
  if (!j.is_object()) return InvalidArgument("request body must be a MessagePack map", "invalid_msgpack");
  std::string text;
  size_t text_bytes = 0;
  try {
    text_bytes = DumpJsonWithin(j, max_bytes, &text);
  } catch (const json::type_error&) {
    return InvalidArgument("a string in the request body is not well-formed UTF-8 (send bytes as bin where a field "
                           "takes them)",
                           "invalid_msgpack");
  }
  if (text_bytes > max_bytes) {
    return Status(StatusCode::kPayloadTooLarge,
                  "request body would take " + std::to_string(text_bytes) + " bytes as JSON text, more than " +
                      std::to_string(max_bytes) + " (a control character in a string takes up to 6)",
                  "payload_too_large");
  }
  *body = std::move(text);
  return Status::Ok();
}

// The OpenAI embeddings shape in MessagePack, each embedding a bin of
// little-endian float32 (whatever encoding_format says).
HttpResponse EmbeddingsMsgpack(const EmbedResult& r, const std::string& model) {
  msgpack::sbuffer buf(static_cast<size_t>(r.rows) * (r.dim * 4 + 40) + 128);
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(4);
  pk.pack(std::string("object"));
  pk.pack(std::string("list"));
  pk.pack(std::string("data"));
  pk.pack_array(static_cast<uint32_t>(r.rows));
  const uint32_t row_bytes = static_cast<uint32_t>(r.dim * sizeof(float));
  for (int i = 0; i < r.rows; ++i) {
    pk.pack_map(3);
    pk.pack(std::string("object"));
    pk.pack(std::string("embedding"));
    pk.pack(std::string("index"));
    pk.pack(i);
    pk.pack(std::string("embedding"));
    pk.pack_bin(row_bytes);
    pk.pack_bin_body(reinterpret_cast<const char*>(r.data.data() + static_cast<size_t>(i) * r.dim), row_bytes);
  }
  pk.pack(std::string("model"));
  pk.pack(model);
  pk.pack(std::string("usage"));
  pk.pack_map(2);
  pk.pack(std::string("prompt_tokens"));
  pk.pack(r.prompt_tokens);
  pk.pack(std::string("total_tokens"));
  pk.pack(r.prompt_tokens);
  HttpResponse out;
  out.content_type = "application/msgpack";
  out.body.assign(buf.data(), buf.size());
  return out;
}

// Answers a caller that asked for MessagePack in MessagePack: JSON bodies
// (results and errors) are transcoded; others pass as they are.
HttpResponder MsgpackResponder(HttpResponder respond) {
  return [respond = std::move(respond)](HttpResponse r) {
    if (r.content_type.rfind("application/json", 0) == 0) {
      json j = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded()) {
        std::vector<uint8_t> packed = json::to_msgpack(j);
        r.body.assign(packed.begin(), packed.end());
        r.content_type = "application/msgpack";
      }
    }
    respond(std::move(r));
  };
}

}  // namespace

Status RouterOptions::Validate() const {
  // Named as the flags that set them, which is where a user meets them.
  if (max_inputs < 1) return InvalidArgument("--max-inputs (max_inputs) must be >= 1");
  if (max_body_bytes < 1) return InvalidArgument("--max-body-bytes (max_body_bytes) must be >= 1");
  if (default_timeout_ms < 1 || default_timeout_ms > max_timeout_ms)
    return InvalidArgument("--request-timeout-ms (default_timeout_ms) must be 1 to " + std::to_string(max_timeout_ms) +
                           ", not " + std::to_string(default_timeout_ms));
  return Status::Ok();
}

HttpResponse ErrorResponse(const Status& status, int64_t retry_after_s) {
  HttpResponse r;
  r.status = HttpStatusFor(status.code());
  std::string body = "{\"error\":{\"message\":";
  AppendJsonString(body, status.message());
  body += ",\"type\":";
  AppendJsonString(body, ErrorTypeFor(status.code()));
  body += ",\"param\":null,\"code\":";
  AppendJsonString(body, status.ReasonOrDefault());
  body += "}}";
  r.body = std::move(body);
  r.error_code = status.ReasonOrDefault();
  if (r.status == 429 || r.status == 503) r.headers.emplace_back("Retry-After", std::to_string(retry_after_s));
  return r;
}

Router::Router(const RouterOptions& options, WorkSubmitter* submitter, FleetSnapshotFn fleet,
               MetricsRegistry* metrics, const Clock* clock)
    : options_(options), submitter_(submitter), fleet_(std::move(fleet)), metrics_(metrics),
      clock_(clock ? clock : SystemClock::Get()),
      errors_(metrics->GetErrorCodeCounters("shoal_http_errors_total", "HTTP error responses by error code.")) {
  for (const char* route : {"/v1/embeddings", "/v1/encode", "/v1/rerank", "/v1/score", "/v1/classify",
                            "/v1/ocr", "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
                            "/v1/workers"}) {
    auto m = std::make_unique<RouteMetrics>();
    m->route = route;
    m->latency = metrics_->GetHistogram("shoal_http_request_seconds", "HTTP request latency by route.",
                                        {{"route", route}}, LatencyBuckets());
    route_metrics_[route] = std::move(m);
  }
}

Counter* Router::RouteMetrics::Requests(MetricsRegistry& metrics, int status) {
  auto make = [&] {
    return metrics.GetCounter("shoal_http_requests_total", "HTTP requests by route and status.",
                              {{"route", route}, {"code", std::to_string(status)}});
  };
  if (status < 100 || status >= 600) return make();
  std::atomic<Counter*>& slot = by_status[static_cast<size_t>(status - 100)];
  Counter* c = slot.load(std::memory_order_acquire);
  if (c == nullptr) {
    c = make();  // the registry returns the same counter to every caller
    slot.store(c, std::memory_order_release);
  }
  return c;
}

HttpResponder Router::Instrument(const std::string& route, HttpResponder respond) {
  const int64_t start = clock_->NowMonoUs();
  RouteMetrics* m = route_metrics_.at(route).get();
  return [this, start, m, respond = std::move(respond)](HttpResponse r) {
    m->latency->Observe(static_cast<double>(clock_->NowMonoUs() - start) / 1e6);
    m->Requests(*metrics_, r.status)->Inc();
    if (r.status >= 400) errors_->Get(r.error_code.empty() ? std::string_view("unknown") : r.error_code)->Inc();
    respond(std::move(r));
  };
}

void Router::Handle(HttpRequest&& req, HttpResponder respond) {
  const std::string& path = req.path;
  if (internal::AcceptsMsgpack(req.Header("accept"))) respond = MsgpackResponder(std::move(respond));
  if (!NativeMsgpackRoute(path) && internal::IsMsgpackType(req.Header("content-type"))) {
    // An empty body is no MessagePack map; model actions take none.
    Status st = !req.body.empty() ? MsgpackBodyToJson(&req.body, options_.max_body_bytes)
                : req.method == "POST" && path.rfind("/v1/models", 0) != 0
                    ? InvalidArgument("the body is empty; a MessagePack map was expected", "invalid_msgpack")
                    : Status::Ok();
    if (!st.ok()) {
      CountError(st.ReasonOrDefault());  // before any route's Instrument
      return respond(ErrorResponse(st));
    }
  }
  auto method_is = [&](const char* m) { return req.method == m; };
  // HEAD is GET without the body (the server drops it).
  const bool get = req.method == "GET" || req.method == "HEAD";
  auto not_allowed = [&](const char* allowed) {
    auto r = ErrorResponse(Status(StatusCode::kMethodNotAllowed, req.method + " is not allowed on " + path));
    r.headers.emplace_back("Allow", allowed);
    return r;
  };
  if (path == "/v1/embeddings") {
    auto done = Instrument("/v1/embeddings", std::move(respond));
    if (!method_is("POST")) return done(not_allowed("POST"));
    return Embeddings(std::move(req), std::move(done));
  }
  for (const auto& [route, handler] : {std::pair<const char*, void (Router::*)(HttpRequest&&, HttpResponder)>{
                                           "/v1/rerank", &Router::Rerank},
                                       {"/v1/score", &Router::Score},
                                       {"/v1/classify", &Router::Classify}}) {
    if (path != route) continue;
    auto done = Instrument(route, std::move(respond));
    if (!method_is("POST")) return done(not_allowed("POST"));
    return (this->*handler)(std::move(req), std::move(done));
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    auto done = Instrument(path, std::move(respond));
    if (!method_is("POST")) return done(not_allowed("POST"));
    return Generate(path.substr(4), std::move(req), std::move(done));
  }
  static const std::string kEncode = "/v1/encode/";
  if (path.compare(0, kEncode.size(), kEncode) == 0) {
    auto done = Instrument("/v1/encode", std::move(respond));
    if (!method_is("POST")) return done(not_allowed("POST"));
    std::string model;
    if (!PercentDecode(path.substr(kEncode.size()), &model) || model.empty())
      return done(ErrorResponse(InvalidArgument("missing or bad model in path /v1/encode/{model}", "invalid_model")));
    return Encode(model, std::move(req), std::move(done));
  }
  static const std::string kOcr = "/v1/ocr/";
  if (path.compare(0, kOcr.size(), kOcr) == 0) {
    auto done = Instrument("/v1/ocr", std::move(respond));
    if (!method_is("POST")) return done(not_allowed("POST"));
    std::string model;
    if (!PercentDecode(path.substr(kOcr.size()), &model) || model.empty())
      return done(ErrorResponse(InvalidArgument("missing or bad model in path /v1/ocr/{model}", "invalid_model")));
    return Ocr(model, std::move(req), std::move(done));
  }
  if (path == "/v1/models") {
    auto done = Instrument("/v1/models", std::move(respond));
    if (!get) return done(not_allowed("GET, HEAD"));
    return done(Models());
  }
  if (path == "/v1/workers") {
    auto done = Instrument("/v1/workers", std::move(respond));
    if (!get) return done(not_allowed("GET, HEAD"));
    return done(Workers());
  }
  static const std::string kModels = "/v1/models/";
  if (path.compare(0, kModels.size(), kModels) == 0) {
    // /v1/models/{model} (GET) or /v1/models/{model}/{action} (POST); the
    // model name is percent-encoded and may itself hold '/'.
    auto done = Instrument("/v1/models/{model}", std::move(respond));
    const std::string rest = path.substr(kModels.size());
    const size_t slash = rest.rfind('/');
    std::string action = slash == std::string::npos ? "" : rest.substr(slash + 1);
    const bool is_action = action == "load" || action == "unload" || action == "pin" || action == "unpin";
    std::string model;
    if (!PercentDecode(is_action ? rest.substr(0, slash) : rest, &model) || model.empty()) {
      return done(ErrorResponse(InvalidArgument("bad model name in path " + path, "invalid_model")));
    }
    if (!is_action) {
      // POST /v1/models/m/reload: a mistyped action, not a model "m/reload".
      if (method_is("POST") && slash != std::string::npos)
        return done(ErrorResponse(NotFound("no model action '" + action + "' (POST /v1/models/{model}/load, "
                                           "/unload, /pin or /unpin)",
                                           "route_not_found")));
      if (!get) return done(not_allowed("GET, HEAD"));
      return done(Models(model));
    }
    if (!method_is("POST")) return done(not_allowed("POST"));
    return ModelAction(model, action, std::move(req), std::move(done));
  }
  if (path == "/healthz") {
    if (!get) return respond(not_allowed("GET, HEAD"));
    return respond(JsonResponse(200, "{\"status\":\"ok\"}"));
  }
  if (path == "/readyz") {
    if (!get) return respond(not_allowed("GET, HEAD"));
    return respond(Ready());
  }
  if (path == "/metrics") {
    if (!get) return respond(not_allowed("GET, HEAD"));
    HttpResponse r;
    r.content_type = "text/plain; version=0.0.4";
    r.body = metrics_->Render();
    return respond(std::move(r));
  }
  respond(ErrorResponse(NotFound("no route for " + req.method + " " + path, "route_not_found")));
}

Result<int64_t> Router::Deadline(const HttpRequest& req) const {
  int64_t timeout = options_.default_timeout_ms;
  // Present, even empty, it must be one valid value: a header given twice
  // (a proxy's and the client's, say) is refused, not read as either.
  int given = 0;
  std::string_view h;
  for (const auto& [name, value] : req.headers) {
    if (name != "shoal-timeout-ms") continue;
    ++given;
    h = value;
  }
  if (given > 1)
    return InvalidArgument("Shoal-Timeout-Ms is given " + std::to_string(given) + " times; give it once",
                           "invalid_timeout");
  if (given == 1) {
    int64_t v = 0;
    auto [p, ec] = std::from_chars(h.data(), h.data() + h.size(), v);
    if (ec != std::errc() || p != h.data() + h.size() || v < 1 || v > options_.max_timeout_ms)
      return InvalidArgument(
          "Shoal-Timeout-Ms must be an integer in [1, " + std::to_string(options_.max_timeout_ms) + "]",
          "invalid_timeout");
    timeout = v;
  }
  return clock_->NowUnixMs() + timeout;
}

Status Router::CheckModel(const std::string& model, const std::string& task, CatalogModel* entry) const {
  auto snap = fleet_();
  auto it = snap->models.find(model);
  if (it == snap->models.end())
    return NotFound("The model '" + model + "' does not exist", "model_not_found");
  if (it->second.task != task) {
    static const std::map<std::string, std::string> kRoute = {
        {"embed", "/v1/embeddings or /v1/encode/{model}"}, {"score", "/v1/rerank or /v1/score"},
        {"classify", "/v1/classify"}, {"ocr", "/v1/ocr/{model}"},
        {"generate", "/v1/completions or /v1/chat/completions"}};
    auto route = kRoute.find(it->second.task);
    return InvalidArgument("model '" + model + "' does task '" + it->second.task + "', not '" + task + "'" +
                               (route == kRoute.end() ? "" : "; use " + route->second),
                           "wrong_task");
  }
  if (entry) *entry = it->second;
  if (!options_.wait_for_load && !snap->AnyWorker(model, "loaded")) {
    // Disconnected, no worker is known: the queue cannot be reached, and a
    // load hint would only wait in the client's reconnect buffer.
    if (!snap->nats_connected)
      return Unavailable("the work queue cannot be reached (NATS is disconnected); retry later", "queue_unavailable");
    submitter_->RequestLoad(model);  // also for a worker yet to come, or a failed load's retry time
    // Whether a load can be under way: not when no live worker serves the
    // model, nor when every one that does has failed to load it.
    const WorkerModel* failed = nullptr;
    bool serving = false, all_failed = true;
    for (const WorkerInfo& w : snap->workers) {
      auto m = w.models.find(model);
      if (m == w.models.end()) continue;
      serving = true;
      if (m->second.state != "failed") all_failed = false;
      else if (failed == nullptr) failed = &m->second;
    }
    if (!serving)
      return Unavailable("no live worker serves model '" + model + "'; retry later", "no_worker");
    if (all_failed) {
      return Status(StatusCode::kBadGateway,
                    "model '" + model + "' could not be loaded" + (failed->error.empty() ? "" : ": " + failed->error),
                    "model_load_failed");
    }
    return Unavailable("model '" + model + "' is not loaded yet; it is being loaded, retry later", "model_loading");
  }
  return Status::Ok();
}

void Router::Embeddings(HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  json body;
  if (Status st = ParseJsonObject(req.body, &body); !st.ok()) return respond(ErrorResponse(st));
  EmbedJob job;
  auto model_it = body.find("model");
  if (model_it == body.end() || !model_it->is_string() || model_it->get_ref<const std::string&>().empty())
    return respond(ErrorResponse(InvalidArgument("'model' is required and must be a non-empty string", "invalid_model")));
  job.model = model_it->get<std::string>();
  auto input_it = body.find("input");
  if (input_it == body.end()) return respond(ErrorResponse(InvalidArgument("'input' is required", "missing_input")));
  bool base64 = false;
  if (auto f = body.find("encoding_format"); f != body.end() && !f->is_null()) {
    if (!f->is_string() || (*f != "float" && *f != "base64"))
      return respond(ErrorResponse(InvalidArgument("encoding_format must be 'float' or 'base64'", "invalid_encoding_format")));
    base64 = *f == "base64";
  }
  int dims = 0;
  if (auto d = body.find("dimensions"); d != body.end() && !d->is_null()) {
    if (!d->is_number_integer() || d->get<int64_t>() < 1)
      return respond(ErrorResponse(InvalidArgument("dimensions must be a positive integer", "invalid_dimensions")));
    dims = static_cast<int>(std::min<int64_t>(d->get<int64_t>(), INT32_MAX));
  }
  if (auto t = body.find("truncate"); t != body.end() && !t->is_null()) {
    if (!t->is_boolean()) return respond(ErrorResponse(InvalidArgument("truncate must be a boolean", "invalid_truncate")));
    job.truncate = t->get<bool>();
  }
  Status st = InputsFromJson(*input_it, options_.max_inputs, &job);
  if (!st.ok()) return respond(ErrorResponse(st));
  CatalogModel entry;
  st = CheckModel(job.model, "embed", &entry);
  if (!st.ok()) return respond(ErrorResponse(st, retry));
  const int model_dim = entry.dim;
  const auto too_wide = [dims](int dim) {
    return ErrorResponse(
        InvalidArgument("dimensions " + std::to_string(dims) + " exceeds the model's " + std::to_string(dim),
                        "invalid_dimensions"));
  };
  if (dims > 0 && model_dim > 0 && dims > model_dim) return respond(too_wide(model_dim));
  auto deadline = Deadline(req);
  if (!deadline.ok()) return respond(ErrorResponse(deadline.status()));
  job.deadline_unix_ms = *deadline;
  job.client = req.client;
  const bool normalize = entry.normalize;
  const bool want_msgpack = internal::AcceptsMsgpack(req.Header("accept"));
  std::string model = job.model;
  submitter_->SubmitEmbed(std::move(job), [respond = std::move(respond), model, base64, dims, normalize,
                                           want_msgpack, retry, too_wide](Result<EmbedResult> result) {
    if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
    EmbedResult& r = *result;
    // The model's width was not known before its first load (a config
    // with dim 0): the same 400 as when it is.
    if (dims > r.dim) return respond(too_wide(r.dim));
    Shorten(&r, dims, normalize);
    if (want_msgpack) return respond(EmbeddingsMsgpack(r, model));
    std::string out;
    out.reserve(static_cast<size_t>(r.rows) * (base64 ? r.dim * 4 / 3 + 64 : r.dim * 12 + 64) + 128);
    out += "{\"object\":\"list\",\"data\":[";
    for (int i = 0; i < r.rows; ++i) {
      if (i) out.push_back(',');
      out += "{\"object\":\"embedding\",\"index\":" + std::to_string(i) + ",\"embedding\":";
      const float* row = r.data.data() + static_cast<size_t>(i) * r.dim;
      if (base64) {
        out.push_back('"');
        AppendBase64(out, reinterpret_cast<const unsigned char*>(row), static_cast<size_t>(r.dim) * sizeof(float));
        out.push_back('"');
      } else {
        AppendFloats(out, row, r.dim);
      }
      out.push_back('}');
    }
    out += "],\"model\":";
    AppendJsonString(out, model);
    out += ",\"usage\":{\"prompt_tokens\":" + std::to_string(r.prompt_tokens) +
           ",\"total_tokens\":" + std::to_string(r.prompt_tokens) + "}}";
    respond(JsonResponse(200, std::move(out)));
  });
}

void Router::Encode(const std::string& model, HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  EmbedJob job;
  job.model = model;
  if (internal::IsMsgpackType(req.Header("content-type"))) {
    if (Status st = internal::CheckMsgpackBody(req.body, /*binary_allowed=*/true); !st.ok()) return respond(ErrorResponse(st));
    msgpack::object_handle handle;
    try {
      handle = msgpack::unpack(req.body.data(), req.body.size());
    } catch (const std::exception& e) {
      return respond(ErrorResponse(InvalidArgument(std::string("request body is not valid MessagePack: ") + e.what(),
                                                   "invalid_msgpack")));
    }
    const auto& root = handle.get();
    if (root.type != msgpack::type::MAP)
      return respond(ErrorResponse(InvalidArgument("request body must be a MessagePack map", "invalid_msgpack")));
    const msgpack::object* inputs = nullptr;
    for (uint32_t i = 0; i < root.via.map.size; ++i) {
      const auto& kv = root.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) continue;
      std::string_view k(kv.key.via.str.ptr, kv.key.via.str.size);
      if (k == "inputs") inputs = &kv.val;
      if (k == "truncate" && kv.val.type != msgpack::type::NIL) {  // nil: the default, as JSON's null
        if (kv.val.type != msgpack::type::BOOLEAN)
          return respond(ErrorResponse(InvalidArgument("truncate must be a boolean", "invalid_truncate")));
        job.truncate = kv.val.via.boolean;
      }
    }
    if (!inputs) return respond(ErrorResponse(InvalidArgument("'inputs' is required", "missing_input")));
    Status st = InputsFromMsgpack(*inputs, options_.max_inputs, &job);
    if (!st.ok()) return respond(ErrorResponse(st));
  } else {
    json body;
    if (Status st = ParseJsonObject(req.body, &body); !st.ok()) return respond(ErrorResponse(st));
    auto in = body.find("inputs");
    if (in == body.end()) return respond(ErrorResponse(InvalidArgument("'inputs' is required", "missing_input")));
    if (auto t = body.find("truncate"); t != body.end() && !t->is_null()) {
      if (!t->is_boolean()) return respond(ErrorResponse(InvalidArgument("truncate must be a boolean", "invalid_truncate")));
      job.truncate = t->get<bool>();
    }
    Status st = InputsFromJson(*in, options_.max_inputs, &job);
    if (!st.ok()) return respond(ErrorResponse(st));
  }
  Status st = CheckModel(model, "embed", nullptr);
  if (!st.ok()) return respond(ErrorResponse(st, options_.retry_after_s));
  auto deadline = Deadline(req);
  if (!deadline.ok()) return respond(ErrorResponse(deadline.status()));
  job.deadline_unix_ms = *deadline;
  job.client = req.client;
  const bool want_msgpack = internal::AcceptsMsgpack(req.Header("accept"));
  submitter_->SubmitEmbed(std::move(job), [respond = std::move(respond), model, want_msgpack,
                                           retry](Result<EmbedResult> result) {
    if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
    const EmbedResult& r = *result;
    HttpResponse out;
    if (want_msgpack) {
      msgpack::sbuffer buf(static_cast<size_t>(r.rows) * r.dim * 4 + 128);
      msgpack::packer<msgpack::sbuffer> pk(buf);
      pk.pack_map(5);
      pk.pack(std::string("model"));
      pk.pack(model);
      pk.pack(std::string("rows"));
      pk.pack(r.rows);
      pk.pack(std::string("dim"));
      pk.pack(r.dim);
      pk.pack(std::string("embeddings"));  // float32 little-endian, rows x dim
      pk.pack_bin(static_cast<uint32_t>(r.data.size() * sizeof(float)));
      pk.pack_bin_body(reinterpret_cast<const char*>(r.data.data()),
                       static_cast<uint32_t>(r.data.size() * sizeof(float)));
      pk.pack(std::string("usage"));
      pk.pack_map(1);
      pk.pack(std::string("prompt_tokens"));
      pk.pack(r.prompt_tokens);
      out.content_type = "application/msgpack";
      out.body.assign(buf.data(), buf.size());
      return respond(std::move(out));
    }
    std::string body = "{\"model\":";
    AppendJsonString(body, model);
    body += ",\"dim\":" + std::to_string(r.dim) + ",\"embeddings\":[";
    for (int i = 0; i < r.rows; ++i) {
      if (i) body.push_back(',');
      AppendFloats(body, r.data.data() + static_cast<size_t>(i) * r.dim, r.dim);
    }
    body += "],\"usage\":{\"prompt_tokens\":" + std::to_string(r.prompt_tokens) + "}}";
    respond(JsonResponse(200, std::move(body)));
  });
}

HttpResponse Router::Models(const std::string& only) const {
  auto snap = fleet_();
  json data = json::array();
  for (const auto& [name, m] : snap->models) {
    if (!only.empty() && name != only) continue;
    json where = json::array();
    bool loaded = false, loading = false, failed = false;
    for (const WorkerInfo& w : snap->workers) {
      auto it = w.models.find(name);
      if (it == w.models.end()) continue;
      const WorkerModel& wm = it->second;
      json entry = {{"worker", w.id},
                    {"state", wm.state},
                    {"pinned", wm.pinned},
                    {"memory_bytes", wm.memory_bytes},
                    {"measured_bytes", wm.measured_bytes},
                    {"last_used_unix_ms", wm.last_used_unix_ms}};
      if (!wm.error.empty()) entry["error"] = wm.error;
      if (wm.backlog > 0) entry["backlog"] = wm.backlog;
      where.push_back(std::move(entry));
      loaded |= wm.state == "loaded";
      loading |= wm.state == "loading";
      failed |= wm.state == "failed";
    }
    // The model's state in the fleet: the best any worker reports.
    const char* state = loaded ? "loaded" : loading ? "loading" : failed ? "failed" : "not_loaded";
    json entry = {{"id", name},  {"object", "model"}, {"owned_by", "shoal"},
                  {"created", 0}, {"task", m.task},     {"state", state},
                  {"workers", where}};
    // Only models that take token inputs have a width and a token limit.
    if (m.task != "ocr" && m.task != "generate") {
      entry["dim"] = m.dim;
      entry["max_seq_len"] = m.max_seq_len;
    }
    data.push_back(std::move(entry));
  }
  if (!only.empty()) {
    if (data.empty()) return ErrorResponse(NotFound("The model '" + only + "' does not exist", "model_not_found"));
    return JsonResponse(200, data[0].dump());
  }
  return JsonResponse(200, json({{"object", "list"}, {"data", data}}).dump());
}

HttpResponse Router::Workers() const {
  auto snap = fleet_();
  json data = json::array();
  for (const WorkerInfo& w : snap->workers) {
    json loaded = json::array();
    for (const auto& [name, m] : w.models)
      if (m.state == "loaded") loaded.push_back(name);
    json entry = {{"id", w.id},
                  {"object", "worker"},
                  {"host", w.host},
                  {"busy_seconds", w.busy_seconds},
                  {"device", w.device},
                  {"device_slots", w.device_slots},
                  {"memory_used_bytes", w.memory_used_bytes},
                  {"memory_budget_bytes", w.memory_budget_bytes},
                  {"models_loaded", loaded},
                  {"started_unix_ms", w.started_unix_ms},
                    {"heartbeat_unix_ms", w.heartbeat_unix_ms}};
    if (w.device != "cpu") {
      entry["host_memory_used_bytes"] = w.host_memory_used_bytes;
      entry["host_memory_budget_bytes"] = w.host_memory_budget_bytes;
    }
    data.push_back(std::move(entry));
  }
  return JsonResponse(200, json({{"object", "list"}, {"data", data}}).dump());
}

void Router::ModelAction(const std::string& model, const std::string& action, HttpRequest&& req,
                         HttpResponder respond) {
  if (control_ == nullptr) {
    return respond(ErrorResponse(Unavailable("model control is not enabled on this gateway", "control_unavailable"),
                                 options_.retry_after_s));
  }
  std::string worker;
  if (!req.body.empty()) {
    json body;
    if (Status st = ParseJsonObject(req.body, &body); !st.ok()) return respond(ErrorResponse(st));
    if (auto w = body.find("worker"); w != body.end() && !w->is_null()) {
      if (!w->is_string() || w->get_ref<const std::string&>().empty())
        return respond(ErrorResponse(InvalidArgument("worker must be a non-empty string (a worker id; leave it out "
                                                     "to act on the fleet)",
                                                     "invalid_worker")));
      worker = w->get<std::string>();
    }
  }
  const int64_t retry = options_.retry_after_s;
  control_->Act(action, model, worker, [respond = std::move(respond), retry](Result<ControlOutcome> r) {
    if (!r.ok()) return respond(ErrorResponse(r.status(), retry));
    json results = json::array();
    const Status* first_error = nullptr;
    for (const ControlResult& c : r->results) {
      json e = {{"worker", c.worker}, {"ok", c.status.ok()}};
      if (c.status.ok()) {
        e["status"] = json::parse(c.status_json.empty() ? "{}" : c.status_json, nullptr, false);
      } else {
        e["error"] = {{"message", c.status.message()},
                      {"type", std::string(ErrorTypeFor(c.status.code()))},
                      {"code", std::string(c.status.ReasonOrDefault())}};
        if (first_error == nullptr) first_error = &c.status;
      }
      results.push_back(std::move(e));
    }
    json body = {{"model", r->model}, {"action", r->action}, {"results", results}};
    HttpResponse out;
    if (first_error != nullptr) {
      // Any worker failing fails the request, with that worker's status;
      // the body still says what every worker did.
      out = ErrorResponse(*first_error, retry);
      json err = json::parse(out.body);
      body["error"] = err["error"];
      out.body = DumpJson(body);  // a worker's message may quote bytes that are not UTF-8
    } else {
      out = JsonResponse(200, DumpJson(body));
    }
    respond(std::move(out));
  });
}

HttpResponse Router::Ready() const {
  auto snap = fleet_();
  const bool ready = snap->nats_connected && snap->stream_ok && !snap->worker_json.empty();
  json j = {{"ready", ready},
            {"nats", snap->nats_connected},
            {"stream", snap->stream_ok},
            {"workers", snap->worker_json.size()},
            {"models", snap->models.size()},
            {"queue_depth", snap->queue_depth}};
  HttpResponse r = JsonResponse(ready ? 200 : 503, j.dump());
  if (!ready) r.headers.emplace_back("Retry-After", std::to_string(options_.retry_after_s));
  return r;
}

}  // namespace shoal
