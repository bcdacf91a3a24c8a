// MOE: the fused experts block (moe_onnx/ops/moe.py is its meaning; docs/ops/MOE.md its doc).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "activation.h"
#include "common.h"
#include "op_signatures.h"
#include "packed_weights.h"

namespace moe_onnx {

class Attributes;

enum class ExpertType { kGemm2BiasSwigluClamp, kGemm3Swiglu, kGemm2Act };

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
  // Sets `pointwise` from the `activation` attribute after the checks of moe.py's _check_activation.
  void read_activation(const Attributes& attrs, float alpha, float beta);

  std::string where;
  ExpertType type = ExpertType::kGemm2BiasSwigluClamp;
  GatedActivation activation;  // of the SwiGLU types, with expert_alpha (and expert_beta: the clamp limit)
  PointwiseActivation pointwise;  // of GEMM2_ACT
  int64_t parity = 0;
  std::unique_ptr<PackedExperts> constant;  // packed at kernel creation when the weights are initializers
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
