#include "e2e/shoal_cluster.h"

#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "support/test_env.h"

namespace shoal::e2e {

using nlohmann::json;

namespace {

constexpr auto kStartTimeout = std::chrono::seconds(60);

Shoal StartAndWait(std::vector<std::string> argv, const std::string& pattern) {
  ChildOptions o;
  o.argv = std::move(argv);
  Shoal s;
  s.process = ChildProcess::Spawn(o);
  auto m = s.process->WaitForLine(pattern, kStartTimeout);
  if (!m) {
    auto status = s.process->Wait(std::chrono::milliseconds(0));
    throw std::runtime_error("`" + o.argv[0] + " " + o.argv[1] + "` did not print /" + pattern + "/ (" +
                             (status ? DescribeWaitStatus(*status) : std::string("still running")) +
                             "); stdout:\n" + s.process->StdoutSoFar());
  }
  if (m->size() > 1) s.port = std::stoi((*m)[1]);
  return s;
}

}  // namespace

Shoal StartServe(const std::string& data_dir, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {shoal::testing::ShoalBinary(), "serve", "--data-dir", data_dir, "--port", "0",
                                   "--models-dir", shoal::testing::ModelsDir()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return StartAndWait(std::move(argv), R"(Shoal is serving \d+ model\(s\) at http://127\.0\.0\.1:(\d+))");
}

Shoal StartGateway(const std::string& nats_url, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {shoal::testing::ShoalBinary(), "gateway", "--nats-url", nats_url,
                                   "--host", "127.0.0.1", "--port", "0"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return StartAndWait(std::move(argv), R"(shoal gateway listening on port (\d+))");
}

Shoal StartWorker(const std::string& nats_url, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {shoal::testing::ShoalBinary(), "worker", "--nats-url", nats_url,
                                   "--models-dir", shoal::testing::ModelsDir(), "--models", "tiny-bert"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return StartAndWait(std::move(argv), R"(shoal worker \S+ ready)");
}

Shoal StartFleetWorker(const std::string& nats_url, const std::string& repository,
                       const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {shoal::testing::ShoalBinary(), "worker", "--nats-url", nats_url,
                                   "--models-dir", repository};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return StartAndWait(std::move(argv), R"(shoal worker \S+ ready)");
}

CliRun RunShoal(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  ChildOptions o;
  o.argv = {shoal::testing::ShoalBinary()};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  auto child = ChildProcess::Spawn(o);
  CliRun run;
  auto status = child->Wait(timeout);
  if (status && WIFEXITED(*status)) run.exit_code = WEXITSTATUS(*status);
  child->WaitForLine("a^", std::chrono::milliseconds(2000));  // never matches: returns at end of stdout
  run.out = child->StdoutSoFar();
  return run;
}

int WaitForReadyz(int port, int want_status, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int last = 0;
  for (;;) {
    last = HttpGet(port, "/readyz", std::chrono::milliseconds(2000)).status;
    if (last == want_status || std::chrono::steady_clock::now() >= deadline) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::vector<float> DecodeBase64Floats(const std::string& b64) {
  static const std::string kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : b64) {
    if (c == '=') break;
    auto pos = kAlphabet.find(c);
    if (pos == std::string::npos) throw std::runtime_error("bad base64 character");
    acc = (acc << 6) | static_cast<uint32_t>(pos);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  if (bytes.size() % sizeof(float) != 0) throw std::runtime_error("base64 length is not a whole number of floats");
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), bytes.size());  // the test host is little-endian
  return out;
}

double L2Norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

OpenAiEmbeddings ParseOpenAiEmbeddings(const std::string& body) {
  json j = json::parse(body);
  if (j.at("object") != "list") throw std::runtime_error("object is not \"list\"");
  OpenAiEmbeddings out;
  out.model = j.at("model").get<std::string>();
  out.prompt_tokens = j.at("usage").at("prompt_tokens").get<int64_t>();
  out.total_tokens = j.at("usage").at("total_tokens").get<int64_t>();
  const auto& data = j.at("data");
  out.rows.resize(data.size());
  for (const auto& item : data) {
    if (item.at("object") != "embedding") throw std::runtime_error("data item is not an embedding");
    const int64_t index = item.at("index").get<int64_t>();
    if (index < 0 || index >= static_cast<int64_t>(data.size())) throw std::runtime_error("index out of range");
    out.indices.push_back(index);
    const auto& e = item.at("embedding");
    out.rows[index] = e.is_string() ? DecodeBase64Floats(e.get<std::string>()) : e.get<std::vector<float>>();
  }
  return out;
}

OpenAiEmbeddings EmbedOrThrow(int port, const std::string& model, const std::vector<std::string>& texts,
                              std::chrono::milliseconds timeout) {
  json req = {{"model", model}, {"input", texts}};
  auto r = HttpPostJson(port, "/v1/embeddings", req.dump(), {}, timeout);
  if (r.status != 200)
    throw std::runtime_error("POST /v1/embeddings: " + std::to_string(r.status) + " " + r.error + " " + r.body);
  return ParseOpenAiEmbeddings(r.body);
}

std::string ErrorCode(const std::string& body) {
  try {
    return json::parse(body).at("error").at("code").get<std::string>();
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace shoal::e2e
