// Memory a kernel cannot have: the error that says how much and what for (AllocationFailure), and
// the allocations that report it. Standard library only: libmoe_onnx_mpi (no onnxruntime) uses it
// through workspace.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <vector>

namespace moe_onnx {

// "cannot allocate N bytes for <what>" (count elements of element_bytes each, N exact even past
// 2^64). create_kernel_status and compute_status (status.h) put the node before it.
class AllocationFailure : public std::bad_alloc {
 public:
  AllocationFailure(uint64_t count, size_t element_bytes, const std::string& what) {
    unsigned __int128 bytes = static_cast<unsigned __int128>(count) * element_bytes;
    std::string digits;
    do {
      digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(bytes % 10)));
      bytes /= 10;
    } while (bytes);
    message_ = "cannot allocate " + digits + " bytes for " + what;
  }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// v = `count` copies of `value`, for `what` (messages): failing, or past what a vector can hold, is
// an AllocationFailure.
template <class T>
void allocate(std::vector<T>& v, int64_t count, const T& value, const char* what) {
  const uint64_t n = count < 0 ? 0 : static_cast<uint64_t>(count);
  if (n > v.max_size()) throw AllocationFailure(n, sizeof(T), what);
  try {
    v.assign(static_cast<size_t>(n), value);
  } catch (const std::bad_alloc&) {
    throw AllocationFailure(n, sizeof(T), what);
  }
}

// An AllocationFailure for `what` unless a tensor of this shape, element_bytes each, has at most
// INT64_MAX bytes (onnxruntime's size arithmetic overflows past that, in words naming nothing).
inline void check_allocatable(const std::vector<int64_t>& shape, size_t element_bytes, const std::string& what) {
  unsigned __int128 count = 1;
  for (int64_t dim : shape) {
    count *= static_cast<uint64_t>(std::max<int64_t>(dim, 0));
    if (count > std::numeric_limits<uint64_t>::max()) break;  // past any size: report what fits in the message
  }
  if (count == 0 || count * element_bytes <= static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max()))
    return;
  if (count > std::numeric_limits<uint64_t>::max()) count = std::numeric_limits<uint64_t>::max();
  throw AllocationFailure(static_cast<uint64_t>(count), element_bytes, what);
}

}  // namespace moe_onnx
