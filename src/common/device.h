// The compute device a worker runs its TorchScript models on: "cpu" or a
// CUDA GPU ("cuda" is "cuda:0"). One worker serves one device; its memory
// budget is that device's (see docs/operations.md, "GPU workers").
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace shoal {

struct Device {
  bool cuda = false;
  int index = 0;  // CUDA device ordinal; 0 for the CPU

  // "cpu" or "cuda:N".
  std::string ToString() const { return cuda ? "cuda:" + std::to_string(index) : "cpu"; }
};

// "cpu", "cuda" or "cuda:N" (N a decimal ordinal, 0..255). Anything else is
// kInvalidArgument (reason invalid_device).
Result<Device> ParseDevice(std::string_view text);

}  // namespace shoal
