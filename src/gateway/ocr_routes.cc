// POST /v1/ocr/{model}: images in (MessagePack, multipart/form-data, JSON
// with base64 or data: URLs, or one raw image/* body), one ItemJob whose
// items are the encoded images, text with word boxes out (JSON, or
// MessagePack when Accept asks). The gateway only sniffs the format from
// the first bytes, so a file that is plainly not an image, or a format the
// worker does not decode, is refused before it is queued; decoding and
// recognition happen on the worker.
#include <cstring>

#include <msgpack.hpp>
#include <nlohmann/json.hpp>

#include "common/bounded_json.h"
#include "gateway/internal/http_json.h"
#include "gateway/routes.h"

namespace shoal {
namespace {

using internal::AppendFloat;
using internal::AppendJsonString;
using internal::JsonResponse;
using internal::ParseJsonObject;
using nlohmann::json;

// The media type of a Content-Type value, lower-cased, without parameters.
std::string MediaType(std::string_view content_type) {
  std::string t(content_type.substr(0, content_type.find(';')));
  while (!t.empty() && (t.back() == ' ' || t.back() == '\t')) t.pop_back();
  size_t i = 0;
  while (i < t.size() && (t[i] == ' ' || t[i] == '\t')) ++i;
  t.erase(0, i);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

// The value of parameter `name` in a header value ("...; boundary=xyz").
// A quoted value (RFC 9110 quoted-string, backslash escapes) may hold ';'
// and '=': the search for the next parameter resumes after it.
std::string HeaderParam(std::string_view value, std::string_view name) {
  size_t pos = value.find(';');
  while (pos != std::string_view::npos) {
    ++pos;
    while (pos < value.size() && value[pos] == ' ') ++pos;
    const size_t eq = value.find('=', pos);
    if (eq == std::string_view::npos) break;
    std::string key(value.substr(pos, eq - pos));
    while (!key.empty() && key.back() == ' ') key.pop_back();
    for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    size_t at = eq + 1;
    while (at < value.size() && value[at] == ' ') ++at;
    std::string v;
    if (at < value.size() && value[at] == '"') {
      for (++at; at < value.size() && value[at] != '"'; ++at) {
        if (value[at] == '\\' && at + 1 < value.size()) ++at;
        v += value[at];
      }
      pos = at < value.size() ? value.find(';', at + 1) : std::string_view::npos;
    } else {
      const size_t semi = value.find(';', at);
      v = std::string(value.substr(at, semi == std::string_view::npos ? semi : semi - at));
      while (!v.empty() && v.back() == ' ') v.pop_back();
      pos = semi;
    }
    if (key == name) return v;
  }
  return {};
}

// Standard or URL-safe base64, padding optional, whitespace ignored.
bool DecodeBase64(std::string_view in, std::string* out) {
  auto value = [](unsigned char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  out->clear();
  out->reserve(in.size() / 4 * 3 + 3);
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (unsigned char c : in) {
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    if (c == '=') {
      ++pad;
      continue;
    }
    if (pad > 0) return false;  // data after padding
    const int v = value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return pad <= 2 && bits < 6;
}

// Image formats by their first bytes: OK for the formats the OCR runtime
// decodes, UnsupportedMedia for other image formats, InvalidArgument else.
Status SniffImage(std::string_view b, size_t index) {
  const std::string which = "image " + std::to_string(index);
  if (b.empty()) return InvalidArgument(which + " is empty", "invalid_image");
  auto starts = [&](std::string_view magic) { return b.substr(0, magic.size()) == magic; };
  using namespace std::string_view_literals;
  if (starts("\x89PNG\r\n\x1a\n"sv) || starts("\xFF\xD8\xFF"sv) || starts("II*\0"sv) || starts("MM\0*"sv) ||
      starts("BM"sv))
    return Status::Ok();
  if (b.size() >= 2 && b[0] == 'P' && b[1] >= '1' && b[1] <= '6') return Status::Ok();
  const char* other = nullptr;
  if (starts("GIF87a") || starts("GIF89a")) other = "GIF";
  if (b.size() >= 12 && starts("RIFF") && b.substr(8, 4) == "WEBP") other = "WebP";
  if (starts("\0\0\0\x0CjP  "sv) || starts("\xFF\x4F\xFF\x51"sv)) other = "JPEG 2000";
  if (b.size() >= 12 && b.substr(4, 4) == "ftyp") other = "HEIF/AVIF";
  if (starts("%PDF")) other = "PDF";
  if (other)
    return Status(StatusCode::kUnsupportedMedia,
                  which + " is " + other + "; OCR takes PNG, JPEG, TIFF, BMP or PNM", "unsupported_image_format");
  return InvalidArgument(which + " is not an image (PNG, JPEG, TIFF, BMP or PNM expected)", "invalid_image");
}

// {image: bin} or {images: [bin, ...]}.
Status ImagesFromMsgpack(const std::string& body, std::vector<std::string>* out) {
  RETURN_IF_ERROR(internal::CheckMsgpackBody(body, /*binary_allowed=*/true));
  msgpack::object_handle handle;
  try {
    // Bins point into `body` (alive until the images are copied out below)
    // instead of into a copy in the handle's zone.
    handle = msgpack::unpack(body.data(), body.size(),
                             [](msgpack::type::object_type, std::size_t, void*) { return true; });
  } catch (const std::exception& e) {
    return InvalidArgument(std::string("request body is not valid MessagePack: ") + e.what(), "invalid_msgpack");
  }
  const msgpack::object& root = handle.get();
  if (root.type != msgpack::type::MAP) return InvalidArgument("request body must be a MessagePack map", "invalid_msgpack");
  auto take = [&](const msgpack::object& v, const std::string& where) -> Status {
    if (v.type == msgpack::type::BIN) {
      out->emplace_back(v.via.bin.ptr, v.via.bin.size);
      return Status::Ok();
    }
    return InvalidArgument(where + " must be binary (MessagePack bin) image bytes", "invalid_image");
  };
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const auto& kv = root.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) continue;
    std::string_view k(kv.key.via.str.ptr, kv.key.via.str.size);
    if (k == "image") {
      RETURN_IF_ERROR(take(kv.val, "'image'"));
    } else if (k == "images") {
      if (kv.val.type != msgpack::type::ARRAY || kv.val.via.array.size == 0)
        return InvalidArgument("'images' must be a non-empty array of bin", "invalid_image");
      for (uint32_t j = 0; j < kv.val.via.array.size; ++j)
        RETURN_IF_ERROR(take(kv.val.via.array.ptr[j], "images[" + std::to_string(j) + "]"));
    }
  }
  return Status::Ok();
}

// One JSON image: base64, or a data: URL with base64 content.
Status ImageFromJson(const json& v, const std::string& where, std::vector<std::string>* out) {
  if (!v.is_string()) return InvalidArgument(where + " must be a base64 string or a data: URL", "invalid_image");
  std::string_view s = v.get_ref<const std::string&>();
  if (s.substr(0, 5) == "data:") {
    const size_t comma = s.find(',');
    if (comma == std::string_view::npos || s.substr(0, comma).find(";base64") == std::string_view::npos)
      return InvalidArgument(where + " is a data: URL without ';base64,' content", "invalid_image");
    s = s.substr(comma + 1);
  }
  std::string bytes;
  if (!DecodeBase64(s, &bytes)) return InvalidArgument(where + " is not valid base64", "invalid_image");
  out->push_back(std::move(bytes));
  return Status::Ok();
}

Status ImagesFromJson(const std::string& body, std::vector<std::string>* out) {
  json doc;
  RETURN_IF_ERROR(ParseJsonObject(body, &doc));
  if (auto it = doc.find("image"); it != doc.end() && !it->is_null()) RETURN_IF_ERROR(ImageFromJson(*it, "'image'", out));
  if (auto it = doc.find("images"); it != doc.end() && !it->is_null()) {
    if (!it->is_array() || it->empty())
      return InvalidArgument("'images' must be a non-empty array of base64 strings", "invalid_image");
    for (size_t i = 0; i < it->size(); ++i)
      RETURN_IF_ERROR(ImageFromJson((*it)[i], "images[" + std::to_string(i) + "]", out));
  }
  return Status::Ok();
}

// multipart/form-data (RFC 7578): every part named image, images or file.
Status ImagesFromMultipart(const std::string& body, std::string_view content_type, std::vector<std::string>* out) {
  const std::string boundary = HeaderParam(content_type, "boundary");
  if (boundary.empty()) return InvalidArgument("multipart/form-data without a boundary", "invalid_multipart");
  const std::string delim = "--" + boundary;
  size_t pos = body.find(delim);
  if (pos == std::string::npos) return InvalidArgument("multipart body without its boundary", "invalid_multipart");
  pos += delim.size();
  while (true) {
    if (body.compare(pos, 2, "--") == 0) break;  // closing delimiter
    if (body.compare(pos, 2, "\r\n") != 0) return InvalidArgument("malformed multipart body", "invalid_multipart");
    pos += 2;
    const size_t head_end = body.find("\r\n\r\n", pos);
    if (head_end == std::string::npos) return InvalidArgument("malformed multipart part headers", "invalid_multipart");
    std::string headers = body.substr(pos, head_end - pos);
    const size_t data = head_end + 4;
    const size_t next = body.find("\r\n" + delim, data);
    if (next == std::string::npos) return InvalidArgument("unterminated multipart part", "invalid_multipart");
    std::string lower = headers;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const size_t cd = lower.find("content-disposition:");
    if (cd != std::string::npos) {
      size_t line_end = headers.find("\r\n", cd);
      std::string_view disp(headers.data() + cd, (line_end == std::string::npos ? headers.size() : line_end) - cd);
      const std::string name = HeaderParam(disp, "name");
      if (name == "image" || name == "images" || name == "file" || name == "images[]" || name == "file[]")
        out->push_back(body.substr(data, next - data));
    }
    pos = next + 2 + delim.size();
  }
  return Status::Ok();
}

// Appends a MessagePack value as JSON (bin as base64 text).
void AppendMsgpackJson(std::string& out, const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: out += "null"; break;
    case msgpack::type::BOOLEAN: out += o.via.boolean ? "true" : "false"; break;
    case msgpack::type::POSITIVE_INTEGER: out += std::to_string(o.via.u64); break;
    case msgpack::type::NEGATIVE_INTEGER: out += std::to_string(o.via.i64); break;
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: AppendFloat(out, static_cast<float>(o.via.f64)); break;
    case msgpack::type::STR: AppendJsonString(out, std::string_view(o.via.str.ptr, o.via.str.size)); break;
    case msgpack::type::ARRAY:
      out.push_back('[');
      for (uint32_t i = 0; i < o.via.array.size; ++i) {
        if (i) out.push_back(',');
        AppendMsgpackJson(out, o.via.array.ptr[i]);
      }
      out.push_back(']');
      break;
    case msgpack::type::MAP:
      out.push_back('{');
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        if (i) out.push_back(',');
        const auto& k = o.via.map.ptr[i].key;
        if (k.type == msgpack::type::STR) {
          AppendJsonString(out, std::string_view(k.via.str.ptr, k.via.str.size));
        } else {
          std::string key;
          AppendMsgpackJson(key, k);
          AppendJsonString(out, key);
        }
        out.push_back(':');
        AppendMsgpackJson(out, o.via.map.ptr[i].val);
      }
      out.push_back('}');
      break;
    default: out += "null"; break;  // bin and ext do not occur in OCR results
  }
}

// A worker's OCR result the gateway cannot use: 502, as any unusable reply.
Status BadOcrResult(const std::string& message) {
  return Status(StatusCode::kBadGateway, message, "bad_worker_reply");
}

// The response body; 502 bad_worker_reply when a worker's document is
// unreadable.
Result<HttpResponse> RenderOcr(const std::string& model, const std::vector<std::string>& docs, bool msgpack_out) {
  std::vector<msgpack::object_handle> handles;
  handles.reserve(docs.size());
  for (size_t i = 0; i < docs.size(); ++i) {
    // Anything on NATS can publish to a reply subject, and the rendering
    // below recurses once per level.
    if (Status bounded = CheckBoundedMsgpack(docs[i], "the worker's OCR result for image " + std::to_string(i),
                                             MsgpackBoundsFor(kMaxAnswerValues), /*binary_allowed=*/true);
        !bounded.ok()) {
      return BadOcrResult(bounded.message());
    }
    try {
      handles.push_back(msgpack::unpack(docs[i].data(), docs[i].size()));
    } catch (const std::exception& e) {
      return BadOcrResult("worker returned an unreadable OCR result for image " + std::to_string(i) + ": " +
                          e.what());
    }
    if (handles.back().get().type != msgpack::type::MAP)
      return BadOcrResult("worker returned an OCR result for image " + std::to_string(i) + " that is not a map");
  }
  HttpResponse r;
  if (msgpack_out) {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer> pk(buf);
    pk.pack_map(3);
    pk.pack(std::string_view("object"));
    pk.pack(std::string_view("list"));
    pk.pack(std::string_view("model"));
    pk.pack(std::string_view(model));
    pk.pack(std::string_view("data"));
    pk.pack_array(static_cast<uint32_t>(handles.size()));
    for (size_t i = 0; i < handles.size(); ++i) {
      const auto& m = handles[i].get().via.map;
      pk.pack_map(m.size + 1);
      pk.pack(std::string_view("index"));
      pk.pack(static_cast<uint64_t>(i));
      for (uint32_t k = 0; k < m.size; ++k) {
        pk.pack(m.ptr[k].key);
        pk.pack(m.ptr[k].val);
      }
    }
    r.content_type = "application/msgpack";
    r.body.assign(buf.data(), buf.size());
    return r;
  }
  std::string out = "{\"object\":\"list\",\"model\":";
  AppendJsonString(out, model);
  out += ",\"data\":[";
  for (size_t i = 0; i < handles.size(); ++i) {
    if (i) out.push_back(',');
    std::string doc;
    AppendMsgpackJson(doc, handles[i].get());
    out += "{\"index\":" + std::to_string(i);
    if (doc.size() > 2) out += "," + doc.substr(1);  // the document's fields after the index
    else out += "}";
  }
  out += "]}";
  return JsonResponse(200, std::move(out));
}

}  // namespace

