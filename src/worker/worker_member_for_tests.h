// Test helper shared by the worker integration tests: one Worker with its
// own NATS connection and metrics registry, as a worker process has.
#pragma once

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "common/metrics.h"
#include "queue/nats_client.h"
#include "worker/worker.h"

namespace shoal::testing {

struct WorkerMember {
  std::unique_ptr<NatsClient> client;
  std::unique_ptr<MetricsRegistry> metrics;
  std::unique_ptr<Worker> worker;  // null when it failed to start (the failure is reported)

  int64_t Counter(const std::string& name, const Labels& labels) const {
    return metrics->GetCounter(name, "", labels)->Value();
  }
  // Observations of a histogram with LatencyBuckets().
  int64_t Observed(const std::string& name, const Labels& labels) const {
    return metrics->GetHistogram(name, "", labels, LatencyBuckets())->Count();
  }
};

// Connects to `nats_url` and starts a Worker with `options`.
inline WorkerMember StartWorkerMember(const std::string& nats_url, const WorkerOptions& options) {
  WorkerMember m;
  NatsOptions no;
  no.url = nats_url;
  auto c = NatsClient::Connect(no);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return m;
  m.client = std::move(c).value();
  m.metrics = std::make_unique<MetricsRegistry>();
  auto w = Worker::Create(options, m.client.get(), m.metrics.get());
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  if (w.ok()) m.worker = std::move(w).value();
  return m;
}

}  // namespace shoal::testing
