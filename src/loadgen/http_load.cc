#include "loadgen/http_load.h"

#include <netinet/tcp.h>
#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <latch>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace shoal::loadgen {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using Time = Clock::time_point;

// nullopt once the thread has ended (its clock is gone with it).
std::optional<double> ThreadCpuSeconds(clockid_t id) {
  timespec ts{};
  if (clock_gettime(id, &ts) != 0) return std::nullopt;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// Reads "prompt_tokens":N (blanks allowed before N) near the end of an
// OpenAI embeddings response.
int64_t PromptTokens(const std::string& body) {
  static constexpr std::string_view kKey = "\"prompt_tokens\":";
  const size_t at = body.rfind(kKey);
  if (at == std::string::npos) return 0;
  int64_t v = 0;
  const char* p = body.data() + at + kKey.size();
  const char* end = body.data() + body.size();
  while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) ++p;  // pretty-printed JSON
  std::from_chars(p, end, v);
  return v;
}

struct Shared;
class Conn;

constexpr size_t kNoRequest = static_cast<size_t>(-1);

// Everything one client thread owns; touched only from its io_context.
struct ThreadState {
  asio::io_context io{1};
  Shared* shared = nullptr;
  clockid_t cpu_clock{};
  // The thread's CPU time as it ends: its clock cannot be read once it has
  // (a closed-loop thread ends when its last answer after the window comes,
  // which may be before thread 0 reads every clock at the window's end).
  std::atomic<double> cpu_at_exit{-1};
  size_t next_request = 0;
  std::vector<std::shared_ptr<Conn>> conns;
  std::vector<Conn*> idle;  // open loop: connected and free
  std::vector<double> latencies_ms;
  int64_t completed = 0, errors = 0, dropped = 0, prompt_tokens = 0;
  int64_t due = 0;  // open loop: arrivals in the window
  int64_t answered_in_window = 0;  // 200s that arrived in the window, whenever due
  int64_t answered_after_window = 0;  // closed loop: answers of any status after it
  std::string first_error;
  std::map<int, int64_t> errors_by_status;
  std::vector<TagCounts> per_tag;

  // The next request's index into options.requests.
  size_t NextRequest();
  void Error(const std::string& what, int status, size_t request) {
    ++errors;
    ++errors_by_status[status];
    if (!per_tag.empty() && request != kNoRequest) ++per_tag[Tag(request)].errors;
    if (first_error.empty()) first_error = what;
  }
  void Ok(size_t request) {
    ++completed;
    if (!per_tag.empty()) ++per_tag[Tag(request)].completed;
  }
  size_t Tag(size_t request) const;
};

struct Shared {
  const LoadOptions* options = nullptr;
  std::vector<tcp::endpoint> endpoints;  // the target, then more_targets
  std::atomic<size_t> next_endpoint{0};  // connections go to each in turn
  bool open_loop = false;
  Time window_start, window_end;
};

size_t ThreadState::NextRequest() {
  const size_t out = next_request;
  next_request = (next_request + 1) % shared->options->requests.size();
  return out;
}

