// `shoal models`: lists the fleet's models per worker, and loads, unloads,
// pins or unpins one, by calling a gateway's /v1/models API over HTTP.
// main.cc registers it with AddModelsCommand and runs it when parsed.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace shoal {

struct ModelsCommandFlags {
  std::string gateway_url = "http://127.0.0.1:8080";
  std::string action = "list";  // list | load | unload | pin | unpin
  std::string model;            // required for every action but list
  std::string worker;           // actions: only this worker; list: only its rows
  bool json = false;            // print the gateway's JSON answer as is
  // Whole request; a load waits for the model. Above the gateway's own
  // wait for a load (300 s), so a load that takes all of it ends with the
  // gateway's answer, not this client's timeout.
  int64_t timeout_ms = 330000;
};

// Adds `shoal models [action] [model]` with its options (each with a flag
// and an environment variable) to `app`; `flags` must outlive parsing.
// Returns the subcommand, so the caller can test ->parsed().
CLI::App* AddModelsCommand(CLI::App* app, ModelsCommandFlags* flags);

// Runs the command: one blocking request to the gateway (up to
// flags.timeout_ms), then prints to stdout, errors to stderr. Returns the
// process exit code: 0 ok, 1 on any error (unreachable gateway, HTTP error,
// a failed per-worker result), 2 on bad usage (unknown action, missing
// model, bad URL or timeout).
int RunModelsCommand(const ModelsCommandFlags& flags);
// The same, printing to `out` and `err` (tests).
int RunModelsCommand(const ModelsCommandFlags& flags, std::ostream& out, std::ostream& err);

}  // namespace shoal
