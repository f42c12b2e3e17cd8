#include "common/process_memory.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include <gtest/gtest.h>

namespace shoal {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Writes every page and keeps the compiler from eliding the allocation.
void Touch(void* p, size_t n) {
  std::memset(p, 1, n);
  asm volatile("" : : "r"(p) : "memory");
}

TEST(ProcessMemoryTest, ResidentBytesGrowsWithTouchedMemory) {
  const int64_t before = ResidentBytes();
  EXPECT_GT(before, 0);
  void* p = std::malloc(64 * kMiB);
  ASSERT_NE(p, nullptr);
  Touch(p, 64 * kMiB);
  EXPECT_GE(ResidentBytes() - before, 60 * kMiB);
  std::free(p);
}

TEST(ProcessMemoryTest, KeptMemoryIsReusedByTheNextAllocationInsteadOfFaultedInAgain) {
  ASSERT_TRUE(KeepFreedMemory(32 * kMiB, 64 * kMiB));
  const size_t before_mapped = mallinfo2().hblkhd;
  void* p = std::malloc(8 * kMiB);  // an activation of a mid-sized pass
  ASSERT_NE(p, nullptr);
  Touch(p, 8 * kMiB);
  EXPECT_EQ(mallinfo2().hblkhd, before_mapped) << "8 MiB came from the heap, not a mapping of its own";
  std::free(p);
  const int64_t after_free = ResidentBytes();
  void* q = std::malloc(8 * kMiB);
  ASSERT_NE(q, nullptr);
  Touch(q, 8 * kMiB);
  EXPECT_LT(ResidentBytes() - after_free, kMiB) << "the freed block was reused";
  std::free(q);
}

TEST(ProcessMemoryTest, KeepFreedMemoryRejectsValuesGlibcCannotTake) {
  EXPECT_FALSE(KeepFreedMemory(-1, 0));
  EXPECT_FALSE(KeepFreedMemory(0, int64_t{1} << 40));
  EXPECT_FALSE(KeepFreedMemory(1024 * kMiB, 0)) << "glibc's mmap threshold is at most 32 MiB";
}

}  // namespace
}  // namespace shoal