size_t ThreadState::Tag(size_t request) const { return static_cast<size_t>(shared->options->request_tags[request]); }

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  static constexpr size_t kReadBytes = 64 << 10;

  // The buffer is sized for a whole response: Beast reads at most the free
  // capacity per call, 512 bytes when it starts empty.
  explicit Conn(ThreadState* ts)
      : ts_(ts),
        sock_(ts->io),
        retry_(ts->io),
        endpoint_(ts->shared->endpoints[ts->shared->next_endpoint.fetch_add(1) % ts->shared->endpoints.size()]) {
    buf_.reserve(kReadBytes);
  }

  // Connects, then (closed loop) starts sending or (open loop) sends the
  // request scheduled at `pending` if set, else joins the idle pool.
  void Connect(std::optional<Time> pending = std::nullopt) {
    pending_ = pending;
    sock_.async_connect(endpoint_, [self = shared_from_this()](beast::error_code ec) {
      if (ec) return self->Fail("connect: " + ec.message());
      self->sock_.set_option(tcp::no_delay(true), ec);
      if (!self->ts_->shared->open_loop) return self->SendNext();
      if (self->pending_) {
        const Time due = *self->pending_;
        self->pending_.reset();
        return self->Send(due);
      }
      self->ts_->idle.push_back(self.get());
    });
  }

  // Closed loop: sends the next request unless the window is over.
  void SendNext() {
    const Time now = Clock::now();
    if (now >= ts_->shared->window_end) return Close();
    Send(now);
  }

  // Sends one request; `start` is when it was due (latency origin).
  void Send(Time start) {
    start_ = start;
    request_ = ts_->NextRequest();
    in_flight_ = true;
    retried_ = false;
    const LoadOptions& o = *ts_->shared->options;
    if (o.progress) o.progress->OnSent();
    if (o.on_request_sent) sent_value_ = o.on_request_sent(request_);
    Write();
  }

  // Writes the request in flight and reads its answer.
  void Write() {
    const std::string& req = ts_->shared->options->requests[request_];
    asio::async_write(sock_, asio::buffer(req), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->Fail("write: " + ec.message());
      self->parser_.emplace();
      self->parser_->body_limit(64 << 20);
      http::async_read(self->sock_, self->buf_, *self->parser_,
                       [self](beast::error_code ec, size_t) { self->OnResponse(ec); });
    });
  }

  // After the run (its io_context stopped): an open-loop request due in the
  // window and still unanswered is an error of its own (status
  // kUnansweredStatus), not left out of every count.
  void CountUnansweredDue() {
    const Shared& sh = *ts_->shared;
    if (!sh.open_loop) return;
    // An arrival still waiting for its connection: nothing was sent.
    if (pending_ && *pending_ >= sh.window_start && *pending_ < sh.window_end) {
      pending_.reset();
      ts_->Error("no connection 30 s after the window", kUnansweredStatus, kNoRequest);
      return;
    }
    if (!in_flight_ || start_ < sh.window_start || start_ >= sh.window_end) return;
    in_flight_ = false;
    ts_->Error("no answer 30 s after the window", kUnansweredStatus, request_);
    if (sh.options->on_request_done) {
      const double latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
      sh.options->on_request_done(request_, sent_value_, kUnansweredStatus, latency_ms, true);
    }
  }

 private:
  void OnResponse(beast::error_code ec) {
    if (ec) return Fail("read: " + ec.message());
    in_flight_ = false;
    const Time end = Clock::now();
    const Shared& sh = *ts_->shared;
    auto& res = parser_->get();
    // Closed loop counts what finished in the window; open loop what was
    // due in it (all of which is waited for).
    const Time key = sh.open_loop ? start_ : end;
    const bool in_window = key >= sh.window_start && key < sh.window_end;
    const bool ok = res.result() == http::status::ok;
    if (ok && end >= sh.window_start && end < sh.window_end) {
      ++ts_->answered_in_window;
      ts_->prompt_tokens += PromptTokens(res.body());  // per second of the window, as req/s
    }
    const double latency_ms = std::chrono::duration<double, std::milli>(end - start_).count();
    if (!sh.open_loop && end >= sh.window_end) ++ts_->answered_after_window;
    if (LoadProgress* p = sh.options->progress) p->OnDone(ok, latency_ms);
    if (sh.options->on_request_done) {
      sh.options->on_request_done(request_, sent_value_, res.result_int(), latency_ms, in_window);
    }
    if (!ok) {
      if (in_window) {
        ts_->Error("HTTP " + std::to_string(res.result_int()) + ": " + res.body().substr(0, 200), res.result_int(),
                   request_);
      }
    } else if (in_window) {
      ts_->Ok(request_);
      ts_->latencies_ms.push_back(latency_ms);
    }
    const bool keep = res.keep_alive();
    parser_.reset();
    // Open loop: it idles in the pool until the next arrival (closed loop
    // sends again at once: no idle time for a server to close it in).
    reused_ = keep && sh.open_loop;
    if (!keep) {
      // The server closes: open a new connection at once (open loop: it
      // rejoins the idle pool), so a target without keep-alive is not
      // mistaken for one that is out of connections.
      Close();
      Reconnect(std::chrono::milliseconds(0));
      return;
    }
    if (!sh.open_loop) return SendNext();
    ts_->idle.push_back(this);
  }

  // A kept-alive connection the server closed while it idled (servers do
  // after their idle timeout: uvicorn's is 5 s) fails its next request
  // before any byte of an answer. As HTTP clients do, the request goes
  // again, once, on a new connection, with its due time kept; it is not the
  // server's failure. True when it was sent again.
  bool RetryOnNewConnection() {
    if (!in_flight_ || !reused_ || retried_ || (parser_ && parser_->got_some())) return false;
    retried_ = true;
    Close();
    ResetSocket();
    sock_.async_connect(endpoint_, [self = shared_from_this()](beast::error_code ec) {
      if (ec) return self->Fail("connect: " + ec.message());
      self->sock_.set_option(tcp::no_delay(true), ec);
      self->Write();
    });
    return true;
  }

  void Fail(const std::string& what) {
    if (RetryOnNewConnection()) return;
    const Shared& sh = *ts_->shared;
    // A failed connect has no request of its own to count per tag.
    const bool had_request = in_flight_;
    in_flight_ = false;
    const std::optional<Time> pending = pending_;  // open loop: an arrival waiting for this connect
    pending_.reset();
    if (had_request && sh.options->progress) sh.options->progress->OnDone(false, 0);
    // As in OnResponse: the open loop counts by due time, and only failures
    // that cost an arrival (not the retries of an idle connection).
    bool count = false;
    if (!sh.open_loop) {
      const Time now = Clock::now();
      count = now >= sh.window_start && now < sh.window_end;
    } else if (had_request || pending) {
      const Time due = had_request ? start_ : *pending;
      count = due >= sh.window_start && due < sh.window_end;
    }
    if (count) ts_->Error(what, 0, had_request ? request_ : kNoRequest);
    if (had_request && sh.options->on_request_done) {
      const double latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
      sh.options->on_request_done(request_, sent_value_, 0, latency_ms, count);
    }
    Close();
    // Open loop too: a broken connection must not hold a place in the pool.
    Reconnect(std::chrono::milliseconds(10));
  }

  // A new socket, for a new connection.
  void ResetSocket() {
    sock_ = tcp::socket(ts_->io);
    reused_ = false;
    buf_.clear();
    buf_.reserve(kReadBytes);
  }

  void Close() {
    beast::error_code ignored;
    sock_.shutdown(tcp::socket::shutdown_both, ignored);
    sock_.close(ignored);
  }

  // After an error or a close: connect again after `delay`, unless the
  // window is over.
  void Reconnect(std::chrono::milliseconds delay) {
    if (Clock::now() >= ts_->shared->window_end) return;
    retry_.expires_after(delay);
    retry_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (ec) return;
      self->ResetSocket();
      self->Connect();
    });
  }

  ThreadState* ts_;
  tcp::socket sock_;
  asio::steady_timer retry_;
  const tcp::endpoint endpoint_;
  beast::flat_buffer buf_;
  std::optional<http::response_parser<http::string_body>> parser_;
  std::optional<Time> pending_;
  Time start_{};
  size_t request_ = 0;      // index of the request in flight
  uint64_t sent_value_ = 0;  // what on_request_sent returned for it
  bool in_flight_ = false;  // a request was sent and has no answer yet
  bool reused_ = false;     // the connection has answered before and idled since
  bool retried_ = false;    // the request in flight was sent again once
};

