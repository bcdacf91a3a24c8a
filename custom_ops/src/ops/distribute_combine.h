// MoeDistributeCombine: the expert outputs back to their tokens, weighted and summed
// (moe_onnx/ops/distribute_combine.py is its meaning; docs/distributed.md the path back and
// assist_info; docs/ops/MoeDistributeCombine.md its doc).
#pragma once

#include <string>

#include "exchange.h"
#include "op_signatures.h"
#include "signature_op.h"

namespace moe_onnx {

struct DistributeCombineKernel : NodeKernel<DistributeCombineKernel> {
  DistributeCombineKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);

  ExpertLayout layout;
  bool gather_tokens = false;
};

using DistributeCombineOp = DistributeOp<DistributeCombineKernel, signatures::MoeDistributeCombine>;

}  // namespace moe_onnx
