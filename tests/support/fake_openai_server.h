// FakeOpenAiServer: a tiny real HTTP/1.1 server on 127.0.0.1 (random port)
// for tests of HTTP clients such as `shoal bench` and the openai runtime.
// Keep-alive, a thread per connection, every request recorded; a handler
// chooses each answer (the default answers /v1/embeddings in OpenAI shape),
// which may be delayed or streamed as server-sent events. Built once in
// shoal_test_support, so the tests that use it do not compile Beast.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shoal::testing {

class FakeOpenAiServer {
 public:
  struct Request {
    std::string method;
    std::string target;
    std::string body;
    std::string authorization;
  };
  struct Reply {
    int status = 200;
    std::string body;
    bool close = false;  // answer with Connection: close, then close
    bool hang_up = false;  // answer as keep-alive, then close anyway (a stale pooled connection)
    std::string content_type = "application/json";
    int64_t delay_ms = 0;  // wait this long before answering
    // Written as is before the answer: interim answers such as
    // "HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n".
    std::string interim{};
    // Non-empty: answer text/event-stream, chunked, one "data: <event>"
    // per element written (and flushed) `event_delay_ms` apart; `body` is
    // then ignored.
    std::vector<std::string> events{};
    int64_t event_delay_ms = 0;
    // After the events, keep the response open (no last chunk) until the
    // client closes the connection.
    bool stall_after_events = false;
    // After the events, close the connection without ending the response
    // (no last chunk): a stream that broke.
    bool break_after_events = false;
  };
  using Handler = std::function<Reply(const Request&)>;

  // An OpenAI embeddings answer for `body` ({"model", "input": [..]}), one
  // 2-d vector per input, usage.prompt_tokens = number of words.
  static Reply Embeddings(const std::string& body);

  explicit FakeOpenAiServer(Handler handler);
  ~FakeOpenAiServer();
  FakeOpenAiServer(const FakeOpenAiServer&) = delete;
  FakeOpenAiServer& operator=(const FakeOpenAiServer&) = delete;

  int port() const;
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port()); }
  std::vector<Request> requests() const;
  // Answers the client closed the connection before they were complete:
  // during their delay_ms, or before the last event of their stream.
  int cut() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::testing
