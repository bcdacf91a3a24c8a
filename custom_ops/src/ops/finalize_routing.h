// MoeFinalizeRouting: un-permute the expert outputs and sum each token's k slots
// (moe_onnx/ops/finalize_routing.py is its meaning; docs/ops/MoeFinalizeRouting.md its doc).
#pragma once

#include <string>

#include "op_signatures.h"
#include "signature_op.h"
#include "status.h"

namespace moe_onnx {

struct FinalizeRoutingKernel : NodeKernel<FinalizeRoutingKernel> {
  FinalizeRoutingKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);

  bool drop_pad = false;
  bool scatter = false;
};

// One registration per element type of expanded_x (SignatureOp): the output has that type.
struct FinalizeRoutingOp : SignatureOp<FinalizeRoutingOp, FinalizeRoutingKernel, signatures::MoeFinalizeRouting> {
  using SignatureOp::SignatureOp;
  ElemType GetOutputType(size_t) const { return type_; }
};

}  // namespace moe_onnx
