#include "runtime/openai/openai_runtime.h"

#include <algorithm>
#include <set>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "common/clock.h"
#include "common/json_text.h"
#include "common/log.h"
#include "runtime/openai/sse_parser.h"

namespace shoal {
namespace {

using nlohmann::json;

Status BadUpstream(const std::string& what) {
  return Status(StatusCode::kBadGateway, "upstream answered " + what, "upstream_error");
}

// A parsed upstream answer nests at most kMaxDocumentDepth and holds at
// most kMaxAnswerValues. nlohmann's
// MessagePack writer recurses once per level (an answer nested 50,000 deep
// would overflow the executor's stack and end the worker), and a parsed
// value takes 16 bytes or more against one or two in the text. 2^25 values
// hold 4,096 embeddings of width 4,096.

// An upstream answer (a body or one stream event) as a JSON object;
// BadUpstream when it is not one or passes the bounds above. `what` names
// it in the message ("/embeddings", "a stream event").
Result<json> ParseAnswer(std::string_view text, const std::string& what) {
  json doc;
  const Status st = ParseBoundedJson(text, "the answer", {kMaxDocumentDepth, kMaxAnswerValues}, &doc);
  if (st.reason() == "nesting_too_deep" || st.reason() == "too_many_values")
    return BadUpstream(what + " nested deeper than " + std::to_string(kMaxDocumentDepth) + " levels or holding more than " +
                       std::to_string(kMaxAnswerValues) + " values");
  if (!st.ok() || !doc.is_object()) return BadUpstream(what + " that is not a JSON object");
  return doc;
}

std::string ToMsgpack(const json& j) {
  std::string out;
  json::to_msgpack(j, out);
  return out;
}

// One float32 row as a MessagePack bin (the shape wire::DecodeFloatRow reads).
std::string FloatRowDoc(const std::vector<float>& row) {
  std::vector<std::uint8_t> bytes(row.size() * sizeof(float));
  std::memcpy(bytes.data(), row.data(), bytes.size());
  return ToMsgpack(json::binary(std::move(bytes)));
}

}  // namespace

Result<OpenAiConfig> ParseOpenAiConfig(const std::string& config_json) {
  json doc = json::parse(config_json, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return InvalidArgument("model config is not a JSON object");
  auto it = doc.find("openai");
  if (it == doc.end() || !it->is_object())
    return InvalidArgument("runtime \"openai\" needs an \"openai\" object with at least \"base_url\"");
  const json& o = *it;
  OpenAiConfig c;
  auto str = [&](const char* key, std::string* out) -> Status {
    auto v = o.find(key);
    if (v == o.end() || v->is_null()) return Status::Ok();
    if (!v->is_string()) return InvalidArgument(std::string("openai.") + key + " must be a string");
    *out = v->get<std::string>();
    return Status::Ok();
  };
  auto num = [&](const char* key, int64_t* out) -> Status {
    auto v = o.find(key);
    if (v == o.end() || v->is_null()) return Status::Ok();
    if (!v->is_number_integer() || v->get<int64_t>() <= 0)
      return InvalidArgument(std::string("openai.") + key + " must be a positive integer");
    *out = v->get<int64_t>();
    return Status::Ok();
  };
  RETURN_IF_ERROR(str("base_url", &c.base_url));
  RETURN_IF_ERROR(str("model", &c.model));
  RETURN_IF_ERROR(str("api_key_env", &c.api_key_env));
  RETURN_IF_ERROR(num("timeout_ms", &c.timeout_ms));
  RETURN_IF_ERROR(num("connect_timeout_ms", &c.connect_timeout_ms));
  int64_t conns = c.max_connections;
  RETURN_IF_ERROR(num("max_connections", &conns));
  c.max_connections = static_cast<int>(std::min<int64_t>(conns, 1024));
  if (c.base_url.empty()) return InvalidArgument("openai.base_url is required");
  return c;
}

Status OpenAiRuntime::Load(const ModelConfig& config) {
  if (config.task != "embed" && config.task != "generate")
    return InvalidArgument("runtime \"openai\" serves tasks embed and generate, not '" + config.task + "'");
  ASSIGN_OR_RETURN(openai_, ParseOpenAiConfig(config.config_json));
  if (openai_.model.empty()) openai_.model = config.name;
  UpstreamOptions o;
  o.base_url = openai_.base_url;
  o.timeout_ms = openai_.timeout_ms;
  o.connect_timeout_ms = openai_.connect_timeout_ms;
  o.max_connections = openai_.max_connections;
  if (!openai_.api_key_env.empty()) {
    const char* key = std::getenv(openai_.api_key_env.c_str());
    if (key == nullptr || *key == '\0')
      return InvalidArgument("openai.api_key_env names '" + openai_.api_key_env + "', which is not set");
    std::string_view k(key);
    // A key read from a file (a mounted secret) often ends in a newline.
    while (!k.empty() && (k.back() == '\n' || k.back() == '\r' || k.back() == ' ' || k.back() == '\t'))
      k.remove_suffix(1);
    constexpr size_t kMaxKeyBytes = 8192;
    if (k.empty())
      return InvalidArgument("openai.api_key_env names '" + openai_.api_key_env + "', which holds only whitespace");
    if (k.size() > kMaxKeyBytes ||
        std::any_of(k.begin(), k.end(), [](char ch) { return static_cast<unsigned char>(ch) <= 0x20 || ch == 0x7f; }))
      return InvalidArgument("the value of " + openai_.api_key_env +
                             " is not usable as an API key (spaces or control characters inside, or over 8 KiB)");
    o.api_key = std::string(k);
  }
  ASSIGN_OR_RETURN(client_, UpstreamClient::Create(o));
  config_ = config;
  dim_ = config.dim;
  return Status::Ok();
}

Result<Embeddings> OpenAiRuntime::Run(const TokenBatch&) {
  return Unprocessable("runtime \"openai\" takes texts, not token ids", "wrong_task");
}

Result<std::vector<std::string>> OpenAiRuntime::RunItems(const std::vector<std::string>& items,
                                                         const PartialSink& partial) {
  return RunItemsBefore(items, {}, partial);
}

Result<std::vector<std::string>> OpenAiRuntime::RunItemsBefore(const std::vector<std::string>& items,
                                                               const std::vector<int64_t>& deadlines_unix_ms,
                                                               const PartialSink& partial) {
  return RunItemsAsReady(items, deadlines_unix_ms, ItemCalls{partial, {}, {}});
}

Result<std::vector<std::string>> OpenAiRuntime::RunItemsAsReady(const std::vector<std::string>& items,
                                                                const std::vector<int64_t>& deadlines_unix_ms,
                                                                const ItemCalls& calls) {
  const PartialSink& partial = calls.partial;
  const ResultSink& done = calls.done;
  if (!client_) return Unavailable("model '" + config_.name + "' is not loaded");
  if (items.empty()) return std::vector<std::string>{};
  if (config_.task == "embed") return Embed(items);
  // Whether item i's caller has stopped waiting.
  auto expired = [&](size_t i) {
    return i < deadlines_unix_ms.size() && deadlines_unix_ms[i] > 0 &&
           SystemClock::Get()->NowUnixMs() > deadlines_unix_ms[i];  // as the worker's own check
  };
  // Whether item i's caller has gone (asked per stream event).
  auto gone = [&](size_t i) { return static_cast<bool>(calls.cancelled) && calls.cancelled(i); };
  // Whether item i's upstream request should stop: its caller went away,
  // or had its 504 at the deadline (the upstream would generate for no one).
  auto stop = [&](size_t i) { return gone(i) || expired(i); };
  // What an item stopped that way gets.
  auto stopped = [&](size_t i) {
    return gone(i) ? Cancelled() : DeadlineExceeded("the request's deadline passed while the upstream generated");
  };
  // Why item i is not sent upstream now (OK: it is).
  auto not_sent = [&](size_t i) {
    if (expired(i)) return DeadlineExceeded("the request's deadline passed before it was sent upstream");
    if (gone(i)) return Cancelled();
    return Status::Ok();
  };

  if (items.size() == 1) {
    if (Status skip = not_sent(0); !skip.ok()) return std::vector<std::string>{ItemError(skip)};
    auto out = Generate(
        items[0], [&](std::string chunk) { if (partial) partial(0, chunk); }, [&] { return stop(0); });
    if (!out.ok() && stop(0)) return std::vector<std::string>{ItemError(stopped(0))};
    if (!out.ok()) return out.status();
    return std::vector<std::string>{std::move(*out)};
  }
  // Several requests: run them concurrently (one connection each), and hand
  // their stream events to `partial`, and each one's result to `done` as it
  // ends, from this thread, in order per item.
  struct Event {
    size_t item;
    std::string data;
    bool result;  // the item's result document, after all its events
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Event> events;  // guarded by mu
  size_t finished = 0;       // guarded by mu
  std::atomic<size_t> next{0};
  std::vector<Result<std::string>> results(items.size(), Result<std::string>(Internal("not run")));
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      if (Status skip = not_sent(i); !skip.ok()) {
        results[i] = skip;
      } else {
        results[i] = Generate(
            items[i],
            [&, i](std::string chunk) {
              std::lock_guard<std::mutex> lock(mu);
              events.push_back({i, std::move(chunk), false});
              cv.notify_one();
            },
            [&, i] { return stop(i); });
        if (!results[i].ok() && stop(i)) results[i] = stopped(i);
      }
      std::lock_guard<std::mutex> lock(mu);
      if (done) events.push_back({i, results[i].ok() ? *results[i] : ItemError(results[i].status()), true});
      ++finished;
      cv.notify_one();
    }
  };
  const size_t n_threads = std::min(items.size(), static_cast<size_t>(openai_.max_connections));
  std::vector<std::thread> threads;
  threads.reserve(n_threads);
  try {
    for (size_t t = 0; t < n_threads; ++t) threads.emplace_back(work);
  } catch (const std::system_error& e) {  // out of threads: the ones started (or this one) do it all
    LOG_WARN("openai", "could not start a request thread (" << e.what() << "); " << threads.size() << " run");
    if (threads.empty()) work();
  }
  // A sink that throws (out of memory sending a reply) must not leave this
  // frame while the threads run: the batch fails once they are done.
  Status sink_failed;
  {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return !events.empty() || finished == items.size(); });
      while (!events.empty()) {
        Event e = std::move(events.front());
        events.pop_front();
        lock.unlock();
        try {
          if (e.result) {
            done(e.item, e.data);
          } else if (partial) {
            partial(e.item, e.data);
          }
        } catch (const std::exception& ex) {
          if (sink_failed.ok()) sink_failed = Internal(std::string("handing on a result failed: ") + ex.what());
        }
        lock.lock();
      }
      if (finished == items.size()) break;
    }
  }
  for (auto& t : threads) t.join();
  if (!sink_failed.ok()) return sink_failed;
  std::vector<std::string> out;
  out.reserve(items.size());
  // One request's failure is its caller's alone: the others have streamed
  // and finished, and rerunning them would stream their output twice.
  for (auto& r : results) out.push_back(r.ok() ? std::move(*r) : ItemError(r.status()));
  return out;
}

