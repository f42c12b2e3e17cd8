#include "gateway/internal/http_json.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>

#include "common/bounded_json.h"
#include "common/utf8.h"

namespace shoal::internal {

using nlohmann::json;

void AppendJsonString(std::string& out, std::string_view s) {
  out.push_back('"');
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      // Messages can quote a client's bytes: a byte that is not part of
      // well-formed UTF-8 becomes U+FFFD, so the body stays valid JSON.
      size_t next = i;
      AppendUtf8(DecodeUtf8(s, &next), &out);
      i = next - 1;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

void AppendFloat(std::string& out, float v) {
  char buf[32];
  float f = std::isfinite(v) ? v : 0.0f;  // JSON has no NaN/Inf
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, f);
  out.append(buf, p);
}

void AppendFloats(std::string& out, const float* v, int n) {
  out.push_back('[');
  for (int i = 0; i < n; ++i) {
    if (i) out.push_back(',');
    AppendFloat(out, v[i]);
  }
  out.push_back(']');
}

HttpResponse JsonResponse(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}


Status ParseJsonObject(const std::string& text, json* out) {
  RETURN_IF_ERROR(ParseBoundedJson(text, "request body", {kMaxRequestDepth, kMaxRequestValues}, out));
  if (!out->is_object()) return InvalidArgument("request body must be a JSON object", "invalid_json");
  return Status::Ok();
}

Status CheckMsgpackBody(std::string_view body, bool binary_allowed) {
  return CheckBoundedMsgpack(body, "request body", {kMaxRequestDepth, kMaxRequestValues}, binary_allowed);
}

namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool IEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

}  // namespace

bool IsMsgpackType(std::string_view content_type) {
  const std::string_view type = Trim(content_type.substr(0, content_type.find(';')));
  return IEquals(type, "application/msgpack") || IEquals(type, "application/x-msgpack") ||
         IEquals(type, "application/vnd.msgpack");
}

bool AcceptsMsgpack(std::string_view accept) {
  double msgpack = -1, json = -1, application_any = -1, any = -1;
  while (!accept.empty()) {
    const size_t comma = accept.find(',');
    std::string_view range = accept.substr(0, comma);
    accept = comma == std::string_view::npos ? std::string_view() : accept.substr(comma + 1);
    const std::string_view type = Trim(range.substr(0, range.find(';')));
    double q = 1;
    for (size_t semi = range.find(';'); semi != std::string_view::npos;) {
      range = range.substr(semi + 1);
      semi = range.find(';');
      const std::string_view param = Trim(range.substr(0, semi));
      if (param.size() > 2 && (param[0] == 'q' || param[0] == 'Q') && param[1] == '=') {
        double v = 0;
        const auto [end, ec] = std::from_chars(param.data() + 2, param.data() + param.size(), v);
        q = ec == std::errc() && end == param.data() + param.size() ? std::clamp(v, 0.0, 1.0) : 0;
      }
    }
    double* slot = IsMsgpackType(type)                     ? &msgpack
                   : IEquals(type, "application/json")     ? &json
                   : IEquals(type, "application/*")        ? &application_any
                   : type == "*/*"                         ? &any
                                                           : nullptr;
    if (slot != nullptr) *slot = std::max(*slot, q);
  }
  const double json_q = json >= 0 ? json : application_any >= 0 ? application_any : std::max(any, 0.0);
  return msgpack > 0 && msgpack >= json_q;
}

std::string ResponseId(std::string_view prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return std::string(prefix) + "-" + buf;
}

}  // namespace shoal::internal
