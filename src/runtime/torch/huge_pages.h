// Transparent huge pages for the weights of TorchScript models.
//
// A model load writes its weights into freshly allocated memory, and every
// 4 KiB page of it costs a page fault; on a virtual machine a fault costs
// several microseconds more. Tensors of 32 MiB and more (an embedding table
// of a BERT-sized vocabulary) are mapped by malloc on their own and faulted
// in page by page at every load. Backing them with 2 MiB pages takes 512
// times fewer faults: loading MiniLM-L6 (90 MB, a 47 MB embedding table)
// took about half the time on the 2-vCPU machine of docs/BENCHMARKS.md
// (shoal_bench_load). Smaller tensors still come from malloc, whose heap
// keeps freed memory for reuse (see KeepFreedMemory in
// common/process_memory.h).
//
// Only allocations made on a thread inside a LargeTensorsOnHugePages scope
// (TorchScriptRuntime::Load opens one) get huge pages. A forward pass's
// activations are allocated as before.
//
// Process-wide: UseHugePagesForLargeTensors replaces libtorch's CPU
// allocator for the life of the process and cannot be undone (a tensor
// allocated by it may be freed later). Each such tensor is its own
// anonymous mapping, returned to the system when freed, so an evicted
// model's largest tensors leave the process at once. Torch-free header.
#pragma once

#include <cstdint>
#include <string>

namespace shoal {

// Installs the allocator once; later calls do nothing. Returns false, and
// installs nothing, when the kernel offers no transparent huge pages
// (/sys/kernel/mm/transparent_hugepage/enabled is "never" or absent).
bool UseHugePagesForLargeTensors();

// While alive, tensors of 32 MiB and more allocated on this thread get huge
// pages (once UseHugePagesForLargeTensors has installed the allocator).
// Nests.
class LargeTensorsOnHugePages {
 public:
  LargeTensorsOnHugePages();
  ~LargeTensorsOnHugePages();
  LargeTensorsOnHugePages(const LargeTensorsOnHugePages&) = delete;
  LargeTensorsOnHugePages& operator=(const LargeTensorsOnHugePages&) = delete;
};

// Bytes of live tensors allocated on huge pages (advised; the kernel may
// still back some with small pages).
int64_t LargeTensorBytesOnHugePages();

// The kernel's transparent huge page mode ("always", "madvise", "never"),
// or "" when it cannot be read.
std::string TransparentHugePageMode();

}  // namespace shoal
