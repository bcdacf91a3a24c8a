// MoeGatingTopK: a router's scores, group-limited top-k, renormalize and scaling
// (moe_onnx/ops/gating_topk.py is its meaning; docs/ops/MoeGatingTopK.md its doc).
#pragma once

#include <string>

#include "op_signatures.h"
#include "status.h"

namespace moe_onnx {

// The checked attributes of one node (the attribute half of _validate in gating_topk.py).
struct GatingMode {
  int64_t k = 0;
  bool sigmoid = false;
  int64_t n_group = 1;
  int64_t topk_group = 0;  // 0: n_group
  bool sum_top2 = true;
  bool renormalize = false;
  float eps = 0.0f;
  float scale = 1.0f;
};

struct GatingTopKKernel {
  GatingTopKKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  GatingMode mode;
  bool scores_named = false;  // the node names output 2 (scores)
};

// One registration per element type of logits (every numeric type, so that a wrong type reaches
// Compute and gets the op's own message): weights and scores have that type, indices int64.
struct GatingTopKOp : Ort::CustomOpBase<GatingTopKOp, GatingTopKKernel, true> {
  explicit GatingTopKOp(ElemType type) : type_(type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return signatures::MoeGatingTopK.name; }
  size_t GetInputTypeCount() const { return signatures::MoeGatingTopK.inputs.size(); }
  ElemType GetInputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return signatures::MoeGatingTopK.outputs.size(); }
  ElemType GetOutputType(size_t i) const;
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const;

 private:
  ElemType type_;
};

}  // namespace moe_onnx
