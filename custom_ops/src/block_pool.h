// BlockPool: byte blocks kept between uses. A fresh block of megabytes costs a page fault per 4 KiB
// page on its first write, as much time as copying rows into it: the exchange buffers of
// MoeDistributeDispatch/Combine (exchange.cc) and the MPI staging copies (comm_mpi.cc) reuse theirs.
#pragma once

#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

namespace moe_onnx {

class BlockPool {
 public:
  // Keeps at most `kept` free blocks (the largest).
  explicit BlockPool(size_t kept) : kept_(kept) {}
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of at least `bytes` (> 0) and its capacity: the smallest free one that fits, else a new
  // one (std::bad_alloc when it cannot be had).
  std::pair<char*, size_t> take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second >= bytes && (best == free_.end() || it->second < best->second)) best = it;
      if (best != free_.end()) {
        const std::pair<char*, size_t> block = *best;
        free_.erase(best);
        return block;
      }
    }
    return {new char[bytes], bytes};
  }

  // Back to the pool; past `kept` free blocks, the smallest is freed.
  void give_back(char* block, size_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.emplace_back(block, capacity);
    if (free_.size() <= kept_) return;
    auto smallest = free_.begin();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second < smallest->second) smallest = it;
    delete[] smallest->first;
    free_.erase(smallest);
  }

 private:
  const size_t kept_;
  std::mutex mutex_;
  std::vector<std::pair<char*, size_t>> free_;  // (block, capacity)
};

}  // namespace moe_onnx
