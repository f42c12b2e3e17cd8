#include "runtime/openai/sse_parser.h"

namespace shoal {

bool SseParser::Feed(std::string_view bytes) {
  // What was pending holds no line break: look only at the new bytes (a long
  // line fed in small pieces was rescanned from its start on every piece).
  size_t scan = pending_.size();
  pending_.append(bytes);
  size_t start = 0;
  for (;;) {
    const size_t nl = pending_.find('\n', scan);
    if (nl == std::string::npos) break;
    std::string_view line(pending_.data() + start, nl - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    start = scan = nl + 1;
    if (!Line(line)) {
      pending_.erase(0, start);
      return false;
    }
  }
  pending_.erase(0, start);
  return true;
}

bool SseParser::Finish() {
  if (!pending_.empty()) {
    std::string last = std::move(pending_);
    pending_.clear();
    if (!last.empty() && last.back() == '\r') last.pop_back();  // a CRLF cut after its CR
    if (!Line(last)) return false;
  }
  return Line({});
}

bool SseParser::Line(std::string_view line) {
  if (line.empty()) {  // end of an event
    if (!has_data_) return true;
    has_data_ = false;
    std::string data = std::move(data_);
    data_.clear();
    return on_event_(data);
  }
  if (line.front() == ':') return true;  // comment (keep-alive)
  const size_t colon = line.find(':');
  std::string_view field = line.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
  if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (field != "data") return true;
  if (has_data_) data_.push_back('\n');
  data_.append(value);
  has_data_ = true;
  return true;
}

}  // namespace shoal
