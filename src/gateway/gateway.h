// Gateway: the `shoal gateway` process minus flag parsing. Wires the HTTP
// server to the Router, the Router to the Dispatcher (queue) and FleetView
// (cluster state). Stateless: run as many as you like against one NATS.
#pragma once

#include <memory>

#include "blob/blob_offload.h"
#include "common/metrics.h"
#include "common/status.h"
#include "gateway/dispatcher.h"
#include "gateway/fleet_control.h"
#include "gateway/fleet_view.h"
#include "gateway/http_server.h"
#include "gateway/routes.h"
#include "queue/nats_client.h"

namespace shoal {

struct GatewayOptions {
  HttpServerOptions http;
  DispatcherOptions dispatcher;
  RouterOptions router;
  FleetViewOptions fleet;
  FleetControlOptions control;
  // Offload of large work messages; store_url empty: off.
  BlobOffloadOptions blob;
  Status Validate() const;
};

class Gateway {
 public:
  // `client` and `metrics` must outlive the gateway. Binds the port.
  static Result<std::unique_ptr<Gateway>> Create(const GatewayOptions& options, NatsClient* client,
                                                 MetricsRegistry* metrics);
  ~Gateway();
  int port() const { return http_->port(); }
  // Fails in-flight requests with 503 shutting_down and writes those
  // answers (for up to 2 s), then stops accepting, closes connections and
  // stops threads.
  void Stop();

 private:
  Gateway() = default;
  std::unique_ptr<Dispatcher> dispatcher_;
  // Declared after the dispatcher: destroyed (its queued puts and deletes
  // finished) while the dispatcher its callbacks use still exists.
  std::unique_ptr<BlobOffload> blob_;
  std::unique_ptr<FleetView> fleet_;
  std::unique_ptr<FleetControl> control_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<HttpServer> http_;
};

}  // namespace shoal
