// How much memory this process holds, for measuring what a model load adds.
#pragma once

#include <cstdint>

namespace shoal {

// Resident set size of this process in bytes, from /proc/self/statm; 0 when
// it cannot be read.
int64_t ResidentBytes();

}  // namespace shoal