// Open loop: Poisson arrivals on thread 0 until the window ends.
class Arrivals {
 public:
  Arrivals(ThreadState* ts, double rate, uint64_t seed, Time first)
      : ts_(ts), timer_(ts->io), gen_(seed), gap_(rate), next_(first) {}

  void Start() { Arm(); }

 private:
  void Arm() {
    if (next_ >= ts_->shared->window_end) return;
    timer_.expires_at(next_);
    timer_.async_wait([this](beast::error_code ec) {
      if (ec) return;
      // A late timer releases every arrival already due.
      const Time now = Clock::now();
      while (next_ <= now && next_ < ts_->shared->window_end) {
        Dispatch(next_);
        next_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap_(gen_)));
      }
      Arm();
    });
  }

  void Dispatch(Time due) {
    if (due >= ts_->shared->window_start) ++ts_->due;
    if (!ts_->idle.empty()) {
      Conn* c = ts_->idle.back();
      ts_->idle.pop_back();
      return c->Send(due);
    }
    const Shared& sh = *ts_->shared;
    if (static_cast<int>(ts_->conns.size()) >= sh.options->max_connections) {
      if (due >= sh.window_start) ++ts_->dropped;
      return;
    }
    auto c = std::make_shared<Conn>(ts_);
    ts_->conns.push_back(c);
    c->Connect(due);
  }

  ThreadState* ts_;
  asio::steady_timer timer_;
  std::mt19937_64 gen_;
  std::exponential_distribution<double> gap_;
  Time next_;
};

}  // namespace

