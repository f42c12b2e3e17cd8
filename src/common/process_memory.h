// How much memory this process holds, for measuring what a model load adds.
#pragma once

#include <cstdint>

namespace shoal {

// Resident set size of this process in bytes, from /proc/self/statm; 0 when
// it cannot be read.
int64_t ResidentBytes();

// Makes malloc keep memory that is freed, for reuse, instead of handing it
// back to the system at once: blocks under `mmap_threshold` bytes come from
// the heap (glibc's M_MMAP_THRESHOLD; at most 32 MiB), and the heap is
// trimmed only when more than `trim_threshold` bytes are free at its top
// (M_TRIM_THRESHOLD). Process-wide. A forward pass frees its activations
// when it ends; with glibc's defaults the next pass often faults them in
// again, page by page. Returns false when glibc refuses a value.
bool KeepFreedMemory(int64_t mmap_threshold, int64_t trim_threshold);

// The worker's values (--keep-freed-memory): glibc's largest mmap
// threshold, and the trim threshold glibc itself moves to once the process
// has freed a block that large; set from the start instead of depending on
// what the process did before.
inline constexpr int64_t kKeptBlockBytes = int64_t{32} << 20;
inline constexpr int64_t kKeptFreeBytes = int64_t{64} << 20;

}  // namespace shoal
