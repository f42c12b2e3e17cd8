// ConsumerPark: keeps the pull subscriptions of models that stopped serving
// on this worker open until the server has let go of their last pull.
//
// nats-server before 2.10 keeps a pull request listed until it expires, even
// when its subscription has gone, and a -NAKed message that meets only such
// requests is dropped until AckWait (while the next message in the stream is
// sent a second time). A stopping model's pulls are therefore never left
// behind a closed subscription: the model's subscription waits here, still
// subscribed, until its last pull has expired. A load of the model in the
// meantime takes it back, with whatever the server delivered to it;
// otherwise it is closed then, and what it holds is handed back.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/metrics.h"
#include "queue/nats_client.h"

namespace shoal {

struct ConsumerParkOptions {
  NatsClient* client = nullptr;       // publishes error replies
  MetricsRegistry* metrics = nullptr;  // shoal_worker_handed_back_total{model}
  std::string worker_id;
  int max_deliver = 5;  // a message on its last delivery is answered, not handed back
  // After a subscription's last pull expires at the server, how long before
  // it is closed (the server removes expired pulls on a timer).
  int64_t margin_ms = 100;
};

class ConsumerPark {
 public:
  explicit ConsumerPark(ConsumerParkOptions options);
  ~ConsumerPark();  // CloseAll()
  ConsumerPark(const ConsumerPark&) = delete;
  ConsumerPark& operator=(const ConsumerPark&) = delete;

  // Keeps `consumer` (no Fetch of it running) open until its last pull has
  // expired (PullConsumer::PullLeftMs, or `hand_pull_left_ms` from now if
  // later: a pull sent by hand), plus the margin. Several may wait for one
  // model.
  void Park(const std::string& model, std::unique_ptr<PullConsumer> consumer, int64_t hand_pull_left_ms = 0);
  // The model's parked subscription (the next load fetches from it), or null.
  std::unique_ptr<PullConsumer> Take(const std::string& model);
  // Waits until every parked subscription's pulls have expired, then closes
  // them all, handing back what they hold. For a stopping worker; later
  // parks close at once.
  void CloseAll();
  size_t size() const;

 private:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Entry {
    std::unique_ptr<PullConsumer> consumer;
    TimePoint close_at;
  };
  void Loop();
  // Ends the subscription and hands back what the server delivered to it:
  // load hints are acked, malformed messages terminated, work on its last
  // allowed delivery answered with worker_stopping, the rest -NAKed.
  void Close(const std::string& model, PullConsumer& consumer);

  const ConsumerParkOptions o_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<std::string, Entry> parked_;  // guarded by mu_
  bool stop_ = false;                         // guarded by mu_
  std::thread closer_;
};

}  // namespace shoal
