// OpenAiRuntime ("runtime": "openai"): serves a model that lives on an
// OpenAI-compatible upstream server (vLLM, SGLang, llama.cpp server, TEI or
// another Shoal gateway) by forwarding batches over HTTP. Task "embed": one
// POST /embeddings per batch of texts, each result a float32 row. Task
// "generate": each item is one completion request document, POSTed to
// /completions or /chat/completions with the upstream's model name; a
// streamed request's server-sent events go to the partial sink as they
// arrive. Upstream failures map onto Shoal's errors (UpstreamError).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "runtime/openai/upstream_client.h"
#include "runtime/runtime.h"

namespace shoal {

// The "openai" object of a model's shoal.json.
struct OpenAiConfig {
  std::string base_url;      // required: http://host:port/v1
  std::string model;         // the upstream's model name; default: the Shoal name
  std::string api_key_env;   // environment variable holding the API key
  int64_t timeout_ms = 60000;
  int64_t connect_timeout_ms = 5000;
  int max_connections = 4;   // idle connections kept, and generate requests a worker runs at once
};

// Parses the "openai" object of a shoal.json document.
Result<OpenAiConfig> ParseOpenAiConfig(const std::string& config_json);

class OpenAiRuntime final : public Runtime {
 public:
  // Reads the "openai" section and the API key; does not contact the
  // upstream (it may come up later). InvalidArgument for a bad section or a
  // task other than embed or generate.
  Status Load(const ModelConfig& config) override;
  Result<Embeddings> Run(const TokenBatch& batch) override;
  bool TakesItems() const override { return true; }
  bool UsesDevice() const override { return false; }  // the upstream computes
  // Generate: openai.max_connections requests at a time, each on its own.
  int ConcurrentCalls() const override { return config_.task == "generate" ? openai_.max_connections : 1; }
  // Embed: items are UTF-8 texts; each result is a MessagePack bin holding
  // one little-endian float32 row. Generate: items and results are
  // MessagePack maps (request -> the upstream's response; for a streamed
  // request {"object":"shoal.stream.end","events":n} after the events went
  // to `partial`, each one MessagePack map). Blocks for the upstream calls.
  Result<std::vector<std::string>> RunItems(const std::vector<std::string>& items,
                                            const PartialSink& partial) override;
  // Generate: a request whose deadline has passed by the time a connection
  // is free for it is not sent (ItemError(DeadlineExceeded)): a batch
  // larger than max_connections runs in waves, and its later requests may
  // wait out their callers.
  Result<std::vector<std::string>> RunItemsBefore(const std::vector<std::string>& items,
                                                  const std::vector<int64_t>& deadlines_unix_ms,
                                                  const PartialSink& partial) override;
  // Generate: each request's result goes to `calls.done` when its upstream
  // call ends, while the batch's others still run; a request whose caller
  // went away is not sent, or its stream is closed at its next event.
  Result<std::vector<std::string>> RunItemsAsReady(const std::vector<std::string>& items,
                                                   const std::vector<int64_t>& deadlines_unix_ms,
                                                   const ItemCalls& calls) override;
  void Unload() override { client_.reset(); }
  int64_t MemoryBytes() const override { return 0; }
  int Dim() const override { return dim_; }

  const UpstreamClient* client() const { return client_.get(); }

 private:
  Result<std::vector<std::string>> Embed(const std::vector<std::string>& texts);
  // One generate request; `partial` receives its stream events. A stream
  // is closed, and the request is Cancelled(), once `cancelled` (may be
  // empty) says so.
  Result<std::string> Generate(const std::string& item, const std::function<void(std::string)>& partial,
                               const std::function<bool()>& cancelled);

  ModelConfig config_;
  OpenAiConfig openai_;
  std::unique_ptr<UpstreamClient> client_;
  int dim_ = 0;
};

}  // namespace shoal
