#include "wire/work_message.h"

#include <algorithm>
#include <cstring>

#include <msgpack.hpp>

#include "common/model_config.h"

namespace shoal::wire {
namespace {

// msgpack's packer writes into any stream with write(); this one is the
// std::string the encoder returns. Reserved up front from the payload
// sizes, it is filled in place and moved out: a large payload (a 100 MiB
// image) is copied once, into the message, instead of into an sbuffer that
// grows by doubling and then again into the returned string.
struct StringStream {
  std::string out;
  void write(const char* data, size_t n) { out.append(data, n); }
};

using Packer = msgpack::packer<StringStream>;

// Room for the keys, small fields and MessagePack headers around the
// payload bytes counted by the caller.
constexpr size_t kEnvelopeBytes = 256;

void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

std::string_view KeyOf(const msgpack::object& o) {
  if (o.type != msgpack::type::STR) return {};
  return {o.via.str.ptr, o.via.str.size};
}

Status ExpectType(const msgpack::object& o, msgpack::type::object_type t, const char* what) {
  if (o.type != t) return InvalidArgument(std::string("wire: field '") + what + "' has the wrong type");
  return Status::Ok();
}

Result<std::string> AsString(const msgpack::object& o, const char* what) {
  if (o.type == msgpack::type::STR) return std::string(o.via.str.ptr, o.via.str.size);
  if (o.type == msgpack::type::BIN) return std::string(o.via.bin.ptr, o.via.bin.size);
  return InvalidArgument(std::string("wire: field '") + what + "' must be a string");
}

Result<int64_t> AsInt(const msgpack::object& o, const char* what) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) return InvalidArgument(std::string("wire: '") + what + "' out of range");
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
  return InvalidArgument(std::string("wire: field '") + what + "' must be an integer");
}

// Strings and bins of the unpacked object point into `data` instead of
// being copied into the handle's zone: every decoder below copies what it
// keeps before it returns, while `data` is alive. (A 100 MiB image would
// otherwise be held three times while decoded: message, zone, item.)
bool ReferenceInPlace(msgpack::type::object_type, std::size_t, void*) { return true; }

// Messages come from anyone who can publish on the subjects: msgpack-c
// reserves what an array or map header claims before reading a single
// element, so no header may claim more elements than the message has bytes
// (each takes one at least), and nesting stays within what Shoal writes
// (three levels) with room to spare.
constexpr size_t kMaxWireDepth = 16;

Result<msgpack::object_handle> Unpack(std::string_view data) {
  const size_t n = data.size();
  const msgpack::unpack_limit limit(n, n / 2, n, n, n, kMaxWireDepth);
  try {
    return msgpack::unpack(data.data(), data.size(), ReferenceInPlace, nullptr, limit);
  } catch (const std::exception& e) {
    return InvalidArgument(std::string("wire: malformed MessagePack: ") + e.what());
  }
}

}  // namespace

namespace {

// Packs `b`. With `pieces`, items of at least `move_bytes` are not copied:
// the bytes packed so far become a piece, the item (moved out of `movable`,
// which is `b`) the next one.
void PackWorkBody(const WorkBody& b, WorkBody* movable, size_t move_bytes, StringStream& buf,
                  std::vector<std::string>* pieces) {
  auto moved = [&](const std::string& item) { return pieces != nullptr && item.size() >= move_bytes; };
  size_t payload = b.task.size() + b.model.size();
  for (const auto& t : b.texts) payload += t.size() + 5;
  for (const auto& t : b.texts_pair) payload += t.size() + 6;
  for (const auto& item : b.items) payload += (moved(item) ? 0 : item.size()) + 5;
  for (const auto& row : b.token_ids) payload += row.size() * 5 + 5;
  buf.out.reserve(kEnvelopeBytes + payload);
  Packer pk(buf);
  pk.pack_map(4);
  PackStr(pk, "task");
  PackStr(pk, b.task);
  PackStr(pk, "model");
  PackStr(pk, b.model);
  PackStr(pk, "inputs");
  if (!b.texts_pair.empty()) {
    pk.pack_array(static_cast<uint32_t>(b.texts.size()));
    for (size_t i = 0; i < b.texts.size(); ++i) {
      pk.pack_array(2);
      PackStr(pk, b.texts[i]);
      PackStr(pk, i < b.texts_pair.size() ? std::string_view(b.texts_pair[i]) : std::string_view());
    }
  } else if (!b.items.empty()) {
    pk.pack_array(static_cast<uint32_t>(b.items.size()));
    for (size_t i = 0; i < b.items.size(); ++i) {
      const std::string& item = b.items[i];
      pk.pack_bin(static_cast<uint32_t>(item.size()));
      if (moved(item)) {
        pieces->push_back(std::move(buf.out));
        buf.out = std::string();
        buf.out.reserve(kEnvelopeBytes);
        pieces->push_back(std::move(movable->items[i]));
      } else {
        pk.pack_bin_body(item.data(), static_cast<uint32_t>(item.size()));
      }
    }
  } else if (!b.texts.empty()) {
    pk.pack_array(static_cast<uint32_t>(b.texts.size()));
    for (const auto& t : b.texts) PackStr(pk, t);
  } else {
    pk.pack_array(static_cast<uint32_t>(b.token_ids.size()));
    for (const auto& row : b.token_ids) {
      pk.pack_array(static_cast<uint32_t>(row.size()));
      for (int32_t id : row) pk.pack_int32(id);
    }
  }
  PackStr(pk, "params");
  pk.pack_map(b.first_input > 0 ? 2 : 1);
  PackStr(pk, "truncate");
  b.truncate ? pk.pack_true() : pk.pack_false();
  if (b.first_input > 0) {
    PackStr(pk, "first_input");
    pk.pack_int64(b.first_input);
  }
}

}  // namespace

