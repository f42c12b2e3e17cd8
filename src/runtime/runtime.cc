#include "runtime/runtime.h"

#include <msgpack.hpp>

#include "runtime/null/null_runtime.h"
#include "runtime/ocr/tesseract_runtime.h"
#include "runtime/openai/openai_runtime.h"
#include "runtime/process/process_runtime.h"
#include "runtime/sim/sim_runtime.h"
#include "runtime/torch/torchscript_runtime.h"

namespace shoal {

std::string ItemError(const Status& status) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(1);
  pk.pack(std::string("error"));
  pk.pack_map(3);
  pk.pack(std::string("code"));
  pk.pack(std::string(StatusCodeName(status.code())));
  pk.pack(std::string("message"));
  pk.pack(status.message());
  pk.pack(std::string("reason"));
  pk.pack(status.reason());
  return std::string(buf.data(), buf.size());
}

Status Cancelled() { return DeadlineExceeded("its caller went away before the answer was done", "cancelled"); }

Status ParseItemError(std::string_view doc) {
  // Cheap test first: a one-entry map whose key is "error" (fixmap, fixstr).
  if (doc.size() < 8 || static_cast<unsigned char>(doc[0]) != 0x81 || doc.substr(1, 6) != "\xa5" "error")
    return Status::Ok();
  try {
    auto handle = msgpack::unpack(doc.data(), doc.size());
    const auto& err = handle.get().via.map.ptr[0].val;
    if (err.type != msgpack::type::MAP) return Status::Ok();
    std::string code, message, reason;
    for (uint32_t i = 0; i < err.via.map.size; ++i) {
      const auto& kv = err.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR || kv.val.type != msgpack::type::STR) continue;
      const std::string_view k(kv.key.via.str.ptr, kv.key.via.str.size);
      std::string v(kv.val.via.str.ptr, kv.val.via.str.size);
      if (k == "code") code = std::move(v);
      else if (k == "message") message = std::move(v);
      else if (k == "reason") reason = std::move(v);
    }
    return Status(ParseFailureCode(code), message, reason);
  } catch (const std::exception&) {
    return Status::Ok();
  }
}

Status CheckComputeDevice(const std::string& device) { return CheckTorchDevice(device); }

Result<std::unique_ptr<Runtime>> CreateRuntime(const std::string& kind) {
  if (kind == "torchscript") {
    return std::unique_ptr<Runtime>(std::make_unique<TorchScriptRuntime>());
  }
  if (kind == "null") return std::unique_ptr<Runtime>(std::make_unique<NullRuntime>());
  if (kind == "process") return std::unique_ptr<Runtime>(std::make_unique<ProcessRuntime>());
  if (kind == "openai") return std::unique_ptr<Runtime>(std::make_unique<OpenAiRuntime>());
  if (kind == "sim") return std::unique_ptr<Runtime>(std::make_unique<SimRuntime>());
  if (kind == "tesseract") return std::unique_ptr<Runtime>(std::make_unique<TesseractRuntime>());
  return NotFound("unknown runtime '" + kind + "' (known: torchscript, process, openai, tesseract, sim, null)",
                  "runtime_not_found");
}

}  // namespace shoal
