// ProgressKeeper: keeps long-running work ours. JetStream redelivers a
// message not acknowledged within AckWait, so a forward pass longer than
// that (a large OCR page, a long generation behind an OpenAI-compatible
// backend) would be handed to a second worker while the first still runs
// it: duplicate work, duplicate answers; so would work pulled while such a
// pass runs and waiting behind it. From a message's pull until it is
// answered, the keeper tells JetStream every `interval_ms` that it is in
// progress (an "+WPI" to its ack subject). It publishes on its own
// thread and never touches a Delivery, so the executor may ack at any time;
// a progress note for a message already acked is ignored by the server.
// One per worker. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shoal {

class NatsClient;

class ProgressKeeper {
 public:
  // Notes progress every `interval_ms` (>= 1) through `client` (not owned;
  // outlives the keeper).
  ProgressKeeper(NatsClient* client, int64_t interval_ms);
  ~ProgressKeeper();
  ProgressKeeper(const ProgressKeeper&) = delete;
  ProgressKeeper& operator=(const ProgressKeeper&) = delete;

  // While alive, the messages of `ack_subjects` get a progress note every
  // interval. Movable; the destructor stops the notes.
  class Watch {
   public:
    Watch() = default;
    Watch(Watch&& o) noexcept : keeper_(o.keeper_), id_(o.id_) { o.keeper_ = nullptr; }
    Watch& operator=(Watch&& o) noexcept;
    // Stops the notes now and returns once none can still be on its way, so
    // a -NAK sent after it is the last word (a note after it would hold the
    // handed-back message until AckWait).
    void Finish();
    Watch(const Watch&) = delete;
    ~Watch();

   private:
    friend class ProgressKeeper;
    Watch(ProgressKeeper* keeper, uint64_t id) : keeper_(keeper), id_(id) {}
    ProgressKeeper* keeper_ = nullptr;
    uint64_t id_ = 0;
  };
  // Empty subjects (work pushed outside the stream) are skipped.
  Watch Start(std::vector<std::string> ack_subjects);

  // Progress notes sent so far (for tests and metrics).
  uint64_t notes_sent() const;

 private:
  void Loop();
  void Stop(uint64_t id);

  NatsClient* const client_;
  const int64_t interval_ms_;
  mutable std::mutex mu_;
  std::mutex publish_mu_;  // held while a round of notes is published (never with mu_)
  std::condition_variable cv_;
  bool stop_ = false;                                      // guarded by mu_
  uint64_t next_id_ = 1;                                   // guarded by mu_
  std::map<uint64_t, std::vector<std::string>> watched_;   // guarded by mu_
  uint64_t notes_sent_ = 0;                                // guarded by mu_
  std::thread thread_;
};

}  // namespace shoal
