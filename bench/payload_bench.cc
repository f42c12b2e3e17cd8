// shoal_bench_payload: the binary path, JSON + base64 against MessagePack,
// for payloads of 1 KiB to 10 MiB, in one run.
//
// A private nats-server -js, a Worker and a Gateway in this process, wired
// as `shoal serve` wires them (blob offload to a local directory above the
// 1 MiB threshold). The model is an item model on the "null" runtime, which
// answers each input with its size and runs nothing, so what is measured
// is Shoal's own handling of the bytes: HTTP body, decoding (base64 or
// MessagePack bin), the queue message or the blob store, the worker's fetch.
// The payload is random bytes behind a PNG signature (POST /v1/ocr/{model}
// checks the first bytes of an image before queueing).
//
// For each size, N closed-loop keep-alive clients send the same payload as
// {"image": "<base64>"} (application/json) and as {image: bin}
// (application/msgpack, answer in MessagePack too); requests/s, MiB/s of
// payload, p50/p99 latency, and the MessagePack / JSON throughput ratio.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <msgpack.hpp>

#include "common/log.h"
#include "common/metrics.h"
#include "gateway/gateway.h"
#include "loadgen/http_load.h"
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"
#include "worker/worker.h"

namespace shoal::bench {
namespace {

namespace fs = std::filesystem;

struct Flags {
  std::vector<int64_t> sizes = {1 << 10, 100 << 10, 1 << 20, 10 << 20};
  int clients = 4;
  double warmup_s = 1;
  double duration_s = 5;
  int http_threads = 1;
};

std::string Base64(std::string_view in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8) |
                       static_cast<unsigned char>(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(k[(v >> s) & 63]);
  }
  if (i < in.size()) {
    uint32_t v = static_cast<unsigned char>(in[i]) << 16;
    if (i + 1 < in.size()) v |= static_cast<unsigned char>(in[i + 1]) << 8;
    out.push_back(k[v >> 18]);
    out.push_back(k[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? k[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

std::string RawPost(int port, const std::string& path, const std::string& content_type, const std::string& accept,
                    const std::string& body) {
  std::ostringstream r;
  r << "POST " << path << " HTTP/1.1\r\nHost: 127.0.0.1:" << port << "\r\nContent-Type: " << content_type
    << "\r\nAccept: " << accept << "\r\nShoal-Timeout-Ms: 120000\r\nContent-Length: " << body.size() << "\r\n\r\n";
  return r.str() + body;
}

class Stack {
 public:
  static Result<std::unique_ptr<Stack>> Start(const Flags& f, const fs::path& dir) {
    auto s = std::unique_ptr<Stack>(new Stack());
    fs::create_directories(dir / "repo" / "echo");
    std::ofstream(dir / "repo" / "echo" / "shoal.json") << R"({"name":"echo","task":"ocr","runtime":"null"})";
    NatsServerOptions ns;
    ns.data_dir = (dir / "jetstream").string();
    ASSIGN_OR_RETURN(s->nats_, NatsServerProcess::Start(ns));
    NatsOptions no;
    no.url = s->nats_->url();
    ASSIGN_OR_RETURN(s->client_, NatsClient::Connect(no));
    const std::string blobs = "file://" + (dir / "blobs").string();
    WorkerOptions wo;
    wo.model_repository = (dir / "repo").string();
    wo.blob.store_url = blobs;
    ASSIGN_OR_RETURN(s->worker_, Worker::Create(wo, s->client_.get(), &s->metrics_));
    GatewayOptions go;
    go.http.port = 0;
    go.http.threads = f.http_threads;
    go.blob.store_url = blobs;
    go.blob.sweep_interval_ms = 60000;
    ASSIGN_OR_RETURN(s->gateway_, Gateway::Create(go, s->client_.get(), &s->metrics_));
    return s;
  }
  ~Stack() {
    if (gateway_) gateway_->Stop();
    if (worker_) worker_->Stop();
    gateway_.reset();
    worker_.reset();
    client_.reset();
    if (nats_) nats_->Stop();
  }
  int port() const { return gateway_->port(); }

 private:
  Stack() = default;
  MetricsRegistry metrics_;
  std::unique_ptr<NatsServerProcess> nats_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<Gateway> gateway_;
};

struct Row {
  double rps = 0, p50 = 0, p99 = 0;
  int64_t errors = 0;
  std::string first_error;
};

Result<Row> Measure(const Flags& f, int port, const std::string& request) {
  loadgen::LoadOptions lo;
  lo.port = port;
  lo.requests = {request};
  lo.connections = f.clients;
  lo.warmup_s = f.warmup_s;
  lo.duration_s = f.duration_s;
  ASSIGN_OR_RETURN(loadgen::LoadResult r, loadgen::RunLoad(lo));
  return Row{r.RequestsPerS(), r.PercentileMs(50), r.PercentileMs(99), r.errors, r.first_error};
}

std::string SizeName(int64_t n) {
  if (n >= (1 << 20) && n % (1 << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n >= 1024 && n % 1024 == 0) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

int Run(const Flags& f) {
  const fs::path dir = fs::temp_directory_path() / ("shoal-payload-bench-" + std::to_string(::getpid()));
  auto stack = Stack::Start(f, dir);
  if (!stack.ok()) {
    std::fprintf(stderr, "payload bench: %s\n", stack.status().ToString().c_str());
    return 1;
  }
  const int port = (*stack)->port();
  std::mt19937_64 rng(42);
  std::printf("# shoal_bench_payload: %d closed-loop clients, %.0f s per point (after %.0f s warm-up)\n", f.clients,
              f.duration_s, f.warmup_s);
  std::printf("| payload | format | body | req/s | payload MiB/s | p50 ms | p99 ms | errors |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  // Wait until the gateway sees the model, with a tiny request.
  const std::string tiny = std::string("\x81\xa5" "image\xc4\x08", 9) + "\x89PNG\r\n\x1a\n";
  for (int i = 0; i < 100; ++i) {
    auto probe = Measure(Flags{{}, 1, 0, 0.2, 1}, port,
                         RawPost(port, "/v1/ocr/echo", "application/msgpack", "application/msgpack", tiny));
    if (probe.ok() && probe->errors == 0 && probe->rps > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::vector<std::pair<std::string, double>> ratios;
  for (int64_t size : f.sizes) {
    std::string payload = "\x89PNG\r\n\x1a\n";
    payload.resize(static_cast<size_t>(std::max<int64_t>(size, 8)));
    for (size_t i = 8; i < payload.size(); ++i) payload[i] = static_cast<char>(rng());
    const std::string json = "{\"image\":\"" + Base64(payload) + "\"}";
    msgpack::sbuffer buf(payload.size() + 64);
    msgpack::packer<msgpack::sbuffer> pk(buf);
    pk.pack_map(1);
    pk.pack(std::string("image"));
    pk.pack_bin(static_cast<uint32_t>(payload.size()));
    pk.pack_bin_body(payload.data(), static_cast<uint32_t>(payload.size()));
    const std::string mp(buf.data(), buf.size());
    double rps[2] = {0, 0};
    for (int m = 0; m < 2; ++m) {
      const bool is_mp = m == 1;
      const std::string& body = is_mp ? mp : json;
      auto row = Measure(f, port,
                         RawPost(port, "/v1/ocr/echo", is_mp ? "application/msgpack" : "application/json",
                                 is_mp ? "application/msgpack" : "application/json", body));
      if (!row.ok()) {
        std::printf("| %s | %s | %s | failed: %s |\n", SizeName(size).c_str(), is_mp ? "MessagePack" : "JSON+base64",
                    SizeName(static_cast<int64_t>(body.size())).c_str(), row.status().ToString().c_str());
        continue;
      }
      rps[m] = row->rps;
      std::printf("| %s | %s | %.2f MiB | %.1f | %.1f | %.2f | %.2f | %lld%s%s |\n", SizeName(size).c_str(),
                  is_mp ? "MessagePack" : "JSON+base64", static_cast<double>(body.size()) / (1 << 20), row->rps,
                  row->rps * static_cast<double>(size) / (1 << 20), row->p50, row->p99,
                  static_cast<long long>(row->errors), row->errors ? " " : "", row->first_error.c_str());
    }
    ratios.emplace_back(SizeName(size), rps[0] > 0 ? rps[1] / rps[0] : 0);
    std::fflush(stdout);
  }
  std::printf("\nMessagePack / JSON+base64 throughput:");
  for (const auto& [name, r] : ratios) std::printf("  %s %.2f", name.c_str(), r);
  std::printf("\n");
  stack->reset();
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}

}  // namespace
}  // namespace shoal::bench

int main(int argc, char** argv) {
  shoal::bench::Flags f;
  CLI::App app{"shoal_bench_payload: JSON+base64 against MessagePack for 1 KiB..10 MiB payloads"};
  app.add_option("--sizes", f.sizes, "payload sizes in bytes")->delimiter(',');
  app.add_option("--clients", f.clients, "closed-loop clients");
  app.add_option("--warmup", f.warmup_s, "seconds not measured, per point");
  app.add_option("--duration", f.duration_s, "seconds measured, per point");
  app.add_option("--http-threads", f.http_threads, "gateway I/O threads");
  CLI11_PARSE(app, argc, argv);
  shoal::SetLogLevel(shoal::LogLevel::kWarn);
  return shoal::bench::Run(f);
}