Result<std::vector<std::string>> OpenAiRuntime::Embed(const std::vector<std::string>& texts) {
  json req = {{"model", openai_.model}, {"input", texts}, {"encoding_format", "float"}};
  ASSIGN_OR_RETURN(UpstreamReply reply,
                   client_->Post("/embeddings", DumpJson(req)));
  if (reply.status / 100 != 2) return UpstreamError(reply.status, reply.body);
  ASSIGN_OR_RETURN(json doc, ParseAnswer(reply.body, "/embeddings"));
  if (!doc.contains("data") || !doc["data"].is_array()) return BadUpstream("/embeddings without a \"data\" array");
  const json& data = doc["data"];
  if (data.size() != texts.size())
    return BadUpstream(std::to_string(data.size()) + " embeddings for " + std::to_string(texts.size()) + " inputs");
  std::vector<std::string> out(texts.size());
  std::vector<bool> seen(texts.size(), false);
  for (size_t k = 0; k < data.size(); ++k) {
    const json& e = data[k];
    size_t index = k;
    if (e.contains("index") && e["index"].is_number_unsigned()) index = e["index"].get<size_t>();
    if (index >= texts.size() || seen[index]) return BadUpstream("embeddings with bad or repeated indices");
    auto emb = e.find("embedding");
    if (emb == e.end() || !emb->is_array() || emb->empty())
      return BadUpstream("an embedding that is not an array of numbers");
    std::vector<float> row;
    row.reserve(emb->size());
    for (const json& v : *emb) {
      if (!v.is_number()) return BadUpstream("an embedding that is not an array of numbers");
      const double d = v.get<double>();
      // Narrowing a double beyond float's range is undefined (and would be
      // an infinity the JSON answer writes as 0).
      if (!std::isfinite(d) || std::fabs(d) > std::numeric_limits<float>::max())
        return BadUpstream("an embedding with a component outside float range");
      row.push_back(static_cast<float>(d));
    }
    if (dim_ != 0 && static_cast<int>(row.size()) != dim_)
      return BadUpstream("embeddings of width " + std::to_string(row.size()) + ", the model config says " +
                         std::to_string(dim_));
    seen[index] = true;
    out[index] = FloatRowDoc(row);
  }
  return out;
}

