#include "cli/models_command.h"

#include <algorithm>
#include <chrono>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/http_client.h"
#include "common/json_text.h"
#include "cli/internal/env_option.h"
#include "cli/internal/models_format.h"

namespace shoal {

namespace {

using cli::HttpClient;
using cli::HttpReply;
namespace ui = cli::internal;

int Usage(std::ostream& err, const std::string& problem) {
  err << "error: " << problem << "\n" << ui::ModelsUsage();
  return 2;
}

// A request that got no HTTP answer: name the gateway and how to point the
// command elsewhere, since the usual cause is a wrong or missing --gateway.
int TransportError(std::ostream& err, const Status& s) {
  err << "error: " << s.message();
  if (s.code() == StatusCode::kUnavailable) {
    err << " (is a gateway running there? set --gateway or SHOAL_GATEWAY_URL)";
  }
  err << "\n";
  return 1;
}

void PrintBody(std::ostream& out, const std::string& body) {
  out << body;
  if (body.empty() || body.back() != '\n') out << "\n";
}

// Prints a non-2xx answer; returns true when there was one.
bool HttpFailed(const HttpReply& reply, bool json, std::ostream& out, std::ostream& err) {
  if (reply.status >= 200 && reply.status < 300) return false;
  if (json) PrintBody(out, reply.body);
  err << ui::FormatHttpError(reply.status, reply.body) << "\n";
  return true;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int List(const HttpClient& client, const ModelsCommandFlags& flags, std::ostream& out, std::ostream& err) {
  auto reply = client.Get("/v1/models");
  if (!reply.ok()) return TransportError(err, reply.status());
  if (HttpFailed(*reply, flags.json, out, err)) return 1;
  if (flags.json) {
    PrintBody(out, reply->body);
    return 0;
  }
  auto models = ui::ParseModelList(reply->body);
  if (!models.ok()) {
    err << "error: " << models.status().message() << "\n";
    return 1;
  }
  // A worker no model lists is not in the registry (gone, or mistyped):
  // an error, as an action on it is (worker_not_found).
  if (!flags.worker.empty() &&
      std::none_of(models->begin(), models->end(), [&](const ui::ModelRow& m) {
        return std::any_of(m.workers.begin(), m.workers.end(),
                           [&](const ui::WorkerModelRow& w) { return w.worker == flags.worker; });
      })) {
    err << "error: no live worker '" << flags.worker << "' (the WORKER column of `shoal models` lists them)\n";
    return 1;
  }
  out << ui::RenderModelsTable(*models, NowUnixMs(), flags.worker);
  return 0;
}

int Act(const HttpClient& client, const ModelsCommandFlags& flags, std::ostream& out, std::ostream& err) {
  nlohmann::json body = nlohmann::json::object();
  if (!flags.worker.empty()) body["worker"] = flags.worker;
  const std::string path = "/v1/models/" + ui::EncodePathSegment(flags.model) + "/" + flags.action;
  auto reply = client.Post(path, DumpJson(body));  // a --worker that is not UTF-8 must not throw
  if (!reply.ok()) return TransportError(err, reply.status());
  if (reply->status < 200 || reply->status >= 300) {
    // A failure on one worker still lists what each worker did.
    auto partial = ui::SummarizeAction(reply->body, flags.action, flags.model);
    if (!flags.json && partial.ok() && partial->succeeded + partial->failed > 0)
      for (const std::string& line : partial->lines) out << line << "\n";
    HttpFailed(*reply, flags.json, out, err);
    return 1;
  }
  auto summary = ui::SummarizeAction(reply->body, flags.action, flags.model);
  if (flags.json) {
    PrintBody(out, reply->body);
    return summary.ok() ? ui::ActionExitCode(*summary) : 1;
  }
  if (!summary.ok()) {
    err << "error: " << summary.status().message() << "\n";
    return 1;
  }
  for (const std::string& line : summary->lines) out << line << "\n";
  return ui::ActionExitCode(*summary);
}

}  // namespace

CLI::App* AddModelsCommand(CLI::App* app, ModelsCommandFlags* flags) {
  CLI::App* cmd = app->add_subcommand(
      "models", "List the fleet's models per worker, or load, unload, pin or unpin one (through a gateway)");
  cmd->add_option("action", flags->action, "list | load | unload | pin | unpin")->capture_default_str();
  cmd->add_option("model", flags->model, "Model name (load, unload, pin, unpin)");
  cmd->add_option("--gateway", flags->gateway_url, "Gateway base URL, http://host:port[/prefix]")
      ->envname("SHOAL_GATEWAY_URL")
      ->capture_default_str();
  cmd->add_option("--worker", flags->worker, "Only this worker id (actions: send it there; list: show its rows)")
      ->envname("SHOAL_MODELS_WORKER")
      ->capture_default_str();
  cmd->add_flag("--json", flags->json, "Print the gateway's JSON answer as is")
      ->envname("SHOAL_MODELS_JSON")
      ->capture_default_str();
  cli::EnvOption(cmd, "--timeout-ms", flags->timeout_ms, "SHOAL_MODELS_TIMEOUT_MS",
                 "Whole-request timeout, 1 ms to a day; a load waits for the model");
  cmd->footer(ui::ModelsUsage());
  return cmd;
}

int RunModelsCommand(const ModelsCommandFlags& flags) {
  const int code = RunModelsCommand(flags, std::cout, std::cerr);
  std::cout.flush();
  return code;
}

int RunModelsCommand(const ModelsCommandFlags& flags, std::ostream& out, std::ostream& err) {
  const bool list = flags.action == "list";
  if (!list && !ui::IsModelAction(flags.action)) return Usage(err, "unknown action '" + flags.action + "'");
  if (list && !flags.model.empty()) return Usage(err, "list takes no model name (got '" + flags.model + "')");
  if (!list && flags.model.empty()) return Usage(err, flags.action + " needs a model name");
  if (flags.timeout_ms <= 0) return Usage(err, "--timeout-ms must be positive");
  auto client = HttpClient::Create(flags.gateway_url, std::chrono::milliseconds(flags.timeout_ms));
  if (!client.ok()) return Usage(err, client.status().message());
  return list ? List(*client, flags, out, err) : Act(*client, flags, out, err);
}

}  // namespace shoal
