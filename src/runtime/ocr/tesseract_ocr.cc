#include "runtime/ocr/tesseract_ocr.h"

#include <leptonica/allheaders.h>
#include <omp.h>
#include <tesseract/baseapi.h>
#include <tesseract/ocrclass.h>
#include <tesseract/resultiterator.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/clock.h"
#include "common/json_text.h"

namespace shoal {
namespace {

int32_t Le32(std::string_view bytes, size_t at) {
  const auto u8 = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + i])); };
  return static_cast<int32_t>(u8(0) | u8(1) << 8 | u8(2) << 16 | u8(3) << 24);
}

// Width and height from a BMP's header (BITMAPINFOHEADER or a later one;
// a negative height is a top-down image), read where Leptonica reads them.
// False when it is too short.
bool BmpSize(std::string_view bytes, l_int32* w, l_int32* h) {
  if (bytes.size() < 26) return false;
  const int32_t height = Le32(bytes, 22);
  *w = Le32(bytes, 18);
  *h = height == INT32_MIN ? 0 : (height < 0 ? -height : height);
  return true;
}

// OS/2 1.x's BITMAPCOREHEADER (12 bytes, 16-bit sides): Leptonica reads
// every BMP's sides as 32-bit fields at offsets 18 and 22, so for this
// header the size checked here would not be the size it decodes.
bool IsCoreHeaderBmp(std::string_view bytes) { return bytes.size() >= 18 && Le32(bytes, 14) == 12; }

constexpr char kInvalidImage[] = "invalid_image";
constexpr char kInvalidOptions[] = "invalid_ocr_options";

struct PixDeleter {
  void operator()(Pix* p) const { pixDestroy(&p); }
};
using PixPtr = std::unique_ptr<Pix, PixDeleter>;

struct TextDeleter {
  void operator()(char* p) const { delete[] p; }
};
using TextPtr = std::unique_ptr<char, TextDeleter>;

// Leptonica reports every decode failure on stderr; a server sees many bad
// uploads and answers each with a Status, so the chatter is dropped. The
// handler is process-wide, which is fine: only this file uses Leptonica.
void SilenceLeptonica() {
  static std::once_flag once;
  std::call_once(once, [] { leptSetStderrHandler([](const char*) {}); });
}

bool IsAcceptedFormat(int format) {
  return format == IFF_PNG || format == IFF_JFIF_JPEG || format == IFF_BMP ||
         format == IFF_PNM || L_FORMAT_IS_TIFF(format);
}

bool IsValidLanguageCode(std::string_view code) {
  if (code.empty()) return false;
  return std::all_of(code.begin(), code.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-' || c == '/';
  });
}

std::vector<std::string> SplitLanguages(const std::string& languages) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t plus = languages.find('+', start);
    out.push_back(languages.substr(start, plus == std::string::npos ? plus : plus - start));
    if (plus == std::string::npos) break;
    start = plus + 1;
  }
  return out;
}

