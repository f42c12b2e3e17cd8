#include "runtime/torch/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <fstream>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

namespace shoal {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// glibc's malloc maps blocks of this size and more on their own (its
// largest mmap threshold, and the one KeepFreedMemory sets) and hands them
// back when freed, so each load faults them in again page by page. Smaller
// tensors come from malloc's heap, which keeps freed memory for reuse:
// mapping those afresh made loads of tiny-bert slower, not faster.
constexpr size_t kHugeFrom = size_t{32} << 20;

// The large tensors' mappings, by the data pointer handed out. A deleter
// receives only that pointer (Allocator::raw_deleter), so it looks it up.
struct Mappings {
  std::mutex mu;
  std::unordered_map<void*, std::pair<void*, size_t>> by_data;  // data -> (base, length)
  int64_t bytes = 0;  // asked for, summed over by_data
};

thread_local int t_scopes = 0;  // LargeTensorsOnHugePages alive on this thread

Mappings& TheMappings() {
  static auto* m = new Mappings();  // never destroyed: tensors may outlive static destructors
  return *m;
}

void Free(void* data) {
  if (data == nullptr) return;
  // Only a 2 MiB-aligned pointer can be one of ours; anything else came from
  // c10::alloc_cpu (before or after installation).
  if ((reinterpret_cast<uintptr_t>(data) & (kHugePage - 1)) == 0) {
    Mappings& m = TheMappings();
    std::unique_lock<std::mutex> lock(m.mu);
    auto it = m.by_data.find(data);
    if (it != m.by_data.end()) {
      const auto [base, length] = it->second;
      m.by_data.erase(it);
      m.bytes -= static_cast<int64_t>(length - kHugePage);
      lock.unlock();
      munmap(base, length);
      return;
    }
  }
  c10::free_cpu(data);
}

class HugePageAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const override {
    void* data = n < kHugeFrom || t_scopes == 0 ? c10::alloc_cpu(n) : MapLarge(n);
    return {data, data, &Free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

 private:
  // A mapping one huge page longer than asked, so the data can start on a
  // 2 MiB boundary; only whole huge pages are advised, the tail keeps small
  // pages. The unused head is never touched, so it costs no memory.
  static void* MapLarge(size_t n) {
    const size_t length = n + kHugePage;
    void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(base != MAP_FAILED, "huge page allocator: cannot map ", n, " bytes");
    void* data = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(base) + kHugePage - 1) & ~(kHugePage - 1));
    madvise(data, n & ~(kHugePage - 1), MADV_HUGEPAGE);  // advice only: small pages if it fails
    Mappings& m = TheMappings();
    std::lock_guard<std::mutex> lock(m.mu);
    m.by_data[data] = {base, length};
    m.bytes += static_cast<int64_t>(n);
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
    static HugePageAllocator allocator;
    // Above the default allocator's priority (0), so it stays in place.
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
    return true;
  }();
  return installed;
}

}  // namespace shoal