std::string EncodeWorkBody(const WorkBody& b) {
  StringStream buf;
  PackWorkBody(b, nullptr, 0, buf, nullptr);
  return std::move(buf.out);
}

EncodedMessage EncodeWorkBodyPieces(WorkBody&& b, size_t move_bytes) {
  EncodedMessage m;
  StringStream buf;
  PackWorkBody(b, &b, move_bytes, buf, &m.pieces);
  m.pieces.push_back(std::move(buf.out));
  return m;
}

size_t EncodedMessage::size() const {
  size_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

std::string EncodedMessage::Join() && {
  if (pieces.size() == 1) return std::move(pieces.front());
  std::string out;
  out.reserve(size());
  for (const auto& p : pieces) out += p;
  return out;
}

Result<WorkBody> DecodeWorkBody(std::string_view data) {
  ASSIGN_OR_RETURN(auto handle, Unpack(data));
  const msgpack::object& root = handle.get();
  RETURN_IF_ERROR(ExpectType(root, msgpack::type::MAP, "body"));
  WorkBody b;
  bool have_inputs = false;
  try {
    for (uint32_t i = 0; i < root.via.map.size; ++i) {
      const auto& kv = root.via.map.ptr[i];
      auto key = KeyOf(kv.key);
      if (key == "task") {
        ASSIGN_OR_RETURN(b.task, AsString(kv.val, "task"));
      } else if (key == "model") {
        ASSIGN_OR_RETURN(b.model, AsString(kv.val, "model"));
      } else if (key == "inputs") {
        RETURN_IF_ERROR(ExpectType(kv.val, msgpack::type::ARRAY, "inputs"));
        have_inputs = true;
        const auto& arr = kv.val.via.array;
        // Counted with any earlier "inputs" of the same map (a repeated key
        // appends).
        const size_t before = b.texts.size() + b.token_ids.size() + b.items.size();
        if (arr.size > kMaxInputsPerMessage - std::min(before, kMaxInputsPerMessage))
          return InvalidArgument("wire: " + std::to_string(before + arr.size) + " inputs in one message (at most " +
                                     std::to_string(kMaxInputsPerMessage) + ")",
                                 "too_many_inputs");
        for (uint32_t j = 0; j < arr.size; ++j) {
          const auto& item = arr.ptr[j];
          // Every input is of one kind: a string, a two-string pair, token
          // ids, or an opaque item (bin).
          enum Kind { kText, kPair, kIds, kItem } kind;
          if (item.type == msgpack::type::BIN) {
            if (!b.texts.empty() || !b.token_ids.empty())
              return InvalidArgument("wire: inputs mix binary items with text or token arrays");
            b.items.emplace_back(item.via.bin.ptr, item.via.bin.size);
            continue;
          }
          if (!b.items.empty()) return InvalidArgument("wire: inputs mix binary items with text or token arrays");
          if (item.type == msgpack::type::STR) {
            kind = kText;
          } else if (item.type == msgpack::type::ARRAY) {
            kind = item.via.array.size > 0 && item.via.array.ptr[0].type == msgpack::type::STR ? kPair : kIds;
          } else {
            return InvalidArgument("wire: each input must be a string, a text pair or an array of token ids");
          }
          const bool mixed = (kind == kIds && !b.texts.empty()) || (kind != kIds && !b.token_ids.empty()) ||
                             (!b.texts.empty() && (kind == kPair) != !b.texts_pair.empty());
          if (mixed) return InvalidArgument("wire: inputs mix strings, text pairs and token arrays");
          if (kind == kText) {
            b.texts.emplace_back(item.via.str.ptr, item.via.str.size);
          } else if (kind == kPair) {
            const auto& pair = item.via.array;
            if (pair.size != 2 || pair.ptr[1].type != msgpack::type::STR)
              return InvalidArgument("wire: a text pair must be two strings");
            b.texts.emplace_back(pair.ptr[0].via.str.ptr, pair.ptr[0].via.str.size);
            b.texts_pair.emplace_back(pair.ptr[1].via.str.ptr, pair.ptr[1].via.str.size);
          } else {
            std::vector<int32_t> row;
            row.reserve(item.via.array.size);
            for (uint32_t k = 0; k < item.via.array.size; ++k) {
              ASSIGN_OR_RETURN(int64_t id, AsInt(item.via.array.ptr[k], "inputs[][]"));
              if (id < 0 || id > INT32_MAX) return InvalidArgument("wire: token id out of range");
              row.push_back(static_cast<int32_t>(id));
            }
            b.token_ids.push_back(std::move(row));
          }
        }
      } else if (key == "params") {
        if (kv.val.type != msgpack::type::MAP) continue;
        for (uint32_t j = 0; j < kv.val.via.map.size; ++j) {
          const auto& p = kv.val.via.map.ptr[j];
          if (KeyOf(p.key) == "truncate" && p.val.type == msgpack::type::BOOLEAN) b.truncate = p.val.via.boolean;
          if (KeyOf(p.key) == "first_input" && p.val.type == msgpack::type::POSITIVE_INTEGER &&
              p.val.via.u64 <= (uint64_t{1} << 32))
            b.first_input = static_cast<int64_t>(p.val.via.u64);
        }
      }
    }
  } catch (const std::exception& e) {
    return InvalidArgument(std::string("wire: ") + e.what());
  }
  if (b.model.empty()) return InvalidArgument("wire: body has no model");
  if (!have_inputs) return InvalidArgument("wire: body has no inputs");
  return b;
}

std::string EncodeWorkReply(const WorkReply& r) {
  size_t payload = r.request_id.size() + r.worker_id.size() + r.status.message().size() +
                   r.status.reason().size() + r.embeddings.size() * sizeof(float) + r.token_counts.size() * 5;
  for (const auto& item : r.items) payload += item.size() + 5;
  StringStream buf;
  buf.out.reserve(kEnvelopeBytes + payload);
  Packer pk(buf);
  const bool ok = r.status.ok();
  const bool has_items = ok && !r.items.empty();
  pk.pack_map((ok ? 8 : 4) + (has_items ? 1 : 0) + (r.partial ? 3 : 0));
  PackStr(pk, "id");
  PackStr(pk, r.request_id);
  PackStr(pk, "chunk");
  pk.pack_int32(r.chunk_index);
  PackStr(pk, "worker");
  PackStr(pk, r.worker_id);
  if (r.partial) {
    PackStr(pk, "partial");
    pk.pack_true();
    PackStr(pk, "seq");
    pk.pack_int32(r.seq);
    PackStr(pk, "item");
    pk.pack_int32(r.item);
  }
  if (!ok) {
    PackStr(pk, "error");
    pk.pack_map(3);
    PackStr(pk, "code");
    PackStr(pk, StatusCodeName(r.status.code()));
    PackStr(pk, "message");
    PackStr(pk, r.status.message());
    PackStr(pk, "reason");
    PackStr(pk, r.status.reason());
    return std::move(buf.out);
  }
  PackStr(pk, "rows");
  pk.pack_int32(r.rows);
  PackStr(pk, "dim");
  pk.pack_int32(r.dim);
  // float32 little-endian, as the bytes lie in memory on every supported host.
  PackStr(pk, "embeddings");
  const uint32_t nbytes = static_cast<uint32_t>(r.embeddings.size() * sizeof(float));
  pk.pack_bin(nbytes);
  pk.pack_bin_body(reinterpret_cast<const char*>(r.embeddings.data()), nbytes);
  PackStr(pk, "tokens");
  pk.pack_array(static_cast<uint32_t>(r.token_counts.size()));
  for (int32_t t : r.token_counts) pk.pack_int32(t);
  PackStr(pk, "truncated");
  r.truncated_any ? pk.pack_true() : pk.pack_false();
  if (has_items) {
    PackStr(pk, "items");
    pk.pack_array(static_cast<uint32_t>(r.items.size()));
    for (const auto& item : r.items) {
      pk.pack_bin(static_cast<uint32_t>(item.size()));
      pk.pack_bin_body(item.data(), static_cast<uint32_t>(item.size()));
    }
  }
  return std::move(buf.out);
}

namespace {

// A bin of little-endian float32 values into *out (`bad_size`: the error
// for a size that is not a multiple of 4).
Status BinToFloats(const msgpack::object& bin, const char* bad_size, std::vector<float>* out) {
  if (bin.via.bin.size % sizeof(float) != 0) return InvalidArgument(bad_size);
  out->resize(bin.via.bin.size / sizeof(float));
  if (!out->empty()) std::memcpy(out->data(), bin.via.bin.ptr, bin.via.bin.size);  // no memcpy from null
  return Status::Ok();
}

// A count or index of a reply: 0 ..= INT32_MAX.
Result<int> AsCount(const msgpack::object& o, const char* what) {
  ASSIGN_OR_RETURN(int64_t v, AsInt(o, what));
  if (v < 0 || v > INT32_MAX) return InvalidArgument(std::string("wire: field '") + what + "' is out of range");
  return static_cast<int>(v);
}

Status DecodeWorkReplyFields(const msgpack::object& root, WorkReply& r) {
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const auto& kv = root.via.map.ptr[i];
    auto key = KeyOf(kv.key);
    if (key == "id") {
      ASSIGN_OR_RETURN(r.request_id, AsString(kv.val, "id"));
    } else if (key == "chunk") {
      ASSIGN_OR_RETURN(r.chunk_index, AsCount(kv.val, "chunk"));
    } else if (key == "worker") {
      ASSIGN_OR_RETURN(r.worker_id, AsString(kv.val, "worker"));
    } else if (key == "rows") {
      ASSIGN_OR_RETURN(r.rows, AsCount(kv.val, "rows"));
    } else if (key == "dim") {
      ASSIGN_OR_RETURN(r.dim, AsCount(kv.val, "dim"));
    } else if (key == "embeddings") {
      RETURN_IF_ERROR(ExpectType(kv.val, msgpack::type::BIN, "embeddings"));
      RETURN_IF_ERROR(BinToFloats(kv.val, "wire: embeddings size not a multiple of 4", &r.embeddings));
    } else if (key == "tokens") {
      RETURN_IF_ERROR(ExpectType(kv.val, msgpack::type::ARRAY, "tokens"));
      for (uint32_t j = 0; j < kv.val.via.array.size; ++j) {
        ASSIGN_OR_RETURN(int t, AsCount(kv.val.via.array.ptr[j], "tokens[]"));
        r.token_counts.push_back(t);
      }
    } else if (key == "truncated") {
      if (kv.val.type == msgpack::type::BOOLEAN) r.truncated_any = kv.val.via.boolean;
    } else if (key == "partial") {
      if (kv.val.type == msgpack::type::BOOLEAN) r.partial = kv.val.via.boolean;
    } else if (key == "seq") {
      ASSIGN_OR_RETURN(r.seq, AsCount(kv.val, "seq"));
    } else if (key == "item") {
      ASSIGN_OR_RETURN(r.item, AsCount(kv.val, "item"));
    } else if (key == "items") {
      RETURN_IF_ERROR(ExpectType(kv.val, msgpack::type::ARRAY, "items"));
      for (uint32_t j = 0; j < kv.val.via.array.size; ++j) {
        ASSIGN_OR_RETURN(std::string item, AsString(kv.val.via.array.ptr[j], "items[]"));
        r.items.push_back(std::move(item));
      }
    } else if (key == "error") {
      RETURN_IF_ERROR(ExpectType(kv.val, msgpack::type::MAP, "error"));
      std::string code, message, reason;
      for (uint32_t j = 0; j < kv.val.via.map.size; ++j) {
        const auto& e = kv.val.via.map.ptr[j];
        auto k = KeyOf(e.key);
        if (k == "code") { ASSIGN_OR_RETURN(code, AsString(e.val, "error.code")); }
        else if (k == "message") { ASSIGN_OR_RETURN(message, AsString(e.val, "error.message")); }
        else if (k == "reason") { ASSIGN_OR_RETURN(reason, AsString(e.val, "error.reason")); }
      }
      r.status = Status(ParseFailureCode(code), message, reason);
    }
  }
  if (r.status.ok() && static_cast<size_t>(r.rows) * r.dim != r.embeddings.size())
    return InvalidArgument("wire: reply embeddings do not match rows x dim");
  return Status::Ok();
}

}  // namespace