bool IsDirectory(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

bool IsFile(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

// Tesseract copes with 1, 8, 24 and 32 bpp without a colour map; anything
// else is converted here. Transparent pixels are laid on white, since many
// PNGs keep black in the colour channels of transparent areas.
PixPtr Normalize(PixPtr pix) {
  if (pixGetColormap(pix.get()) != nullptr) {
    PixPtr p(pixRemoveColormap(pix.get(), REMOVE_CMAP_BASED_ON_SRC));
    if (!p) return nullptr;
    pix = std::move(p);
  }
  int d = pixGetDepth(pix.get());
  if (d == 2 || d == 4 || d == 16) {
    PixPtr p(pixConvertTo8(pix.get(), 0));
    if (!p) return nullptr;
    pix = std::move(p);
  }
  if (pixGetDepth(pix.get()) == 32 && pixGetSpp(pix.get()) == 4) {
    PixPtr p(pixAlphaBlendUniform(pix.get(), 0xffffff00));
    if (!p) return nullptr;
    pix = std::move(p);
  }
  return pix;
}

// Makes OpenMP parallel regions on this thread run single-threaded while
// it lives. Tesseract asks for explicit thread counts (num_threads clauses),
// so omp_set_num_threads cannot limit it; a max-active-levels of 0 makes
// every region inactive. The setting is this thread's own and is restored.
class SerialOpenMpScope {
 public:
  SerialOpenMpScope() : saved_(omp_get_max_active_levels()) { omp_set_max_active_levels(0); }
  ~SerialOpenMpScope() { omp_set_max_active_levels(saved_); }
  SerialOpenMpScope(const SerialOpenMpScope&) = delete;
  SerialOpenMpScope& operator=(const SerialOpenMpScope&) = delete;

 private:
  int saved_;
};

}  // namespace

Status OcrOptions::Validate() const {
  if (languages.empty()) return InvalidArgument("ocr languages must not be empty", kInvalidOptions);
  for (const std::string& code : SplitLanguages(languages)) {
    if (!IsValidLanguageCode(code)) {
      return InvalidArgument("bad ocr language code '" + code + "' in '" + languages +
                                 "' (expected codes like eng, vie, eng+vie)",
                             kInvalidOptions);
    }
  }
  if (psm < 3 || psm > 13) {
    return InvalidArgument("ocr psm must be 3..13 (0..2 need the OSD model or do no recognition), got " +
                               std::to_string(psm),
                           kInvalidOptions);
  }
  if (dpi != 0 && (dpi < 70 || dpi > 2400)) {
    return InvalidArgument("ocr dpi must be 0 or 70..2400, got " + std::to_string(dpi),
                           kInvalidOptions);
  }
  if (max_pixels <= 0) return InvalidArgument("ocr max_pixels must be positive", kInvalidOptions);
  return Status::Ok();
}

std::string DefaultTessdataDir() {
  static const char* const kCandidates[] = {
      "/usr/share/tesseract-ocr/5/tessdata",     // Debian 12, Ubuntu 22.04+
      "/usr/share/tesseract-ocr/4.00/tessdata",  // Debian 10/11
      "/usr/share/tessdata",                     // Fedora, Arch
      "/usr/local/share/tessdata",               // upstream `make install`
  };
  for (const char* dir : kCandidates) {
    if (IsDirectory(dir)) return dir;
  }
  return {};
}

struct TesseractOcr::Impl {
  OcrOptions options;
  tesseract::TessBaseAPI api;
};

TesseractOcr::TesseractOcr(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TesseractOcr::~TesseractOcr() {
  if (impl_) impl_->api.End();
}

const OcrOptions& TesseractOcr::options() const { return impl_->options; }

Result<std::unique_ptr<TesseractOcr>> TesseractOcr::Create(const OcrOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  SilenceLeptonica();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  std::string& dir = impl->options.tessdata_dir;
  if (dir.empty()) dir = DefaultTessdataDir();
  if (dir.empty()) {
    return NotFound("no tessdata directory found (install tesseract-ocr-eng or set tessdata_dir)",
                    "tessdata_not_found");
  }
  if (!IsDirectory(dir)) {
    return NotFound("tessdata directory '" + dir + "' does not exist", "tessdata_not_found");
  }
  // Checked here because Tesseract's own failure is a line on stderr and -1.
  for (const std::string& code : SplitLanguages(options.languages)) {
    std::string file = dir + "/" + code + ".traineddata";
    if (!IsFile(file)) {
      return NotFound("ocr language '" + code + "' is not installed (no " + file + ")",
                      "ocr_language_not_found");
    }
  }
  // debug_file takes Tesseract's progress and warning lines ("Estimating
  // resolution as ...") off stderr; it must be set before Init to cover it.
  std::vector<std::string> names = {"debug_file"};
  std::vector<std::string> values = {"/dev/null"};
  int rc = -1;
  try {
    rc = impl->api.Init(dir.c_str(), options.languages.c_str(), tesseract::OEM_DEFAULT, nullptr,
                        0, &names, &values, false);
  } catch (const std::exception& e) {
    return Status(StatusCode::kBadGateway,
                  std::string("tesseract failed to load '") + options.languages + "': " + e.what(),
                  "ocr_load_failed");
  }
  if (rc != 0) {
    return Status(StatusCode::kBadGateway,
                  "tesseract failed to load '" + options.languages + "' from " + dir,
                  "ocr_load_failed");
  }
  impl->api.SetPageSegMode(static_cast<tesseract::PageSegMode>(options.psm));
  return std::unique_ptr<TesseractOcr>(new TesseractOcr(std::move(impl)));
}

Result<OcrResult> TesseractOcr::Recognize(std::string_view image_bytes, int64_t deadline_unix_ms) {
  // Wall-clock ms left before the caller stops waiting; > 0 when there is
  // a deadline and it has not passed.
  const auto ms_left = [deadline_unix_ms] { return deadline_unix_ms - SystemClock::Get()->NowUnixMs(); };
  const auto too_late = [] { return DeadlineExceeded("the request's deadline passed during OCR"); };
  if (deadline_unix_ms > 0 && ms_left() <= 0) return DeadlineExceeded("deadline passed before the work was run");
  if (image_bytes.empty()) return InvalidArgument("image is empty", kInvalidImage);
  // Leptonica sniffs the format from the first 12 bytes and reads them
  // without a length check.
  if (image_bytes.size() < 12) {
    return InvalidArgument("image is too short to be an image (" +
                               std::to_string(image_bytes.size()) + " bytes)",
                           kInvalidImage);
  }
  const auto* data = reinterpret_cast<const l_uint8*>(image_bytes.data());
  const size_t size = image_bytes.size();

  // The header gives the format and size before anything is allocated, so
  // decompression bombs are refused cheaply.
  l_int32 format = IFF_UNKNOWN, w = 0, h = 0, bps = 0, spp = 0, iscmap = 0;
  if (findFileFormatBuffer(data, &format) != 0 || format == IFF_UNKNOWN) {
    return InvalidArgument("not an image (expected PNG, JPEG, TIFF, BMP or PNM)", kInvalidImage);
  }
  if (!IsAcceptedFormat(format)) {
    return Status(StatusCode::kUnsupportedMedia,
                  std::string("image format '") + getFormatExtension(format) +
                      "' is not supported (expected PNG, JPEG, TIFF, BMP or PNM)",
                  "unsupported_image_format");
  }
  if (format == IFF_BMP && IsCoreHeaderBmp(image_bytes)) {
    return Status(StatusCode::kUnsupportedMedia,
                  "OS/2 1.x BMP (12-byte BITMAPCOREHEADER) is not supported: save it as a Windows BMP, or as PNG",
                  "unsupported_image_format");
  }
  // Leptonica reads a BMP's header by decoding the whole image; its size is
  // read here instead, so a BMP is decoded once, after the checks below.
  const bool header_read = format == IFF_BMP ? BmpSize(image_bytes, &w, &h)
                                             : pixReadHeaderMem(data, size, &format, &w, &h, &bps, &spp, &iscmap) == 0;
  if (!header_read || w <= 0 || h <= 0) {
    return InvalidArgument("image header is corrupt or truncated", kInvalidImage);
  }
  const OcrOptions& opt = impl_->options;
  // Tesseract refuses a side over 32767 pixels ("Image too large"), which
  // would be a 500 from Recognize below; it is the image's fault.
  constexpr l_int32 kMaxSide = 32767;
  if (w > kMaxSide || h > kMaxSide) {
    return InvalidArgument("image is " + std::to_string(w) + "x" + std::to_string(h) + ": OCR takes at most " +
                               std::to_string(kMaxSide) + " pixels a side",
                           "image_too_large");
  }
  if (int64_t{w} * h > opt.max_pixels) {
    return InvalidArgument("image is " + std::to_string(w) + "x" + std::to_string(h) +
                               ", over the limit of " + std::to_string(opt.max_pixels) +
                               " pixels",
                           "image_too_large");
  }

  PixPtr pix(pixReadMem(data, size));
  if (!pix) return InvalidArgument("image data is corrupt or truncated", kInvalidImage);
  pix = Normalize(std::move(pix));
  if (!pix) return InvalidArgument("image could not be converted for OCR", kInvalidImage);

  OcrResult result;
  result.width = static_cast<int>(pixGetWidth(pix.get()));
  result.height = static_cast<int>(pixGetHeight(pix.get()));
  tesseract::TessBaseAPI& api = impl_->api;
  std::optional<SerialOpenMpScope> serial;
  if (!opt.parallel) serial.emplace();
  try {
    api.SetImage(pix.get());
    if (opt.dpi > 0) api.SetSourceResolution(opt.dpi);
    // Tesseract checks the monitor's deadline before each word and stops
    // (Recognize fails) once it has passed.
    tesseract::ETEXT_DESC monitor;
    if (deadline_unix_ms > 0) {
      const int64_t left = ms_left();
      if (left <= 0) {
        api.Clear();
        return too_late();
      }
      monitor.set_deadline_msecs(static_cast<int32_t>(std::min<int64_t>(left, std::numeric_limits<int32_t>::max())));
    }
    if (api.Recognize(deadline_unix_ms > 0 ? &monitor : nullptr) != 0) {
      api.Clear();
      if (deadline_unix_ms > 0 && monitor.deadline_exceeded()) return too_late();
      return Internal("tesseract could not recognise the image", "ocr_failed");
    }
    TextPtr text(api.GetUTF8Text());
    if (text) result.text = text.get();

    std::unique_ptr<tesseract::ResultIterator> it(api.GetIterator());
    if (it) {
      const auto word_level = tesseract::RIL_WORD;
      int block = -1, line = -1;
      do {
        // Counted before the emptiness test so indices follow the layout
        // even when a line starts with a non-text region.
        if (it->IsAtBeginningOf(tesseract::RIL_BLOCK)) ++block;
        if (it->IsAtBeginningOf(tesseract::RIL_TEXTLINE)) ++line;
        if (it->Empty(word_level)) continue;
        TextPtr word(it->GetUTF8Text(word_level));
        if (!word || word.get()[0] == '\0') continue;
        int left = 0, top = 0, right = 0, bottom = 0;
        if (!it->BoundingBox(word_level, &left, &top, &right, &bottom)) continue;
        left = std::clamp(left, 0, result.width);
        right = std::clamp(right, left, result.width);
        top = std::clamp(top, 0, result.height);
        bottom = std::clamp(bottom, top, result.height);
        OcrWord out;
        out.text = word.get();
        out.box = {left, top, right - left, bottom - top};
        out.confidence = std::clamp(it->Confidence(word_level) / 100.0f, 0.0f, 1.0f);
        out.block = std::max(block, 0);
        out.line = std::max(line, 0);
        result.words.push_back(std::move(out));
      } while (it->Next(word_level));
    }
  } catch (const std::exception& e) {
    api.Clear();
    return Internal(std::string("tesseract failed: ") + e.what(), "ocr_failed");
  }
  // Drops the page's results and the image reference; the languages stay.
  api.Clear();
  return result;
}

Result<OcrOptions> ParseOcrOptions(std::string_view shoal_json, const std::string& model_dir) {
  OcrOptions o;
  try {
    nlohmann::json doc = nlohmann::json::parse(shoal_json);
    if (!doc.is_object()) return InvalidArgument("shoal.json is not an object", kInvalidOptions);
    auto found = doc.find("ocr");
    if (found != doc.end()) {
      const nlohmann::json& ocr = *found;
      if (!ocr.is_object()) return InvalidArgument("\"ocr\" must be an object", kInvalidOptions);
      for (const auto& [key, value] : ocr.items()) {
        if (key == "languages" && value.is_string()) {
          o.languages = value.get<std::string>();
        } else if (key == "tessdata_dir" && value.is_string()) {
          o.tessdata_dir = value.get<std::string>();
        } else if (key == "psm" && IntegerAs<int>(value)) {
          o.psm = *IntegerAs<int>(value);
        } else if (key == "dpi" && IntegerAs<int>(value)) {
          o.dpi = *IntegerAs<int>(value);
        } else if (key == "max_pixels" && value.is_number_integer()) {
          o.max_pixels = value.get<int64_t>();
        } else if (key == "parallel" && value.is_boolean()) {
          o.parallel = value.get<bool>();
        } else {
          return InvalidArgument("unknown or mistyped key \"ocr." + key + "\"", kInvalidOptions);
        }
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(std::string("shoal.json: ") + e.what(), kInvalidOptions);
  }
  if (!o.tessdata_dir.empty() && o.tessdata_dir[0] != '/' && !model_dir.empty()) {
    o.tessdata_dir = model_dir + "/" + o.tessdata_dir;
  }
  RETURN_IF_ERROR(o.Validate());
  return o;
}

Result<OcrResult> RecognizeImage(const OcrOptions& options, std::string_view image_bytes) {
  auto engine = TesseractOcr::Create(options);
  if (!engine.ok()) return engine.status();
  return (*engine)->Recognize(image_bytes);
}

}  // namespace shoal
