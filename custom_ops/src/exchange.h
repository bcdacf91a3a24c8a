// What MoeDistributeDispatch and MoeDistributeCombine share (moe_onnx/ops/_exchange.py is its
// Python twin): the layout attributes, assist_info's header, the op registration, count helpers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm.h"
#include "common.h"
#include "kernel_util.h"

namespace moe_onnx {

// The attributes both ops share: where the node sits and how many experts the world has.
struct ExpertLayout {
  comm::Layout ranks;
  int64_t num_experts = 0;
  int64_t local_experts() const { return num_experts / ranks.ep_size; }
};

// The layout attributes checked as read_layout in _exchange.py (same order and words).
ExpertLayout read_layout(const Attributes& attrs);

// assist_info (docs/distributed.md): a header of kHeaderLength entries, then tokens_per_rank [W],
// tp_blocks [tp], recv_counts [ep], send_counts [ep], slot_to_send [Bs * K], arrival_to_row [R].
enum AssistHeader { H_EP, H_TP, H_EXPERTS, H_TOKENS, H_K, H_ROWS, H_ARRIVALS, H_CAPACITY, kHeaderLength };
// The header entries' names, as messages say them.
extern const char* const kHeaderNames[kHeaderLength];

// counts[i] * unit: the byte or element counts of a collective.
std::vector<int64_t> scaled(const std::vector<int64_t>& counts, int64_t unit);
int64_t sum(const std::vector<int64_t>& values);

// A buffer of `count` elements for `what` (an AllocationFailure when it cannot be had).
template <class T>
std::vector<T> buffer(int64_t count, const char* what) {
  std::vector<T> v;
  allocate(v, count, T{}, what);
  return v;
}

// Byte blocks for Scratch, kept between calls in a small pool (block_pool.h) that every node of the
// process shares. A block goes back to the pool when its Scratch ends.
struct ScratchReturn {
  size_t capacity = 0;
  void operator()(char* block) const;
};
using ScratchBytes = std::unique_ptr<char[], ScratchReturn>;
// A block of at least `bytes` (the pool's smallest that fits, else a new one); may throw bad_alloc.
ScratchBytes take_scratch(size_t bytes);

// `count` elements for `what`, left unwritten (no zero-fill): for buffers written in full before they
// are read.
template <class T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(int64_t count, const char* what) {
    const uint64_t n = count < 0 ? 0 : static_cast<uint64_t>(count);
    if (n > SIZE_MAX / sizeof(T)) throw AllocationFailure(n, sizeof(T), what);
    try {
      bytes_ = take_scratch(static_cast<size_t>(n) * sizeof(T));
    } catch (const std::bad_alloc&) {
      throw AllocationFailure(n, sizeof(T), what);
    }
  }
  T* data() { return reinterpret_cast<T*>(bytes_.get()); }
  const T* data() const { return reinterpret_cast<const T*>(bytes_.get()); }
  T& operator[](int64_t i) { return data()[i]; }
  const T& operator[](int64_t i) const { return data()[i]; }

 private:
  ScratchBytes bytes_;
};

// One registration per element type of input 0 (every numeric type, so that a wrong type reaches
// Compute and gets the op's own message): output 0 has that type, the others are int64.
template <class Kernel, const OpSignature& Sig>
struct DistributeOp : Ort::CustomOpBase<DistributeOp<Kernel, Sig>, Kernel, true> {
  explicit DistributeOp(ElemType type) : type_(type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel_status(api, Sig.name, info, kernel, [&] { return new Kernel(info); });
  }
  const char* GetName() const { return Sig.name; }
  size_t GetInputTypeCount() const { return Sig.inputs.size(); }
  ElemType GetInputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return Sig.outputs.size(); }
  ElemType GetOutputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }

 private:
  ElemType type_;
};

}  // namespace moe_onnx
