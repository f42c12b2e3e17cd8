// PullGate: keeps a worker's pulling at most a few forward passes ahead of
// its device, across all the models it serves.
//
// Without it, each model's fetcher keeps a pull request open whenever its
// own batcher has room. With twenty models per worker, every worker then
// has a request waiting for nearly every model, and JetStream hands each
// message to one of them whatever its device is doing: random assignment,
// where pulled work waits behind a busy device while another device idles.
//
// With it, a model's work waiting for the device holds a claim (one per
// model, whatever its rows: one pass), taken when the work is pulled and
// given back when the executor takes the batch. Fetchers open pulls only
// while fewer than `limit` claims are held, and keep each pull open only
// briefly (a pull already open cannot be withdrawn), so a worker whose
// device is behind stops taking work and the shared queue hands it to one
// that frees up first.
//
// A model whose passes each take only part of its waiting work (a turn
// quantum cuts them) keeps its claim for as long as its queue lasts; with
// `limit` such models, another model with queued work would never find
// room. So a model that has waited for room long enough with work in the
// queue (its fetcher says kStarved) may pull while held claims are within
// one of the limit: one more pass waits, and claims still count every one.
// Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace shoal {

class PullGate {
 public:
  // limit <= 0: unbounded (there is always room).
  explicit PullGate(int limit) : limit_(limit) {}
  PullGate(const PullGate&) = delete;
  PullGate& operator=(const PullGate&) = delete;

  // Who asks for room.
  enum class Puller {
    kWaiting,  // no claim: room while fewer than `limit` claims are held
    kHolder,   // its model's work holds a claim: what comes joins that pass,
               // so there is always room
    kStarved,  // no claim, work in the queue, and no room for a while:
               // room while at most `limit` claims are held
  };

  bool bounded() const { return limit_ > 0; }
  int limit() const { return limit_; }
  int held() const;

  // Waits up to `wait_ms` until `puller` may open a pull (see Puller).
  // False on timeout, when `stop` (may be null; polled every 20 ms) is set,
  // or after Shutdown().
  bool WaitForRoom(int64_t wait_ms, const std::atomic<bool>* stop = nullptr, Puller puller = Puller::kWaiting);
  // Takes a claim, room or not: the work is pulled already.
  void Take();
  // Gives one claim back.
  void Release();
  // Fails every waiting and later WaitForRoom(). Idempotent.
  void Shutdown();

 private:
  const int limit_;
  mutable std::mutex mu_;
  std::condition_variable room_cv_;
  int held_ = 0;            // guarded by mu_
  bool shutdown_ = false;   // guarded by mu_
};

}  // namespace shoal
