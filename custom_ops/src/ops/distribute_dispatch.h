// MoeDistributeDispatch: every (token, k) slot to the ranks that own its expert
// (moe_onnx/ops/distribute_dispatch.py is its meaning; docs/distributed.md the path of the rows and
// assist_info; docs/ops/MoeDistributeDispatch.md its doc).
#pragma once

#include <string>

#include "exchange.h"
#include "op_signatures.h"
#include "signature_op.h"

namespace moe_onnx {

struct DistributeDispatchKernel : NodeKernel<DistributeDispatchKernel> {
  DistributeDispatchKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);

  ExpertLayout layout;
  int64_t capacity = 0;  // 0: dropless
};

using DistributeDispatchOp = DistributeOp<DistributeDispatchKernel, signatures::MoeDistributeDispatch>;

}  // namespace moe_onnx
