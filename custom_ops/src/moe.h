// MOE: the fused experts block (moe_onnx/ops/moe.py is its meaning; docs/ops/MOE.md its doc).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common.h"

namespace moe_onnx {

enum class ExpertType { kGemm2BiasSwigluClamp, kGemm3Swiglu };

// Expert weights in the GEMM's packed layout, fp32 (see moe.cc).
struct MoePacked {
  int64_t E = 0, H = 0, I = 0;
  std::vector<float> w0, b0, w1, b1;  // per expert: gate/up panels, gate/up bias, down panels, down bias
  int64_t w0_stride() const;
  int64_t b0_stride() const;
  int64_t w1_stride() const;
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
};

// One registration per element type of hidden_states (every tensor type, the invalid ones included,
// so that a wrong type reaches Compute and gets the op's own error): the output has that type, which
// is how onnxruntime learns the output type (other inputs are dynamically typed).
struct MoeOp : Ort::CustomOpBase<MoeOp, MoeKernel, true> {
  explicit MoeOp(ONNXTensorElementDataType hidden_type) : hidden_type_(hidden_type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "MOE"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? hidden_type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const;
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return hidden_type_; }

 private:
  ONNXTensorElementDataType hidden_type_;
};

}  // namespace moe_onnx
