// MOE: the fused experts block (moe_onnx/ops/moe.py is its meaning; docs/ops/MOE.md its doc).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "op_signatures.h"

namespace moe_onnx {

enum class ExpertType { kGemm2BiasSwigluClamp, kGemm3Swiglu };

// Allocator of the packed weights: large buffers are 2 MB aligned and marked for transparent huge
// pages (Linux), so streaming hundreds of MB of panels does not miss the TLB every 4 KB.
void* allocate_panels(size_t bytes);
void free_panels(void* p, size_t bytes);
template <class T>
struct PanelAllocator {
  using value_type = T;
  PanelAllocator() = default;
  template <class U>
  PanelAllocator(const PanelAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(allocate_panels(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { free_panels(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const PanelAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const PanelAllocator<U>&) const { return false; }
};
// Expert weights in the GEMM's packed layout (see moe.cc): the panels keep the weights' own type
// (fp16/bf16 stay 16-bit, halving the bytes a decode step reads); biases are fp32.
struct MoePacked {
  int64_t H = 0, I = 0;
  PanelType type = PanelType::kF32;
  std::vector<float, PanelAllocator<float>> w0, w1;          // fp32 panels: per expert gate/up, down
  std::vector<uint16_t, PanelAllocator<uint16_t>> w0h, w1h;  // fp16/bf16 panels (bits), same layout
  std::vector<float> b0, b1;           // per expert: gate/up bias (panel layout), down bias
  int64_t w0_stride() const;           // elements per expert
  int64_t b0_stride() const;
  int64_t w1_stride() const;
  const void* w0_at(int64_t slot) const;
  const void* w1_at(int64_t slot) const;
};

// Per-run buffers, O(T*k*max(H, 2I)): gathered rows, activations, weighted expert outputs. Kept by
// the kernel between runs (a run takes them, and gives them back when no other run has), so a run
// neither allocates nor page-faults them again.
struct MoeWorkspace {
  std::vector<float> xs, act, y;
  float* get(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

struct MoeKernel {
  MoeKernel(const OrtApi& api, const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  ExpertType type = ExpertType::kGemm2BiasSwigluClamp;
  float alpha = 1.0f, beta = 0.0f;
  int64_t parity = 0;
  std::unique_ptr<MoePacked> constant;  // packed at kernel creation when the weights are initializers
  std::vector<int64_t> constant_shapes[8];
  std::mutex workspace_mutex;
  std::unique_ptr<MoeWorkspace> workspace;  // idle buffers of the last run (null while a run holds them)
};

// One registration per element type of hidden_states (every tensor type, the invalid ones included,
// so that a wrong type reaches Compute and gets the op's own error): the output has that type, which
// is how onnxruntime learns the output type (other inputs are dynamically typed).
struct MoeOp : Ort::CustomOpBase<MoeOp, MoeKernel, true> {
  explicit MoeOp(ONNXTensorElementDataType hidden_type) : hidden_type_(hidden_type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return signatures::MOE.name; }
  size_t GetInputTypeCount() const { return signatures::MOE.inputs.size(); }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? hidden_type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const;
  size_t GetOutputTypeCount() const { return signatures::MOE.outputs.size(); }
  ONNXTensorElementDataType GetOutputType(size_t) const { return hidden_type_; }

 private:
  ONNXTensorElementDataType hidden_type_;
};

}  // namespace moe_onnx