Result<WorkReply> DecodeWorkReply(std::string_view data) {
  ASSIGN_OR_RETURN(auto handle, Unpack(data));
  const msgpack::object& root = handle.get();
  RETURN_IF_ERROR(ExpectType(root, msgpack::type::MAP, "reply"));
  WorkReply r;
  r.chunk_index = -1;  // none: a reply must say which chunk it answers
  Status fields = DecodeWorkReplyFields(root, r);
  if (fields.ok() && r.request_id.empty()) return InvalidArgument("wire: reply has no id");
  if (fields.ok() && r.chunk_index < 0) fields = InvalidArgument("wire: reply has no chunk");
  if (fields.ok()) return r;
  // Its request and chunk, when they can be read, get the error at once
  // rather than their deadline: the worker has settled the work.
  WorkReply failed;
  failed.chunk_index = -1;  // unknown unless it reads
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const auto& kv = root.via.map.ptr[i];
    const auto key = KeyOf(kv.key);
    if (key == "id") {
      if (auto id = AsString(kv.val, "id"); id.ok()) failed.request_id = *id;
    } else if (key == "chunk") {
      auto chunk = AsCount(kv.val, "chunk");
      failed.chunk_index = chunk.ok() ? *chunk : -1;
    } else if (key == "worker") {
      if (auto worker = AsString(kv.val, "worker"); worker.ok()) failed.worker_id = *worker;
    }
  }
  if (failed.request_id.empty()) return fields;
  failed.status = Status(StatusCode::kBadGateway,
                         "the worker" + (failed.worker_id.empty() ? "" : " " + failed.worker_id) +
                             " sent a reply this gateway cannot read: " + fields.message(),
                         "bad_worker_reply");
  return failed;
}

