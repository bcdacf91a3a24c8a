// The memory of packed panels and of the weights they are packed from: the panels' buffers (huge pages,
// address space reserved without committing memory) and advice to the kernel on the pages of weights
// that onnxruntime mapped from an external data file (map them at once before packing, reclaim them
// after).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe_onnx {

// A buffer for panels of `bytes` bytes, not touched here (pack writes every byte of a slot). Large ones
// (Linux) are an anonymous mapping with MAP_NORESERVE: every slot's address space is reserved without
// committing memory, so only the slots pack writes take any, and a model larger than memory plus swap
// still starts (its experts packed on first use, or its panels mapped from a packed-weights file, when
// this buffer is never touched); 2 MB aligned and marked for transparent huge pages, so streaming
// hundreds of MB of panels does not miss the TLB every 4 KB. `mapped`: the mapping's bytes, 0 for
// malloc's. std::bad_alloc when it cannot be had.
char* allocate_panels(size_t bytes, size_t* mapped);

// Frees a buffer of allocate_panels: an anonymous mapping of `mapped` bytes (munmap), or malloc's (0).
struct PanelsFree {
  size_t mapped = 0;
  void operator()(char* p) const;
};

// The file of the mapping that holds all of [data, data + bytes) (/proc/self/maps: onnxruntime's mapping
// of external data): its device (major, minor), inode and path.
struct MappedFile {
  unsigned major = 0, minor = 0;
  uint64_t inode = 0;
  std::string path;
};
// Whether [data, data + bytes) lies in one mapping of a file; its file in `file` when given.
bool in_file_mapping(const void* data, size_t bytes, MappedFile* file = nullptr);

// madvise(advice) on the pages of [first, first + bytes): those wholly inside it (inner) or every page
// it touches. A hint: failing costs time only.
void advise_pages(const char* first, size_t bytes, int advice, bool inner);

}  // namespace moe_onnx
