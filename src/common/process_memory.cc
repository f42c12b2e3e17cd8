#include "common/process_memory.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>

namespace shoal {

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

bool KeepFreedMemory(int64_t mmap_threshold, int64_t trim_threshold) {
  // glibc documents 32 MiB (HEAP_MAX_SIZE / 2 on 64-bit) as the most the
  // mmap threshold may be; some versions take more without effect.
  if (mmap_threshold < 0 || trim_threshold < 0 || mmap_threshold > (int64_t{32} << 20) || trim_threshold > INT32_MAX)
    return false;
  // Setting either turns off glibc's dynamic adjustment of both.
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) == 1;
  return mmap_ok && trim_ok;
}

}  // namespace shoal
