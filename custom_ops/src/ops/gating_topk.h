// MoeGatingTopK: a router's scores, group-limited top-k, renormalize and scaling
// (moe_onnx/ops/gating_topk.py is its meaning; docs/ops/MoeGatingTopK.md its doc).
#pragma once

#include <string>

#include "op_signatures.h"
#include "signature_op.h"
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

struct GatingTopKKernel : NodeKernel<GatingTopKKernel> {
  GatingTopKKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);

  GatingMode mode;
  bool scores_named = false;  // the node names output 2 (scores)
};

// One registration per element type of logits (SignatureOp): weights and scores have that type, indices
// int64.
struct GatingTopKOp : SignatureOp<GatingTopKOp, GatingTopKKernel, signatures::MoeGatingTopK> {
  using SignatureOp::SignatureOp;
  ElemType GetOutputType(size_t i) const;
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const;
};

}  // namespace moe_onnx