Result<std::vector<float>> DecodeFloatRow(std::string_view doc) {
  ASSIGN_OR_RETURN(auto handle, Unpack(doc));
  const msgpack::object& o = handle.get();
  std::vector<float> row;
  if (o.type == msgpack::type::BIN) {
    RETURN_IF_ERROR(BinToFloats(o, "wire: float32 row size not a multiple of 4", &row));
    return row;
  }
  if (o.type != msgpack::type::ARRAY) return InvalidArgument("wire: a row must be float32 bin or an array of numbers");
  row.reserve(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    const auto& v = o.via.array.ptr[i];
    switch (v.type) {
      case msgpack::type::FLOAT32:
      case msgpack::type::FLOAT64: row.push_back(static_cast<float>(v.via.f64)); break;
      case msgpack::type::POSITIVE_INTEGER: row.push_back(static_cast<float>(v.via.u64)); break;
      case msgpack::type::NEGATIVE_INTEGER: row.push_back(static_cast<float>(v.via.i64)); break;
      default: return InvalidArgument("wire: a row must hold numbers only");
    }
  }
  return row;
}

std::string ModelToToken(std::string_view model) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(model.size());
  for (unsigned char c : model) {
    if (KeptInModelToken(c)) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('~');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

Result<std::string> TokenToModel(std::string_view token) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < token.size(); ++i) {
    if (token[i] != '~') {
      out.push_back(token[i]);
      continue;
    }
    if (i + 2 >= token.size())
      return InvalidArgument("bad subject token escape");
    int hi = hex(token[i + 1]), lo = hex(token[i + 2]);
    if (hi < 0 || lo < 0) return InvalidArgument("bad subject token escape");
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

std::string ModelKvKey(std::string_view model) {
  std::string key = ModelToToken(model);
  for (char& c : key)
    if (c == '~') c = '=';
  return key;
}

std::string WorkSubject(std::string_view model) { return kWorkSubjectPrefix + ModelToToken(model); }
std::string PushSubject(std::string_view worker_id, std::string_view model) {
  return kPushSubjectPrefix + std::string(worker_id) + "." + ModelToToken(model);
}
std::string ConsumerName(std::string_view model) { return "shoal_" + ModelToToken(model); }

}  // namespace shoal::wire