namespace {
// Bucket i holds latencies in [kGrowth^i, kGrowth^(i+1)) microseconds.
constexpr double kGrowth = 1.01;
constexpr size_t kBuckets = 2100;  // 1.01^2100 us is about 20 minutes
const double kLogGrowth = std::log(kGrowth);
}  // namespace

LoadProgress::LoadProgress() : buckets_(kBuckets, 0) {}

void LoadProgress::OnDone(bool ok, double latency_ms) {
  const double us = latency_ms * 1000;
  const size_t i = us <= 1 ? 0 : std::min(kBuckets - 1, static_cast<size_t>(std::log(us) / kLogGrowth));
  std::lock_guard<std::mutex> lock(mu_);
  if (!ok) {
    ++errors_;
    return;
  }
  ++completed_;
  ++buckets_[i];
}

LoadProgress::Snapshot LoadProgress::Take() const {
  Snapshot s;
  s.sent = sent_.load(std::memory_order_relaxed);
  std::vector<int64_t> buckets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.completed = completed_;
    s.errors = errors_;
    buckets = buckets_;
  }
  if (s.completed == 0) return s;
  // Nearest rank, reported as the bucket's geometric middle.
  auto at = [&](double p) {
    const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(p / 100.0 * static_cast<double>(s.completed))));
    int64_t seen = 0;
    for (size_t i = 0; i < buckets.size(); ++i) {
      seen += buckets[i];
      if (seen >= rank) return std::pow(kGrowth, static_cast<double>(i) + 0.5) / 1000;
    }
    return std::pow(kGrowth, static_cast<double>(buckets.size())) / 1000;
  };
  s.p50_ms = at(50);
  s.p99_ms = at(99);
  return s;
}

double LoadResult::PercentileMs(double p) const {
  if (latencies_ms.empty()) return 0;
  // Nearest rank.
  const double rank = std::ceil(p / 100.0 * static_cast<double>(latencies_ms.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(latencies_ms.size()))) - 1;
  return latencies_ms[i];
}

std::string JsonPostRequest(const std::string& host, const std::string& path, const std::string& body,
                            const std::string& extra_headers) {
  std::string r;
  r.reserve(body.size() + extra_headers.size() + 160);
  r += "POST " + path + " HTTP/1.1\r\nHost: " + host +
       "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" +
       extra_headers + "\r\n";
  r += body;
  return r;
}

