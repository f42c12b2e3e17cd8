#include "runtime/process/protocol.h"

#include "common/bounded_json.h"

#include <msgpack.hpp>

namespace shoal::runtime_protocol {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void Str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void Bin(Packer& pk, const void* data, size_t n) {
  pk.pack_bin(static_cast<uint32_t>(n));
  pk.pack_bin_body(static_cast<const char*>(data), static_cast<uint32_t>(n));
}

// Starts a request map with `fields` entries beyond op and id.
void Head(Packer& pk, std::string_view op, uint64_t id, uint32_t fields) {
  pk.pack_map(2 + fields);
  Str(pk, "op");
  Str(pk, op);
  Str(pk, "id");
  pk.pack_uint64(id);
}

std::string Done(const msgpack::sbuffer& buf) { return std::string(buf.data(), buf.size()); }

Status Malformed(const std::string& what) { return InvalidArgument("runtime reply: " + what, "malformed_frame"); }

std::string_view View(const msgpack::object& o) {
  if (o.type == msgpack::type::STR) return {o.via.str.ptr, o.via.str.size};
  if (o.type == msgpack::type::BIN) return {o.via.bin.ptr, o.via.bin.size};
  return {};
}

bool Int(const msgpack::object& o, int64_t* out) {
  if (o.type == msgpack::type::POSITIVE_INTEGER && o.via.u64 <= static_cast<uint64_t>(INT64_MAX)) {
    *out = static_cast<int64_t>(o.via.u64);
    return true;
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    *out = o.via.i64;
    return true;
  }
  return false;
}

}  // namespace

std::string EncodeHello(uint64_t id, const std::string& client) {
  msgpack::sbuffer buf(64);
  Packer pk(buf);
  Head(pk, "hello", id, 2);
  Str(pk, "protocol");
  pk.pack_int(kProtocolVersion);
  Str(pk, "client");
  Str(pk, client);
  return Done(buf);
}

std::string EncodeLoad(uint64_t id, const ModelConfig& c) {
  msgpack::sbuffer buf(512);
  Packer pk(buf);
  Head(pk, "load", id, 1);
  Str(pk, "model");
  pk.pack_map(9);
  Str(pk, "name");
  Str(pk, c.name);
  Str(pk, "task");
  Str(pk, c.task);
  Str(pk, "dir");
  Str(pk, c.dir);
  Str(pk, "model_file");
  Str(pk, c.model_file);
  Str(pk, "max_seq_len");
  pk.pack_int(c.max_seq_len);
  Str(pk, "pooling");
  Str(pk, c.pooling);
  Str(pk, "normalize");
  c.normalize ? pk.pack_true() : pk.pack_false();
  Str(pk, "intra_op_threads");
  pk.pack_int(c.intra_op_threads);
  Str(pk, "config_json");
  Str(pk, c.config_json);
  return Done(buf);
}

std::string EncodeRun(uint64_t id, const std::string& task, const TokenBatch& batch) {
  std::vector<int32_t> ids(batch.input_ids.begin(), batch.input_ids.end());
  std::vector<uint8_t> mask(batch.attention_mask.begin(), batch.attention_mask.end());
  const bool pairs = !batch.token_type_ids.empty();
  msgpack::sbuffer buf(64 + ids.size() * 6);
  Packer pk(buf);
  Head(pk, "run", id, pairs ? 6 : 5);
  Str(pk, "task");
  Str(pk, task);
  Str(pk, "rows");
  pk.pack_int(batch.rows);
  Str(pk, "seq_len");
  pk.pack_int(batch.seq_len);
  Str(pk, "input_ids");
  Bin(pk, ids.data(), ids.size() * sizeof(int32_t));  // the host is little-endian
  Str(pk, "attention_mask");
  Bin(pk, mask.data(), mask.size());
  if (pairs) {
    std::vector<uint8_t> types(batch.token_type_ids.begin(), batch.token_type_ids.end());
    Str(pk, "token_type_ids");
    Bin(pk, types.data(), types.size());
  }
  return Done(buf);
}

std::string EncodeSimple(uint64_t id, std::string_view op) {
  msgpack::sbuffer buf(32);
  Packer pk(buf);
  Head(pk, op, id, 0);
  return Done(buf);
}

Result<Reply> DecodeReply(std::string_view data) {
  // msgpack-c reserves what an array or map header claims before reading
  // its elements: 6 bytes could ask for 64 GiB.
  if (Status bounded = CheckBoundedMsgpack(data, "the runtime's reply", {8, uint64_t{1} << 20}, true);
      !bounded.ok())
    return Malformed(bounded.message());
  msgpack::object_handle handle;
  try {
    handle = msgpack::unpack(data.data(), data.size());
  } catch (const std::exception& e) {
    return Malformed(std::string("not MessagePack: ") + e.what());
  }
  const msgpack::object& root = handle.get();
  if (root.type != msgpack::type::MAP) return Malformed("not a map");
  Reply r;
  bool have_id = false, have_ok = false;
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const std::string_view key = View(root.via.map.ptr[i].key);
    const msgpack::object& v = root.via.map.ptr[i].val;
    int64_t n = 0;
    if (key == "id") {
      if (!Int(v, &n) || n < 0) return Malformed("id must be a non-negative integer");
      r.id = static_cast<uint64_t>(n);
      have_id = true;
    } else if (key == "ok") {
      if (v.type != msgpack::type::BOOLEAN) return Malformed("ok must be a boolean");
      r.ok = v.via.boolean;
      have_ok = true;
    } else if (key == "error") {
      if (v.type != msgpack::type::MAP) return Malformed("error must be a map");
      for (uint32_t k = 0; k < v.via.map.size; ++k) {
        const std::string_view ek = View(v.via.map.ptr[k].key);
        if (ek == "code") r.error_code = std::string(View(v.via.map.ptr[k].val));
        if (ek == "message") r.error_message = std::string(View(v.via.map.ptr[k].val));
      }
    } else if (key == "protocol") {
      if (!Int(v, &n) || n < 0 || n > INT32_MAX) return Malformed("protocol must be a non-negative integer");
      r.protocol = static_cast<int>(n);
    } else if (key == "runtime") {
      r.runtime = std::string(View(v));
    } else if (key == "tasks") {
      if (v.type != msgpack::type::ARRAY) return Malformed("tasks must be an array");
      for (uint32_t k = 0; k < v.via.array.size; ++k) r.tasks.emplace_back(View(v.via.array.ptr[k]));
    } else if (key == "dim") {
      if (!Int(v, &n) || n < 0 || n > (1 << 20)) return Malformed("dim out of range");
      r.dim = static_cast<int>(n);
    } else if (key == "memory_bytes") {
      if (!Int(v, &n) || n < 0) return Malformed("memory_bytes must be a non-negative integer");
      r.memory_bytes = n;
    } else if (key == "rows") {
      if (!Int(v, &n) || n < 0 || n > INT32_MAX) return Malformed("rows out of range");
      r.rows = static_cast<int>(n);
    } else if (key == "embeddings") {
      if (v.type != msgpack::type::BIN) return Malformed("embeddings must be bin (float32 little-endian)");
      r.embeddings.assign(v.via.bin.ptr, v.via.bin.size);
    }
  }
  if (!have_id || !have_ok) return Malformed("missing id or ok");
  return r;
}

}  // namespace shoal::runtime_protocol
