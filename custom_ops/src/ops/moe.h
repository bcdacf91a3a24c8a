// MOE: the fused experts block (moe_onnx/ops/moe.py is its meaning; docs/ops/MOE.md its doc).
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

struct MoeKernel {
  MoeKernel(const OrtKernelInfo* info, const PackedWeightsFiles* files);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  ExpertConfig config;
  int64_t tp_size = 1, tp_rank = 0;
  int64_t accuracy_level = 0;  // 3: the bf16 GEMM where the table has one (packed_weights.h: weight_format)
  comm::TpGroup tp;  // with tp_size > 1, made at the first run (after the inputs' checks, as the reference)
  ExpertPacker packing;
  std::unique_ptr<ConstantExperts> constant;  // when the weights are initializers: packed on first use
  WorkspacePool workspaces{kKeptRunWorkspaces};
};

// One registration per element type of hidden_states (every tensor type, the invalid ones included,
// so that a wrong type reaches Compute and gets the op's own error): the output has that type, which
// is how onnxruntime learns the output type (other inputs are dynamically typed).
struct MoeOp : Ort::CustomOpBase<MoeOp, MoeKernel, true> {
  // files: the packed-weights files of the sessions this op is registered for (null: none)
  MoeOp(ONNXTensorElementDataType hidden_type, const PackedWeightsFiles* files) : hidden_type_(hidden_type), files_(files) {}
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
  const PackedWeightsFiles* files_;
};

}  // namespace moe_onnx
