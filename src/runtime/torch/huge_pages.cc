#include "runtime/torch/huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "common/process_memory.h"

namespace shoal {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// glibc's malloc maps blocks of this size and more on their own (its
// largest mmap threshold, the one the worker sets) and hands them back when
// freed, so each load faults them in again page by page. Smaller tensors
// come from malloc's heap, which keeps freed memory for reuse: mapping those
// afresh made loads of tiny-bert slower, not faster.
constexpr size_t kHugeFrom = static_cast<size_t>(kKeptBlockBytes);

// The large tensors' mappings, by the data pointer handed out. A deleter
// receives only that pointer (Allocator::raw_deleter), so it looks it up.
struct Mapping {
  size_t length = 0;  // mapped, from the data pointer on
  size_t asked = 0;   // what allocate() was asked for
};
struct Mappings {
  std::mutex mu;
  std::unordered_map<void*, Mapping> by_data;
  int64_t bytes = 0;  // asked for, summed over by_data
};

thread_local int t_scopes = 0;  // LargeTensorsOnHugePages alive on this thread

Mappings& TheMappings() {
  static auto* m = new Mappings();  // never destroyed: tensors may outlive static destructors
  return *m;
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

void Free(void* data) {
  if (data == nullptr) return;
  // Only a 2 MiB-aligned pointer can be one of ours; anything else came from
  // libtorch's default allocator (before or after installation).
  if ((reinterpret_cast<uintptr_t>(data) & (kHugePage - 1)) == 0) {
    Mappings& m = TheMappings();
    std::unique_lock<std::mutex> lock(m.mu);
    auto it = m.by_data.find(data);
    if (it != m.by_data.end()) {
      const Mapping mapping = it->second;
      m.by_data.erase(it);
      m.bytes -= static_cast<int64_t>(mapping.asked);
      lock.unlock();
      munmap(data, mapping.length);
      return;
    }
  }
  c10::GetDefaultCPUAllocator()->raw_deleter()(data);
}

class HugePageAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const override {
    // Everything else is libtorch's default allocator's, deleter included
    // (it reports to the profiler).
    if (n < kHugeFrom || t_scopes == 0) return c10::GetDefaultCPUAllocator()->allocate(n);
    void* data = MapLarge(n);
    return {data, data, &Free, c10::Device(c10::DeviceType::CPU)};
  }
  // raw_allocate() goes through allocate(), whose small blocks carry the
  // default allocator's deleter; Free hands those to it.
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

 private:
  // Maps a huge page more than asked, keeps the 2 MiB-aligned part that
  // holds the data and unmaps the rest, so no huge page is spent on a
  // neighbour. Only whole huge pages are advised; the last partial one keeps
  // small pages.
  static void* MapLarge(size_t n) {
    TORCH_CHECK(n <= SIZE_MAX / 2, "huge page allocator: cannot map ", n, " bytes");
    const size_t length = RoundUp(n, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    const size_t mapped = length + kHugePage;
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(base != MAP_FAILED, "huge page allocator: cannot map ", n, " bytes");
    auto* begin = static_cast<char*>(base);
    auto* data = reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(begin), kHugePage));
    if (data > begin) munmap(begin, static_cast<size_t>(data - begin));
    if (begin + mapped > data + length) munmap(data + length, static_cast<size_t>(begin + mapped - (data + length)));
    madvise(data, n & ~(kHugePage - 1), MADV_HUGEPAGE);  // advice only: small pages if it fails
    try {
      Mappings& m = TheMappings();
      std::lock_guard<std::mutex> lock(m.mu);
      m.by_data[data] = Mapping{length, n};
      m.bytes += static_cast<int64_t>(n);
    } catch (...) {
      munmap(data, length);
      throw;
    }
    return data;
  }
};

}  // namespace

LargeTensorsOnHugePages::LargeTensorsOnHugePages() { ++t_scopes; }
LargeTensorsOnHugePages::~LargeTensorsOnHugePages() { --t_scopes; }

int64_t LargeTensorBytesOnHugePages() {
  Mappings& m = TheMappings();
  std::lock_guard<std::mutex> lock(m.mu);
  return m.bytes;
}

std::string TransparentHugePageMode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(in, line)) return "";
  // e.g. "always [madvise] never": the bracketed word is the mode.
  const size_t open = line.find('[');
  const size_t close = line.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "";
  return line.substr(open + 1, close - open - 1);
}

bool UseHugePagesForLargeTensors() {
  static const bool installed = [] {
    const std::string mode = TransparentHugePageMode();
    if (mode != "always" && mode != "madvise") return false;
    // Never destroyed: libtorch keeps the pointer until the process ends.
    static auto* allocator = new HugePageAllocator();
    // Above the default allocator's priority (0), so it stays in place.
    c10::SetCPUAllocator(allocator, /*priority=*/1);
    return true;
  }();
  return installed;
}

}  // namespace shoal
