#include "panel_memory.h"

#include <cstdint>
#include <cstdlib>
#include <new>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <fstream>
#include <sstream>
#include <string>

namespace moe_onnx {
namespace {

constexpr uintptr_t kPage = 4096;

}  // namespace

char* allocate_panels(size_t bytes, size_t* mapped) {
  constexpr size_t kHuge = size_t{2} << 20;
  *mapped = 0;
  if (bytes < 2 * kHuge) {
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw std::bad_alloc();
    return static_cast<char*>(p);
  }
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
#if defined(__linux__)
  if (rounded > SIZE_MAX - kHuge) throw std::bad_alloc();
  const size_t span = rounded + kHuge;  // room to align the start to 2 MB; the ends are unmapped
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(m), aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(m, aligned - start);
  const uintptr_t end = aligned + rounded;
  if (start + span > end) munmap(reinterpret_cast<void*>(end), start + span - end);
  char* p = reinterpret_cast<char*>(aligned);
#ifdef MADV_HUGEPAGE
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure only costs TLB misses
#endif
  *mapped = rounded;
  return p;
#else
  void* p = std::aligned_alloc(kHuge, rounded);
  if (!p) throw std::bad_alloc();
  return static_cast<char*>(p);
#endif
}

void PanelsFree::operator()(char* p) const {
#if defined(__linux__)
  if (mapped) {
    munmap(p, mapped);
    return;
  }
#endif
  std::free(p);
}

bool in_file_mapping(const void* data, size_t bytes, MappedFile* file) {
#if defined(__linux__)
  std::ifstream maps("/proc/self/maps");
  const auto first = reinterpret_cast<uintptr_t>(data), last = first + bytes;
  std::string line;
  while (std::getline(maps, line)) {
    // start-end perms offset major:minor inode path
    std::istringstream fields(line);
    uintptr_t start = 0, end = 0;
    char dash = 0, colon = 0;
    std::string perms, offset;
    unsigned major = 0, minor = 0;
    uint64_t inode = 0;
    if (!(fields >> std::hex >> start >> dash >> end >> perms >> offset >> major >> colon >> minor >> std::dec >> inode))
      continue;
    if (first < start || first >= end) continue;
    if (last > end || inode == 0) return false;
    if (file) {
      std::getline(fields >> std::ws, file->path);
      *file = {major, minor, inode, file->path};
    }
    return true;
  }
#endif
  (void)data;
  (void)bytes;
  (void)file;
  return false;
}

void advise_pages(const char* first, size_t bytes, int advice, bool inner) {
#if defined(__linux__)
  const auto start = (reinterpret_cast<uintptr_t>(first) + (inner ? kPage - 1 : 0)) / kPage * kPage;
  const auto end = (reinterpret_cast<uintptr_t>(first) + bytes + (inner ? 0 : kPage - 1)) / kPage * kPage;
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, advice);
#endif
  (void)first;
  (void)bytes;
  (void)advice;
  (void)inner;
}

}  // namespace moe_onnx
