// ProcessRuntime ("runtime": "process"): runs a model in a separate process
// that speaks docs/runtime-protocol.md over a Unix socket, so a model can
// bring its own language, interpreter and libraries. The worker starts the
// process from the model config, checks its health, and restarts it with
// exponential backoff when it dies or misbehaves; after
// process.max_failed_starts restarts in a row fail to start it, it gives up
// (Health() turns non-OK) and the worker marks the model failed. A batch in flight when the
// process dies fails with Unavailable "runtime_crashed", which the worker
// answers by handing the work back to the queue (redelivery), not to the
// callers. Malformed, oversized or wrong-version frames never crash or hang
// the worker: they fail the batch and restart the process.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/process/protocol.h"
#include "runtime/runtime.h"

namespace shoal {

class ProcessRuntime final : public Runtime {
 public:
  ProcessRuntime() = default;
  ~ProcessRuntime() override;
  // Starts the process and loads the model in it (up to
  // process.start_timeout_ms). Call once.
  Status Load(const ModelConfig& config) override;
  Result<Embeddings> Run(const TokenBatch& batch) override;
  void Unload() override;
  int64_t MemoryBytes() const override { return memory_bytes_.load(); }
  int Dim() const override { return dim_.load(); }
  bool Available() const override { return up_.load() && !restarting_.load(); }
  // Not OK after process.max_failed_starts restarts in a row failed to
  // start the process; it is not restarted again.
  Status Health() const override;

  // For tests and operators.
  pid_t pid() const { return pid_.load(); }
  int restarts() const { return restarts_.load(); }
  bool up() const { return up_.load(); }

 private:
  // All on the supervisor thread (a dying parent thread would take a child
  // started with PDEATHSIG along): spawn, connect, hello, load.
  Status Start();
  // Ends the process (politely when `graceful`) and closes the socket.
  // Requires io_mu_.
  void StopProcessLocked(bool graceful);
  // One request/reply on the socket. Requires io_mu_.
  Result<runtime_protocol::Reply> CallLocked(const std::string& frame, uint64_t id, int64_t timeout_ms);
  void SuperviseLoop();
  // Marks the process down after an I/O or protocol failure (io_mu_ held).
  void MarkDownLocked(const Status& why);

  ModelConfig config_;
  std::mutex io_mu_;             // the socket: one request at a time
  int fd_ = -1;                  // guarded by io_mu_
  int pidfd_ = -1;               // guarded by io_mu_: readable once the process exits (-1: none)
  std::string socket_dir_;       // guarded by io_mu_
  uint64_t next_id_ = 1;         // guarded by io_mu_
  int64_t last_io_mono_us_ = 0;  // guarded by io_mu_
  std::atomic<pid_t> pid_{-1};
  // Held from clearing pid_ until that process is reaped, and by Unload's
  // kill: a pid read from pid_ under it was not reaped (not reused).
  std::mutex reap_mu_;
  std::atomic<bool> up_{false};
  std::atomic<bool> restarting_{false};
  std::atomic<int> dim_{0};
  std::atomic<int64_t> memory_bytes_{0};
  std::atomic<int> restarts_{0};

  mutable std::mutex sup_mu_;
  std::condition_variable sup_cv_;
  std::atomic<bool> stop_{false};  // written under sup_mu_; read without it by a start waiting for the socket
  bool start_requested_ = false; // guarded by sup_mu_: first start, asked by Load()
  bool start_done_ = false;      // guarded by sup_mu_
  Status start_status_;          // guarded by sup_mu_
  Status gave_up_;               // guarded by sup_mu_: why the restarts stopped
  std::thread supervisor_;
};

}  // namespace shoal
