// Scratch memory of the kernels, one kind for every use: a Workspace hands out buffers in order and
// takes them back all at once, keeping its memory for the next use, so that work in steady state
// neither allocates nor page-faults (a fresh block of megabytes costs a page fault per 4 KiB page on
// its first write, as much time as writing it). Where a use gets its workspace:
//   - a task (a tile of C, a row in fp32, the weights a GEMM decodes): Scratch, over the running
//     thread's workspace (task_workspace()). Scratches nest: a GEMM called inside a task takes its
//     buffers after the task's, and each Scratch gives back what it took when it ends.
//   - a run or a call (MOE's gathered rows, dispatch/combine's exchange buffers, the MPI staging
//     copies): a Lease from a WorkspacePool that its owner (every MOE and QMOE node of the process
//     together, a kernel, the exchange, the MPI layer) keeps between calls; its buffers go back when
//     the Lease ends.
// Buffers are 64-byte aligned and never zeroed: every use writes a buffer before reading it, so no
// result depends on them, nor on which thread's workspace served a task. Standard library only:
// libmoe_onnx_mpi uses it too.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "allocation.h"

namespace moe_onnx {

class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Room for `count` elements of T (null for none), valid until the Scratch or Lease that took it
  // ends; failing, or past what memory can hold, is an AllocationFailure for `what`.
  template <class T>
  T* take(int64_t count, const char* what) {
    const uint64_t n = count < 0 ? 0 : static_cast<uint64_t>(count);
    if (n == 0) return nullptr;
    if (n > (SIZE_MAX - kAlignment) / sizeof(T)) throw AllocationFailure(n, sizeof(T), what);
    try {
      return static_cast<T*>(take_bytes(static_cast<size_t>(n) * sizeof(T)));
    } catch (const std::bad_alloc&) {
      throw AllocationFailure(n, sizeof(T), what);
    }
  }

  // Where the next buffer starts; rewind(mark) takes back every buffer taken after it. Rewound to
  // the start, a workspace that grew into several blocks becomes one block of their size.
  struct Mark {
    size_t block = 0, offset = 0;
  };
  Mark mark() const { return {current_, offset_}; }
  void rewind(Mark mark) noexcept {
    current_ = mark.block;
    offset_ = mark.offset;
    if (current_ != 0 || offset_ != 0 || blocks_.size() < 2) return;
    const size_t size = capacity();
    blocks_.clear();
    try {
      blocks_.push_back(new_block(size));
    } catch (const std::bad_alloc&) {  // the next use allocates what it needs
    }
  }
  // Bytes held.
  size_t capacity() const {
    size_t total = 0;
    for (const Block& b : blocks_) total += b.size;
    return total;
  }

 private:
  static constexpr size_t kAlignment = 64;
  struct Free {
    void operator()(char* p) const { ::operator delete[](p, std::align_val_t(kAlignment)); }
  };
  struct Block {
    std::unique_ptr<char[], Free> data;
    size_t size;  // a multiple of kAlignment
  };

  static Block new_block(size_t bytes) {
    const size_t size = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    return {std::unique_ptr<char[], Free>(static_cast<char*>(::operator new[](size, std::align_val_t(kAlignment)))),
            size};
  }

  // The next `bytes` (> 0, at most SIZE_MAX - kAlignment): in the current block, else in the first
  // later block with room, else in a new block of exactly that size.
  void* take_bytes(size_t bytes) {
    size_t offset = (offset_ + kAlignment - 1) / kAlignment * kAlignment;
    while (current_ < blocks_.size() && bytes > blocks_[current_].size - std::min(offset, blocks_[current_].size)) {
      ++current_;
      offset = 0;
    }
    if (current_ == blocks_.size()) {
      blocks_.reserve(blocks_.size() + 1);
      blocks_.push_back(new_block(bytes));
      offset = 0;
    }
    offset_ = offset + bytes;
    return blocks_[current_].data.get() + offset;
  }

  std::vector<Block> blocks_;
  size_t current_ = 0, offset_ = 0;  // the next buffer starts in blocks_[current_] at offset_
};

// The running thread's workspace, for the buffers of the task it runs (through Scratch).
inline Workspace& task_workspace() {
  thread_local Workspace workspace;
  return workspace;
}

// Buffers taken from a workspace for as long as this object lives (Scratches of one workspace end in
// the reverse order of their start, as scopes do).
class Scratch {
 public:
  explicit Scratch(Workspace& workspace = task_workspace()) : workspace_(workspace), mark_(workspace.mark()) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { workspace_.rewind(mark_); }

  // Workspace::take.
  template <class T>
  T* take(int64_t count, const char* what) {
    return workspace_.take<T>(count, what);
  }

 private:
  Workspace& workspace_;
  Workspace::Mark mark_;
};

// Workspaces kept between calls by their owner, each leased to one call at a time.
class WorkspacePool {
 public:
  // Keeps at most `kept` idle workspaces (the largest).
  explicit WorkspacePool(size_t kept) : kept_(kept) { idle_.reserve(kept + 1); }
  WorkspacePool(const WorkspacePool&) = delete;
  WorkspacePool& operator=(const WorkspacePool&) = delete;

  // A workspace for one call, given back (its buffers all taken back) when the Lease ends.
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { pool_.give_back(std::move(workspace_)); }
    Workspace& operator*() const { return *workspace_; }
    Workspace* operator->() const { return workspace_.get(); }

   private:
    friend class WorkspacePool;
    Lease(WorkspacePool& pool, std::unique_ptr<Workspace> workspace) : pool_(pool), workspace_(std::move(workspace)) {}
    WorkspacePool& pool_;
    std::unique_ptr<Workspace> workspace_;
  };

  // The largest idle workspace, or a new one while every one is leased.
  Lease lease() {
    std::unique_ptr<Workspace> workspace;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        const auto largest = std::max_element(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
          return a->capacity() < b->capacity();
        });
        workspace = std::move(*largest);
        idle_.erase(largest);
      }
    }
    if (!workspace) workspace = std::make_unique<Workspace>();
    return Lease(*this, std::move(workspace));
  }

 private:
  // Back to the idle ones; past `kept`, the smallest is freed.
  void give_back(std::unique_ptr<Workspace> workspace) noexcept {
    workspace->rewind({});
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(std::move(workspace));  // never past the capacity reserved: no allocation
    if (idle_.size() <= kept_) return;
    idle_.erase(std::min_element(idle_.begin(), idle_.end(),
                                 [](const auto& a, const auto& b) { return a->capacity() < b->capacity(); }));
  }

  const size_t kept_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<Workspace>> idle_;
};

}  // namespace moe_onnx
