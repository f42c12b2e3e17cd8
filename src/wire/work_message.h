// The wire contract between gateway and worker: one JetStream message per
// chunk of a client request (MessagePack body + NATS headers), one core-NATS
// reply per chunk. Binary stays binary: embeddings travel as raw float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace shoal::wire {

// Header names on work messages.
inline constexpr const char* kHdrRequestId = "Shoal-Request-Id";
inline constexpr const char* kHdrChunk = "Shoal-Chunk";             // "index/count"; on a reply by reference: "index"
inline constexpr const char* kHdrDeadline = "Shoal-Deadline-Ms";    // absolute, Unix ms
inline constexpr const char* kHdrTokenEstimate = "Shoal-Token-Estimate";
inline constexpr const char* kHdrReplyTo = "Shoal-Reply-To";
inline constexpr const char* kHdrPayloadRef = "Shoal-Payload-Ref";
inline constexpr const char* kHdrMsgId = "Nats-Msg-Id";             // JetStream de-duplication
// A message with this header carries no work: it only says that someone
// wants the model loaded (a gateway that answers 503 instead of waiting).
// Workers ack it without a reply.
inline constexpr const char* kHdrLoadHint = "Shoal-Load-Hint";

// The most inputs one work message may carry (the gateway's largest
// --chunk-size). A worker refuses more (400 too_many_inputs): a message
// published straight to the queue could otherwise ask for a reply of any
// size (rows x dim floats) from a million empty strings.
inline constexpr size_t kMaxInputsPerMessage = 4096;
inline constexpr const char* kStreamName = "SHOAL_WORK";
inline constexpr const char* kWorkersBucket = "SHOAL_WORKERS";  // heartbeats, TTL
inline constexpr const char* kModelsBucket = "SHOAL_MODELS";    // model catalog
// Placement claims: a worker that decides to load a cold model first creates
// the key "<model-token>.<replica>" here; whoever fails to create it leaves
// the load to the holder. Entries expire (TTL), so a dead claimant's claim goes.
inline constexpr const char* kPlacementBucket = "SHOAL_PLACEMENT";
// Control requests to one worker (load/unload/pin/unpin/status), JSON.
inline std::string ControlSubject(const std::string& worker_id) { return "shoal.ctl." + worker_id; }
inline constexpr const char* kWorkSubjectPrefix = "shoal.work.";
// Push dispatch (the baseline to compare pulling against): a gateway sends
// a work message straight to one worker on core NATS (not durable), on
// shoal.push.<worker-id>.<model-token>; the worker answers on the same
// reply path as pulled work.
inline constexpr const char* kPushSubjectPrefix = "shoal.push.";
// Load reports: every worker publishes a small JSON document on
// shoal.load.<worker-id> every load_report_interval_ms (core NATS): loaded
// models, rows held or running, cumulative busy seconds, device slots.
inline std::string LoadSubject(const std::string& worker_id) { return "shoal.load." + worker_id; }
inline constexpr const char* kLoadSubjectPrefix = "shoal.load.";
// Cancel notices (core NATS): a gateway whose client went away mid-answer
// (a streamed generation) publishes the request id here, and workers stop
// that request's work where the runtime can.
inline constexpr const char* kCancelSubject = "shoal.cancel";

// Body of a work message: {task, model, inputs, params}.
struct WorkBody {
  std::string task = "embed";
  std::string model;
  // Exactly one of texts / token_ids is non-empty.
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> token_ids;
  // Text pairs (task "score"): texts[i] goes with texts_pair[i]. On the
  // wire each input is then a two-string array.
  std::vector<std::string> texts_pair;
  // Opaque inputs for tasks the runtime handles whole, without the worker's
  // tokenizer (ocr: image bytes; generate: one request document as
  // MessagePack). On the wire each is a MessagePack bin.
  std::vector<std::string> items;
  bool truncate = false;  // params.truncate
  // params.first_input: the request's index of inputs[0] (a request split
  // into chunks), so errors name the input as the client numbered it.
  int64_t first_input = 0;

  size_t size() const {
    if (!items.empty()) return items.size();
    return texts.empty() ? token_ids.size() : texts.size();
  }
};

// The headers of a work message, parsed.
struct WorkHeaders {
  std::string request_id;
  int chunk_index = 0;
  int chunk_count = 1;
  int64_t deadline_unix_ms = 0;  // 0: none
  int64_t token_estimate = 0;
  std::string reply_to;
  std::string payload_ref;
};

std::string EncodeWorkBody(const WorkBody& body);

// An encoded message in pieces: their bytes, in order, are the message.
struct EncodedMessage {
  std::vector<std::string> pieces;
  size_t size() const;
  // One string: the only piece moved out, or the pieces copied together.
  std::string Join() &&;
};
// EncodeWorkBody's bytes, with every item of at least `move_bytes` moved
// out of `body` into a piece of its own instead of copied: a large image is
// never held twice while its message is built. Consumes `body`'s items.
EncodedMessage EncodeWorkBodyPieces(WorkBody&& body, size_t move_bytes);
Result<WorkBody> DecodeWorkBody(std::string_view data);

// One reply per chunk, to the gateway's inbox.
struct WorkReply {
  std::string request_id;
  int chunk_index = 0;
  Status status;  // non-OK: the chunk failed with this error
  int rows = 0;
  int dim = 0;
  std::vector<float> embeddings;        // rows * dim
  std::vector<int32_t> token_counts;    // real tokens per row, for usage
  bool truncated_any = false;
  std::string worker_id;
  // Item tasks: one result per input item, each a MessagePack document.
  std::vector<std::string> items;
  // A partial reply (streamed output): more replies follow for this chunk.
  // `seq` counts a chunk's partial replies from 0; the final reply has
  // partial = false.
  // `item` is the input (within the chunk) the partial output belongs to.
  bool partial = false;
  int seq = 0;
  int item = 0;
};

std::string EncodeWorkReply(const WorkReply& reply);
// An error for data that is not a reply map with an id. A reply whose id
// can be read but another field cannot (a type, embeddings that are not
// rows x dim) decodes as a final reply for that id and chunk (chunk -1 when
// unreadable) with status BadGateway "bad_worker_reply": its caller hears
// now, since the worker has settled the work.
Result<WorkReply> DecodeWorkReply(std::string_view data);

// One row of floats from a MessagePack document: a bin of little-endian
// float32, or an array of numbers (how an item runtime serving a token task,
// e.g. embeddings from a remote backend, returns each row).
Result<std::vector<float>> DecodeFloatRow(std::string_view doc);

// Model names map reversibly onto one NATS subject token / consumer name:
// [A-Za-z0-9_-] stay as they are, every other byte becomes "~XX" (hex).
std::string ModelToToken(std::string_view model);
Result<std::string> TokenToModel(std::string_view token);
// The model's key in a KV bucket (keys allow [-/_=.a-zA-Z0-9]): its subject
// token with '=' in place of '~', so it is reversible too.
std::string ModelKvKey(std::string_view model);
std::string WorkSubject(std::string_view model);   // shoal.work.<token>
std::string ConsumerName(std::string_view model);  // shoal_<token>
// shoal.push.<worker-id>.<model-token> (see kPushSubjectPrefix).
std::string PushSubject(std::string_view worker_id, std::string_view model);

}  // namespace shoal::wire
