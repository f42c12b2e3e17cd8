// SseParser: splits a text/event-stream body, fed in pieces of any size,
// into events and hands each event's data (its "data:" lines joined by
// '\n') to a callback. Comments, other fields and events without data are
// skipped. Not thread-safe.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace shoal {

class SseParser {
 public:
  // Returning false stops the parse: Feed() then returns false too.
  using EventFn = std::function<bool(std::string_view data)>;
  explicit SseParser(EventFn on_event) : on_event_(std::move(on_event)) {}
  // Consumes `bytes`; calls on_event for every event completed by them.
  bool Feed(std::string_view bytes);
  // Ends the stream: an event not yet closed by a blank line counts.
  bool Finish();

 private:
  bool Line(std::string_view line);
  EventFn on_event_;
  std::string pending_;  // bytes of an unfinished line (no '\n' in them)
  std::string data_;     // data of the current event
  bool has_data_ = false;
};

}  // namespace shoal
