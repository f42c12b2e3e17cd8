// Keeps a BlobOffload's one thread busy, as a slow store would, so puts
// wait in its queue: until Open(), or the end of the scope (also when an
// assertion returns early, so the offload's destructor is never left
// waiting on it). Declare it after the offload.
#pragma once

#include <future>

#include "blob/blob_offload.h"

namespace shoal::testing {

class HeldOffloadThread {
 public:
  explicit HeldOffloadThread(BlobOffload& offload) {
    std::shared_future<void> released = release_.get_future().share();
    offload.Post([released] { released.wait(); });
  }
  ~HeldOffloadThread() { Open(); }
  HeldOffloadThread(const HeldOffloadThread&) = delete;
  HeldOffloadThread& operator=(const HeldOffloadThread&) = delete;
  void Open() {
    if (opened_) return;
    opened_ = true;
    release_.set_value();
  }

 private:
  std::promise<void> release_;
  bool opened_ = false;
};

}  // namespace shoal::testing