Result<LoadResult> RunLoad(const LoadOptions& options) {
  if (options.requests.empty()) return InvalidArgument("load: no requests");
  if (options.connections < 1 || options.threads < 1) return InvalidArgument("load: connections and threads must be >= 1");
  if (options.duration_s <= 0 || options.warmup_s < 0) return InvalidArgument("load: bad duration");
  if (!options.request_tags.empty()) {
    if (options.request_tags.size() != options.requests.size()) {
      return InvalidArgument("load: request_tags must have one tag per request");
    }
    if (*std::min_element(options.request_tags.begin(), options.request_tags.end()) < 0) {
      return InvalidArgument("load: request tags must be >= 0");
    }
  }
  Shared sh;
  sh.options = &options;
  std::vector<std::pair<std::string, int>> targets = {{options.host, options.port}};
  targets.insert(targets.end(), options.more_targets.begin(), options.more_targets.end());
  for (const auto& [host, port] : targets) {
    boost::system::error_code ec;
    const auto addr = asio::ip::make_address(host, ec);
    if (!ec) {
      sh.endpoints.emplace_back(addr, static_cast<unsigned short>(port));
      continue;
    }
    asio::io_context io;
    tcp::resolver resolver(io);
    auto found = resolver.resolve(host, std::to_string(port), ec);
    if (ec || found.empty()) return Unavailable("load: cannot resolve host '" + host + "': " + ec.message());
    // The first address that takes a connection: "localhost" resolves to
    // ::1 first on many hosts, and a server may listen on IPv4 only.
    tcp::endpoint chosen = found.begin()->endpoint();
    for (const auto& entry : found) {
      tcp::socket probe(io);
      boost::system::error_code connect_ec;
      probe.connect(entry.endpoint(), connect_ec);
      if (!connect_ec) {
        chosen = entry.endpoint();
        break;
      }
    }
    sh.endpoints.push_back(chosen);
  }
  sh.open_loop = options.rate_per_s > 0;
  const int nthreads = sh.open_loop ? 1 : std::min(options.threads, options.connections);

  std::vector<std::unique_ptr<ThreadState>> ts;
  for (int i = 0; i < nthreads; ++i) {
    ts.push_back(std::make_unique<ThreadState>());
    ts.back()->shared = &sh;
    ts.back()->next_request = static_cast<size_t>(i) * options.requests.size() / nthreads;
    if (!options.request_tags.empty()) {
      const int most = *std::max_element(options.request_tags.begin(), options.request_tags.end());
      ts.back()->per_tag.resize(static_cast<size_t>(most) + 1);
    }
  }
  const Time t0 = Clock::now();
  sh.window_start = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.warmup_s));
  sh.window_end = sh.window_start +
                  std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.duration_s));

  for (int i = 0; i < options.connections; ++i) {
    ThreadState* t = ts[i % nthreads].get();
    t->conns.push_back(std::make_shared<Conn>(t));
    t->conns.back()->Connect();
  }
  std::optional<Arrivals> arrivals;
  if (sh.open_loop) {
    arrivals.emplace(ts[0].get(), options.rate_per_s, options.seed, t0);
    arrivals->Start();
  }

  // Window markers on thread 0; they read every client thread's CPU clock.
  double cpu_start = 0, cpu_end = 0;
  auto all_cpu = [&] {
    double s = 0;
    // A thread that has ended stored its time first.
    for (auto& t : ts) s += ThreadCpuSeconds(t->cpu_clock).value_or(std::max(t->cpu_at_exit.load(), 0.0));
    return s;
  };
  asio::steady_timer start_timer(ts[0]->io, sh.window_start), end_timer(ts[0]->io, sh.window_end);
  start_timer.async_wait([&](beast::error_code e) {
    if (e) return;
    cpu_start = all_cpu();
    if (options.on_window_start) options.on_window_start();
  });
  end_timer.async_wait([&](beast::error_code e) {
    if (e) return;
    cpu_end = all_cpu();
    if (options.on_window_end) options.on_window_end();
  });

  std::latch ready(nthreads);
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < nthreads; ++i) {
    threads.emplace_back([&, t = ts[i].get()] {
      pthread_getcpuclockid(pthread_self(), &t->cpu_clock);
      ready.arrive_and_wait();
      t->io.run();
      t->cpu_at_exit.store(ThreadCpuSeconds(CLOCK_THREAD_CPUTIME_ID).value_or(0));
      finished.fetch_add(1);
    });
  }
  // Requests still in flight 30 s after the window are abandoned.
  const Time hard_stop = sh.window_end + std::chrono::seconds(30);
  while (finished.load() < nthreads && Clock::now() < hard_stop)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (auto& t : ts) t->io.stop();
  for (auto& th : threads) th.join();
  // Open loop: what was due in the window and is still unanswered is an
  // error of its own, not left out of every count.
  for (auto& t : ts)
    for (const auto& c : t->conns) c->CountUnansweredDue();

  LoadResult r;
  r.window_s = options.duration_s;
  r.client_cpu_s = cpu_end - cpu_start;
  for (auto& t : ts) {
    r.completed += t->completed;
    r.answered_in_window += t->answered_in_window;
    r.answered_after_window += t->answered_after_window;
    r.errors += t->errors;
    r.dropped += t->dropped;
    r.due += t->due;
    r.prompt_tokens += t->prompt_tokens;
    r.connections_used += static_cast<int>(t->conns.size());
    if (r.first_error.empty()) r.first_error = t->first_error;
    for (const auto& [status, n] : t->errors_by_status) r.errors_by_status[status] += n;
    if (r.per_tag.size() < t->per_tag.size()) r.per_tag.resize(t->per_tag.size());
    for (size_t i = 0; i < t->per_tag.size(); ++i) {
      r.per_tag[i].completed += t->per_tag[i].completed;
      r.per_tag[i].errors += t->per_tag[i].errors;
    }
    r.latencies_ms.insert(r.latencies_ms.end(), t->latencies_ms.begin(), t->latencies_ms.end());
  }
  std::sort(r.latencies_ms.begin(), r.latencies_ms.end());
  if (options.fail_when_all_failed && r.completed == 0 && r.errors > 0) return Unavailable("load: every request failed; first error: " + r.first_error);
  return r;
}

}  // namespace shoal::loadgen
