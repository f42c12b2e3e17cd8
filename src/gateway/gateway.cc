#include "gateway/gateway.h"

#include "common/log.h"

namespace shoal {
namespace {

// How long a stopping gateway waits for the answers of requests in flight
// to be written before it closes their connections.
constexpr int64_t kDrainMs = 2000;

}  // namespace

Status GatewayOptions::Validate() const {
  RETURN_IF_ERROR(http.Validate());
  RETURN_IF_ERROR(dispatcher.Validate());
  RETURN_IF_ERROR(control.Validate());
  RETURN_IF_ERROR(blob.Validate());
  return router.Validate();
}

Result<std::unique_ptr<Gateway>> Gateway::Create(const GatewayOptions& options, NatsClient* client,
                                                 MetricsRegistry* metrics) {
  RETURN_IF_ERROR(options.Validate());
  auto g = std::unique_ptr<Gateway>(new Gateway());
  ASSIGN_OR_RETURN(g->dispatcher_, Dispatcher::Create(options.dispatcher, client, metrics));
  if (!options.blob.store_url.empty()) {
    if (options.blob.ttl_ms < options.router.max_timeout_ms)
      LOG_WARN("gateway", "--blob-ttl-ms " << options.blob.ttl_ms << " is shorter than the longest request deadline ("
                                           << options.router.max_timeout_ms
                                           << " ms): the sweep may delete the payload of a request still waiting "
                                              "in the queue, which then fails with blob_not_found");
    ASSIGN_OR_RETURN(g->blob_, BlobOffload::Create(options.blob, client, metrics));
    g->dispatcher_->SetBlobOffload(g->blob_.get());
  }
  ASSIGN_OR_RETURN(g->fleet_, FleetView::Create(options.fleet, client, metrics));
  FleetView* fleet = g->fleet_.get();
  RouterOptions router_options = options.router;
  router_options.max_body_bytes = options.http.max_body_bytes;
  g->router_ = std::make_unique<Router>(router_options, g->dispatcher_.get(),
                                        [fleet] { return fleet->Snapshot(); }, metrics);
  // Operator actions plan on a fresh view of the registry.
  ASSIGN_OR_RETURN(g->control_, FleetControl::Create(options.control, client, [fleet] {
                     fleet->Refresh();
                     return fleet->Snapshot();
                   }));
  g->router_->SetModelController(g->control_.get());
  Router* router = g->router_.get();
  HttpServerOptions http_options = options.http;
  // What the HTTP server refuses itself (server_busy, oversized bodies,
  // malformed requests) is counted with the router's errors.
  http_options.on_refused = [router](int, std::string_view code) { router->CountError(code); };
  ASSIGN_OR_RETURN(g->http_, HttpServer::Create(http_options, [router](HttpRequest&& req, HttpResponder respond) {
                     router->Handle(std::move(req), std::move(respond));
                   }));
  return g;
}

Gateway::~Gateway() { Stop(); }

void Gateway::Stop() {
  // Requests in flight get an answer (503 shutting down, from the
  // dispatcher and the model control) before their connections close; the
  // drain waits for those answers to be written, within a bound.
  if (dispatcher_) dispatcher_->Stop();
  if (control_) control_->BeginStop();
  if (http_ && !http_->Drain(kDrainMs)) LOG_WARN("gateway", "responses still unwritten after " << kDrainMs << " ms");
  if (http_) http_->Stop();
  if (control_) control_->Stop();
  blob_.reset();  // after Stop(): no new puts are queued
  if (fleet_) fleet_->Stop();
}

}  // namespace shoal