Result<std::string> OpenAiRuntime::Generate(const std::string& item, const std::function<void(std::string)>& partial,
                                            const std::function<bool()>& cancelled) {
  // Work published to the queue directly has not been through the
  // gateway's checks, and nlohmann's reader recurses once per level. This
  // walk counts map keys, which the gateway's JSON bound does not.
  RETURN_IF_ERROR(CheckBoundedMsgpack(item, "a generate input", MsgpackBoundsFor(kMaxRequestValues),
                                      /*binary_allowed=*/true));
  json req = json::from_msgpack(item, true, false);
  if (req.is_discarded() || !req.is_object())
    return InvalidArgument("a generate input must be a MessagePack map (the request document)", "invalid_input");
  std::string endpoint = "chat/completions";
  if (auto e = req.find("endpoint"); e != req.end()) {
    if (!e->is_string()) return InvalidArgument("endpoint must be a string", "invalid_input");
    endpoint = e->get<std::string>();
    req.erase(e);
  }
  if (endpoint != "completions" && endpoint != "chat/completions")
    return InvalidArgument("endpoint must be \"completions\" or \"chat/completions\", not '" + endpoint + "'",
                           "invalid_input");
  req["model"] = openai_.model;
  auto stream_it = req.find("stream");
  const bool stream = stream_it != req.end() && stream_it->is_boolean() && stream_it->get<bool>();
  const std::string body = DumpJson(req);
  if (!stream) {
    ASSIGN_OR_RETURN(UpstreamReply reply, client_->Post("/" + endpoint, body, {}, cancelled));
    if (reply.status / 100 != 2) return UpstreamError(reply.status, reply.body);
    ASSIGN_OR_RETURN(json doc, ParseAnswer(reply.body, "/" + endpoint));
    return ToMsgpack(doc);
  }
  int64_t events = 0;
  bool done = false;
  // Choices seen, and those a finish_reason ended: the stream is complete
  // once every choice seen has ended (n > 1 streams several).
  std::set<int64_t> choices_seen, choices_ended;
  Status bad;
  SseParser sse([&](std::string_view data) {
    if (done) return true;  // what follows [DONE] in the same piece is ignored
    if (data == "[DONE]") {
      done = true;
      return true;
    }
    auto parsed = ParseAnswer(data, "a stream event");
    if (!parsed.ok()) {
      bad = parsed.status();
      return false;
    }
    json& ev = *parsed;
    if (auto c = ev.find("choices"); c != ev.end() && c->is_array())
      for (const json& choice : *c) {
        if (!choice.is_object()) continue;
        const int64_t index = choice.contains("index") && choice["index"].is_number_integer()
                                  ? choice["index"].get<int64_t>()
                                  : 0;
        constexpr size_t kMaxChoices = 4096;  // bounded against a hostile upstream
        if (choices_seen.size() < kMaxChoices) choices_seen.insert(index);
        if (choice.contains("finish_reason") && !choice["finish_reason"].is_null() &&
            choices_ended.size() < kMaxChoices)
          choices_ended.insert(index);
      }
    if (ev.contains("error") && !ev.contains("choices")) {
      // vLLM and others report a failure mid-stream as an error event.
      const json& e = ev["error"];
      bad = UpstreamError(e.is_object() && e.contains("code") && e["code"].is_number_integer()
                              ? e["code"].get<int>()
                              : 500,
                          data);
      return false;
    }
    ++events;
    partial(ToMsgpack(ev));
    return true;
  });
  ASSIGN_OR_RETURN(UpstreamReply reply,
                   client_->Post("/" + endpoint, body, [&](std::string_view bytes) {
                     if (cancelled && cancelled()) {
                       bad = Cancelled();  // the connection is closed: the upstream stops generating
                       return StreamStep::kAbandon;
                     }
                     if (!sse.Feed(bytes)) return StreamStep::kAbandon;
                     return done ? StreamStep::kEnded : StreamStep::kMore;
                   },
                   cancelled));
  if (reply.status / 100 != 2) return UpstreamError(reply.status, reply.body);
  if (!bad.ok()) return bad;
  // The connection broke: complete only if the events said so.
  const auto finished = [&] {
    return !choices_seen.empty() &&
           std::includes(choices_ended.begin(), choices_ended.end(), choices_seen.begin(), choices_seen.end());
  };
  if (!reply.broken.ok() && !done && !finished()) return reply.broken;
  if (reply.content_type.find("text/event-stream") == std::string::npos) {
    // The upstream does not stream: its whole answer is the result.
    ASSIGN_OR_RETURN(json doc, ParseAnswer(reply.body, "/" + endpoint));
    return ToMsgpack(doc);
  }
  if (!done) {
    (void)sse.Finish();
    if (!bad.ok()) return bad;
  }
  // A stream cut off by a closed connection looks like one that ended: only
  // [DONE] or a finish_reason says the generation is complete.
  if (!done && !finished())
    return BadUpstream("an event stream that ended after " + std::to_string(events) +
                       " events without [DONE] or a finish_reason (cut off?)");
  return ToMsgpack(json{{"object", "shoal.stream.end"}, {"events", events}});
}

}  // namespace shoal
