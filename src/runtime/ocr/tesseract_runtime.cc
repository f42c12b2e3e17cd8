#include "runtime/ocr/tesseract_runtime.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <msgpack.hpp>

#include "common/process_memory.h"

namespace shoal {
namespace {

void PackString(msgpack::packer<msgpack::sbuffer>& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

}  // namespace

std::string EncodeOcrResult(const OcrResult& result) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(4);
  PackString(pk, "text");
  PackString(pk, result.text);
  PackString(pk, "words");
  pk.pack_array(static_cast<uint32_t>(result.words.size()));
  for (const OcrWord& w : result.words) {
    pk.pack_map(5);
    PackString(pk, "text");
    PackString(pk, w.text);
    PackString(pk, "box");
    pk.pack_array(4);
    pk.pack(w.box.x);
    pk.pack(w.box.y);
    pk.pack(w.box.w);
    pk.pack(w.box.h);
    PackString(pk, "confidence");
    pk.pack(w.confidence);
    PackString(pk, "block");
    pk.pack(w.block);
    PackString(pk, "line");
    pk.pack(w.line);
  }
  PackString(pk, "width");
  pk.pack(result.width);
  PackString(pk, "height");
  pk.pack(result.height);
  return std::string(buf.data(), buf.size());
}

TesseractRuntime::TesseractRuntime() = default;
TesseractRuntime::~TesseractRuntime() = default;

Status TesseractRuntime::Load(const ModelConfig& config) {
  if (config.task != "ocr")
    return InvalidArgument("runtime 'tesseract' serves task 'ocr', not '" + config.task + "'", "wrong_task");
  ASSIGN_OR_RETURN(OcrOptions options, ParseOcrOptions(config.config_json, config.dir));
  const int64_t before = ResidentBytes();
  ASSIGN_OR_RETURN(engine_, TesseractOcr::Create(options));
  // The language data may already be resident (another engine of the same
  // languages in this process): count at least the files' size then.
  int64_t data_bytes = 0;
  const OcrOptions& resolved = engine_->options();
  size_t start = 0;
  while (start <= resolved.languages.size()) {
    size_t plus = resolved.languages.find('+', start);
    if (plus == std::string::npos) plus = resolved.languages.size();
    std::error_code ec;
    const auto size = std::filesystem::file_size(
        resolved.tessdata_dir + "/" + resolved.languages.substr(start, plus - start) + ".traineddata", ec);
    if (!ec) data_bytes += static_cast<int64_t>(size);
    start = plus + 1;
  }
  memory_bytes_ = std::max<int64_t>(ResidentBytes() - before, data_bytes);
  return Status::Ok();
}

Result<Embeddings> TesseractRuntime::Run(const TokenBatch& batch) {
  (void)batch;
  return Unprocessable("an OCR model takes images, not token batches", "wrong_task");
}

Result<std::vector<std::string>> TesseractRuntime::RunItems(const std::vector<std::string>& items,
                                                            const PartialSink& partial) {
  return RunItemsBefore(items, {}, partial);
}

Result<std::vector<std::string>> TesseractRuntime::RunItemsBefore(const std::vector<std::string>& items,
                                                                  const std::vector<int64_t>& deadlines_unix_ms,
                                                                  const PartialSink& partial) {
  (void)partial;
  if (!engine_) return Unavailable("the OCR model is not loaded");
  std::vector<std::string> out;
  out.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    // An image that fails fails alone: the others in the batch (other
    // callers' pages, seconds each) keep their results, not run again.
    Result<OcrResult> r = engine_->Recognize(items[i], i < deadlines_unix_ms.size() ? deadlines_unix_ms[i] : 0);
    out.push_back(r.ok() ? EncodeOcrResult(*r) : ItemError(r.status()));
  }
  return out;
}

void TesseractRuntime::Unload() {
  engine_.reset();
  memory_bytes_ = 0;
}

}  // namespace shoal
