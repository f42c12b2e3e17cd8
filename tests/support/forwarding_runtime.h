// ForwardingRuntime: a Runtime that passes every call to an inner one. Test
// wrappers (a slow runtime, a failing one, a probe) derive from it and
// override only the calls they change. Header-only.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/runtime.h"

namespace shoal::testing {

class ForwardingRuntime : public Runtime {
 public:
  explicit ForwardingRuntime(std::unique_ptr<Runtime> inner) : inner_(std::move(inner)) {}
  Status Load(const ModelConfig& c) override { return inner_->Load(c); }
  Result<Embeddings> Run(const TokenBatch& b) override { return inner_->Run(b); }
  bool TakesItems() const override { return inner_->TakesItems(); }
  Result<std::vector<std::string>> RunItems(const std::vector<std::string>& items,
                                            const PartialSink& partial) override {
    return inner_->RunItems(items, partial);
  }
  Result<std::vector<std::string>> RunItemsBefore(const std::vector<std::string>& items,
                                                  const std::vector<int64_t>& deadlines_unix_ms,
                                                  const PartialSink& partial) override {
    return inner_->RunItemsBefore(items, deadlines_unix_ms, partial);
  }
  Result<std::vector<std::string>> RunItemsAsReady(const std::vector<std::string>& items,
                                                   const std::vector<int64_t>& deadlines_unix_ms,
                                                   const ItemCalls& calls) override {
    return inner_->RunItemsAsReady(items, deadlines_unix_ms, calls);
  }
  bool UsesDevice() const override { return inner_->UsesDevice(); }
  int ConcurrentCalls() const override { return inner_->ConcurrentCalls(); }
  bool TakesThreadCount() const override { return inner_->TakesThreadCount(); }
  void Unload() override { inner_->Unload(); }
  int64_t MemoryBytes() const override { return inner_->MemoryBytes(); }
  bool FootprintIsHostMemory() const override { return inner_->FootprintIsHostMemory(); }
  int Dim() const override { return inner_->Dim(); }
  bool Available() const override { return inner_->Available(); }
  Status Health() const override { return inner_->Health(); }
  Status DeviceHealth() const override { return inner_->DeviceHealth(); }

 protected:
  Runtime& inner() { return *inner_; }

 private:
  std::unique_ptr<Runtime> inner_;
};

}  // namespace shoal::testing
