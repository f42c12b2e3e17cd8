#include "gateway/internal/http_json.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <random>

namespace shoal::internal {

using nlohmann::json;

void AppendJsonString(std::string& out, std::string_view s) {
  out.push_back('"');
  for (unsigned char c : s) {
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
  try {
    *out = json::parse(text);
  } catch (const json::exception& e) {
    return InvalidArgument(std::string("request body is not valid JSON: ") + e.what(), "invalid_json");
  }
  if (!out->is_object()) return InvalidArgument("request body must be a JSON object", "invalid_json");
  return Status::Ok();
}

std::string ResponseId(std::string_view prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return std::string(prefix) + "-" + buf;
}

}  // namespace shoal::internal
