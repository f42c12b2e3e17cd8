// TesseractRuntime ("runtime": "tesseract", task "ocr"): the Runtime adapter
// over TesseractOcr. Takes whole items (one encoded image each) and returns,
// per image, one MessagePack document
//   {text, words: [{text, box: [x, y, w, h], confidence, line}], width, height}
// Options come from the "ocr" object of the model's shoal.json (see
// ParseOcrOptions). Not thread-safe (see Runtime): the worker calls it from
// one executor thread. Tesseract headers stay in the .cc files.
#pragma once

#include <memory>

#include "runtime/ocr/tesseract_ocr.h"
#include "runtime/runtime.h"

namespace shoal {

class TesseractRuntime final : public Runtime {
 public:
  TesseractRuntime();
  ~TesseractRuntime() override;

  // Parses the "ocr" options and loads the languages (blocks ~0.1-1 s per
  // language). Errors: those of ParseOcrOptions and TesseractOcr::Create,
  // InvalidArgument when config.task is not "ocr".
  Status Load(const ModelConfig& config) override;
  // OCR models take images, never token batches: Unprocessable "wrong_task".
  Result<Embeddings> Run(const TokenBatch& batch) override;
  bool TakesItems() const override { return true; }
  // Recognises each image in turn. An image that fails gets
  // ItemError(the engine's error: invalid_image, image_too_large,
  // unsupported_image_format, ocr_failed) and the others keep their
  // results. `partial` is unused (no streamed output). Unavailable before
  // Load().
  Result<std::vector<std::string>> RunItems(const std::vector<std::string>& items,
                                            const PartialSink& partial) override;
  // The same, each image stopping at its deadline (DeadlineExceeded as its
  // ItemError): one with a deadline passed is not started.
  Result<std::vector<std::string>> RunItemsBefore(const std::vector<std::string>& items,
                                                  const std::vector<int64_t>& deadlines_unix_ms,
                                                  const PartialSink& partial) override;
  void Unload() override;
  // Resident-set growth measured around the language load.
  int64_t MemoryBytes() const override { return memory_bytes_; }
  int Dim() const override { return 0; }

 private:
  std::unique_ptr<TesseractOcr> engine_;
  int64_t memory_bytes_ = 0;
};

// The MessagePack document TesseractRuntime returns for one image.
std::string EncodeOcrResult(const OcrResult& result);

}  // namespace shoal
