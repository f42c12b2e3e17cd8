// NatsServerProcess: runs a private `nats-server -js` child process on
// loopback, for `shoal serve` and for test fixtures. The destructor stops it
// (SIGTERM, then SIGKILL after a grace period) and reaps it.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace shoal {

struct NatsServerOptions {
  // A path, or a name looked up on PATH and then in the sbin directories
  // (Debian installs nats-server in /usr/sbin, which a user's PATH lacks).
  std::string binary = "nats-server";
  std::string host = "127.0.0.1";
  int port = 0;                 // 0: pick a free port
  std::string data_dir;         // JetStream store; required
  std::string log_file;         // empty: <data_dir>/nats-server.log
  int64_t ready_timeout_ms = 10000;
  // The server gets SIGTERM when the thread that called Start() ends (Linux
  // PR_SET_PDEATHSIG; in practice: when this process dies, even by
  // SIGKILL), so a killed `shoal serve` leaves no nats-server behind. Only
  // for a Start() on a thread that lives as long as the server should
  // (the main thread).
  bool die_with_parent = false;
  // A close-on-exec descriptor the server keeps open, e.g. a lock that must
  // last as long as the server does. -1: none.
  int inherit_fd = -1;
  // False: core NATS only, no JetStream (how Shoal reports such a server
  // is tested with it).
  bool jetstream = true;
  Status Validate() const;
};

class NatsServerProcess {
 public:
  // Starts the server and blocks until it accepts TCP connections.
  static Result<std::unique_ptr<NatsServerProcess>> Start(const NatsServerOptions& options);
  ~NatsServerProcess();

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string url() const;
  // Stops the server; idempotent.
  void Stop();

 private:
  NatsServerProcess() = default;
  NatsServerOptions options_;
  int port_ = 0;
  pid_t pid_ = -1;
};

// Where `binary` would run from: itself when it holds a '/', else the first
// executable of that name on PATH, then in /usr/local/sbin, /usr/sbin and
// /sbin. Empty when there is none.
std::string FindExecutable(const std::string& binary);
// A TCP port on 127.0.0.1 that was free a moment ago.
Result<int> PickFreePort();
// True when host:port accepts a TCP connection.
bool PortAcceptsConnections(const std::string& host, int port);

}  // namespace shoal