Status Router::ImagesFromRequest(HttpRequest& req, std::vector<std::string>* images) const {
  const std::string_view content_type = req.Header("content-type");
  const std::string type = MediaType(content_type);
  // Bodies the images are copied out of are freed at once: the request
  // lives until it is answered, and would hold a second copy of every
  // image while the work message is encoded and stored.
  auto release_body = [&req] { std::string().swap(req.body); };
  if (internal::IsMsgpackType(type)) {
    RETURN_IF_ERROR(ImagesFromMsgpack(req.body, images));
    release_body();
  } else if (type == "multipart/form-data") {
    RETURN_IF_ERROR(ImagesFromMultipart(req.body, content_type, images));
    release_body();
  } else if (type == "application/json" || type.empty()) {
    RETURN_IF_ERROR(ImagesFromJson(req.body, images));
    release_body();
  } else if (type.compare(0, 6, "image/") == 0 || type == "application/octet-stream") {
    images->push_back(std::move(req.body));  // the body is the image: no copy
  } else {
    return Status(StatusCode::kUnsupportedMedia,
                  "Content-Type " + type +
                      " is not accepted; send image/*, application/msgpack, multipart/form-data or application/json",
                  "unsupported_media_type");
  }
  if (images->empty())
    return InvalidArgument("no image in the request: send 'image' or 'images' (multipart: parts named image, images, file, images[] or file[])",
                           "missing_image");
  if (static_cast<int>(images->size()) > options_.max_inputs)
    return InvalidArgument("too many images: " + std::to_string(images->size()) + " (at most " +
                               std::to_string(options_.max_inputs) + " per request)",
                           "too_many_inputs");
  for (size_t i = 0; i < images->size(); ++i) RETURN_IF_ERROR(SniffImage((*images)[i], i));
  return Status::Ok();
}

void Router::Ocr(const std::string& model, HttpRequest&& req, HttpResponder respond) {
  const int64_t retry = options_.retry_after_s;
  ItemJob job;
  job.task = "ocr";
  job.model = model;
  job.item_name = "image";
  if (Status st = CheckModel(model, "ocr", nullptr); !st.ok()) return respond(ErrorResponse(st, retry));
  auto deadline = Deadline(req);
  if (!deadline.ok()) return respond(ErrorResponse(deadline.status()));
  job.deadline_unix_ms = *deadline;
  job.client = req.client;  // a client that leaves stops the images not yet read (ItemJob::client)
  const bool msgpack_out = internal::AcceptsMsgpack(req.Header("accept"));
  if (Status st = ImagesFromRequest(req, &job.items); !st.ok()) return respond(ErrorResponse(st));
  submitter_->SubmitItems(std::move(job), [respond = std::move(respond), model, retry,
                                           msgpack_out](Result<ItemResult> result) {
    if (!result.ok()) return respond(ErrorResponse(result.status(), retry));
    auto r = RenderOcr(model, result->items, msgpack_out);
    if (!r.ok()) return respond(ErrorResponse(r.status(), retry));
    respond(std::move(*r));
  });
}

}  // namespace shoal
