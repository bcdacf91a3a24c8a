// MoeFinalizeRouting: un-permute the expert outputs and sum each token's k slots
// (moe_onnx/ops/finalize_routing.py is its meaning; docs/ops/MoeFinalizeRouting.md its doc).
#pragma once

#include <string>

#include "op_signatures.h"
#include "status.h"

namespace moe_onnx {

struct FinalizeRoutingKernel {
  FinalizeRoutingKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  bool drop_pad = false;
  bool scatter = false;
};

// One registration per element type of expanded_x (every numeric type, so that a wrong type reaches
// Compute and gets the op's own message): the output has that type.
struct FinalizeRoutingOp : Ort::CustomOpBase<FinalizeRoutingOp, FinalizeRoutingKernel, true> {
  explicit FinalizeRoutingOp(ElemType type) : type_(type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return signatures::MoeFinalizeRouting.name; }
  size_t GetInputTypeCount() const { return signatures::MoeFinalizeRouting.inputs.size(); }
  ElemType GetInputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return signatures::MoeFinalizeRouting.outputs.size(); }
  ElemType GetOutputType(size_t) const { return type_; }

 private:
  ElemType type_;
};

}  // namespace moe_onnx
