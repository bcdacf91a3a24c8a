// QMOE: MOE with quantized expert weights (moe_onnx/ops/qmoe.py is its meaning; docs/ops/QMOE.md its
// doc). The routing, task plan, activations and run buffers are MOE's (expert_block.h); the weights
// are packed as quantized panels (packed_weights.h, qgemm.h) and decoded inside the GEMM.
#pragma once

#include <memory>
#include <string>

#include "constant_experts.h"
#include "expert_block.h"
#include "op_signatures.h"
#include "packed_weights.h"
#include "status.h"
#include "workspace.h"

namespace moe_onnx {

// The quantization attributes (bits, block_size, quant_type, accuracy_level) after their checks.
struct Quantization {
  int64_t bits = 4;
  int64_t block_size = 0;  // 0: per column
  bool mxfp4 = false;
  bool int8_activations = false;  // accuracy_level 4
  bool bf16_prefill = false;      // accuracy_level 3 where the ISA table has a bf16 GEMM (qgemm.h)
};

struct QMoeKernel {
  QMoeKernel(const OrtKernelInfo* info, ElemType hidden_type, const PackedWeightsFiles* files);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  ExpertConfig config;
  Quantization quant;
  ExpertPacker packing;
  std::unique_ptr<ConstantExperts> constant;  // when the weights are initializers: packed on first use
  WorkspacePool workspaces{kKeptRunWorkspaces};
};

// One registration per element type of hidden_states, as MoeOp.
struct QMoeOp : Ort::CustomOpBase<QMoeOp, QMoeKernel, true> {
  // files: the packed-weights files of the sessions this op is registered for (null: none)
  QMoeOp(ONNXTensorElementDataType hidden_type, const PackedWeightsFiles* files) : hidden_type_(hidden_type), files_(files) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return signatures::QMOE.name; }
  size_t GetInputTypeCount() const { return signatures::QMOE.inputs.size(); }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? hidden_type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return signatures::QMOE.outputs.size(); }
  ONNXTensorElementDataType GetOutputType(size_t) const { return hidden_type_; }

 private:
  ONNXTensorElementDataType hidden_type_;
  const PackedWeightsFiles* files_;
};

}  // namespace moe_onnx
