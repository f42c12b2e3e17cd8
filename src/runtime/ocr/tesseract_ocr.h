// TesseractOcr: optical character recognition with libtesseract and its
// pretrained language data (Debian's tesseract-ocr-eng / -vie). Image bytes
// in (PNG, JPEG, TIFF, BMP, PNM, decoded from memory by Leptonica), text out
// with word boxes and confidences. Independent of the Runtime interface: the
// worker's OCR path owns one engine per executor thread and calls
// Recognize() once per image. Tesseract and Leptonica headers stay in the .cc.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace shoal {

struct OcrOptions {
  // Tesseract language codes joined by '+': "eng", "vie", "eng+vie". Each
  // needs <tessdata_dir>/<code>.traineddata.
  std::string languages = "eng";
  // Directory holding the .traineddata files; empty: DefaultTessdataDir().
  std::string tessdata_dir;
  // Tesseract page segmentation mode, 3..13 (3: fully automatic layout,
  // 6: one uniform block, 7: one line, 11: sparse text). 0..2 need the OSD
  // model or do no recognition, so they are rejected.
  int psm = 3;
  // Resolution hint in dots per inch; 0: the image's own, else Tesseract's
  // estimate from the glyph size. Hints outside 70..2400 are rejected.
  int dpi = 0;
  // Images with more pixels (width x height, read from the header before
  // decoding) are refused, so a small compressed file cannot claim more
  // memory than this allows: recognition peaks at about 13 bytes per pixel
  // (1.3 GB for a 10000x10000 RGBA PNG of 418 KB).
  int64_t max_pixels = 100'000'000;
  // Whether Tesseract may run its OpenMP parallel regions (several threads
  // per image). Off: each Recognize() stays on the calling thread, which
  // gives the best throughput with one engine per executor thread and avoids
  // OpenMP spin-waiting on busy cores (5-7x slower per image measured on a
  // loaded 2-core machine). Applied per call on the calling thread only.
  bool parallel = false;

  Status Validate() const;  // InvalidArgument, reason "invalid_ocr_options"
};

struct OcrBox {
  int x = 0;  // left, pixels from the image's left edge
  int y = 0;  // top, pixels from the image's top edge
  int w = 0;
  int h = 0;
};

struct OcrWord {
  std::string text;        // UTF-8, no surrounding whitespace
  OcrBox box;
  float confidence = 0;    // 0..1 (Tesseract's 0..100 scaled)
  int block = 0;           // 0-based block index on the page
  int line = 0;            // 0-based text line index on the page (not per block)
};

struct OcrResult {
  std::string text;             // the whole page, lines ending in '\n'
  std::vector<OcrWord> words;   // reading order
  int width = 0;                // decoded image size in pixels
  int height = 0;
};

// One Tesseract engine with its languages loaded. Not thread-safe: use one
// instance per thread (instances are independent of each other).
class TesseractOcr {
 public:
  // Loads the languages; blocks for the load (~0.1-1 s per language).
  // Errors: InvalidArgument "invalid_ocr_options" (bad options or language
  // code), NotFound "tessdata_not_found" (no tessdata directory),
  // NotFound "ocr_language_not_found" (a .traineddata file is missing),
  // BadGateway "ocr_load_failed" (Tesseract refused the data).
  static Result<std::unique_ptr<TesseractOcr>> Create(const OcrOptions& options);
  ~TesseractOcr();
  TesseractOcr(const TesseractOcr&) = delete;
  TesseractOcr& operator=(const TesseractOcr&) = delete;

  // Decodes one encoded image and recognises it; blocks for the duration
  // (0.1-0.5 s for a few lines, seconds for a dense page). With
  // `deadline_unix_ms` > 0 (wall-clock ms since the epoch; its caller waits
  // no longer), recognition stops at the first word past it. Errors, all
  // InvalidArgument unless noted:
  //   "invalid_image"             empty, not an image, truncated or corrupt
  //   "image_too_large"           width x height over options.max_pixels
  //   "unsupported_image_format"  UnsupportedMedia: a format Leptonica knows
  //                               but Shoal does not take (GIF, WebP, ...)
  //   "ocr_failed"                Internal: Tesseract gave up on the image
  //   DeadlineExceeded            the deadline passed before or during it
  // Never throws.
  Result<OcrResult> Recognize(std::string_view image_bytes, int64_t deadline_unix_ms = 0);

  const OcrOptions& options() const;  // with tessdata_dir resolved

 private:
  struct Impl;
  explicit TesseractOcr(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The first directory that exists among Debian's and upstream's install
// paths (/usr/share/tesseract-ocr/5/tessdata, .../4.00/tessdata,
// /usr/share/tessdata, /usr/local/share/tessdata); empty if none does.
// Reads no environment: pass $TESSDATA_PREFIX as tessdata_dir if wanted.
std::string DefaultTessdataDir();

// Reads the "ocr" object of a model's shoal.json document (absent: the
// defaults): {"languages": "eng", "psm": 3, "dpi": 0, "tessdata_dir": "",
// "max_pixels": 100000000, "parallel": false}; unknown keys are an error.
// A relative tessdata_dir is taken from model_dir.
// Returns validated options; InvalidArgument "invalid_ocr_options" otherwise.
Result<OcrOptions> ParseOcrOptions(std::string_view shoal_json, const std::string& model_dir);

// Convenience for one-off use: Create() then Recognize(). Loads the
// languages on every call, so a worker should keep an engine instead.
Result<OcrResult> RecognizeImage(const OcrOptions& options, std::string_view image_bytes);

}  // namespace shoal
