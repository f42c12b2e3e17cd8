// Messages of the out-of-process runtime protocol (docs/runtime-protocol.md),
// worker side: encoders for the requests and one decoder for every reply.
// Binary tensors travel as MessagePack bin (little-endian), never as text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/model_config.h"
#include "runtime/runtime.h"
#include "common/status.h"
#include "runtime/process/frame.h"

namespace shoal::runtime_protocol {

std::string EncodeHello(uint64_t id, const std::string& client);
std::string EncodeLoad(uint64_t id, const ModelConfig& config);
// rows x seq_len token ids (int32 LE), attention mask (uint8) and, for
// text pairs, token type ids (uint8).
std::string EncodeRun(uint64_t id, const std::string& task, const TokenBatch& batch);
// "ping", "unload", "shutdown".
std::string EncodeSimple(uint64_t id, std::string_view op);

// Any reply. Fields absent from the message keep their defaults.
struct Reply {
  uint64_t id = 0;
  bool ok = false;
  std::string error_code;     // when !ok
  std::string error_message;  // when !ok
  // hello
  int protocol = 0;
  std::string runtime;
  std::vector<std::string> tasks;
  // load
  int dim = 0;
  int64_t memory_bytes = 0;
  // run
  int rows = 0;
  std::string embeddings;  // rows * dim float32 LE
};

// InvalidArgument "malformed_frame" when the bytes are not a reply map.
Result<Reply> DecodeReply(std::string_view data);

}  // namespace shoal::runtime_protocol
