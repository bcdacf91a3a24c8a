// MOE: the fused experts block (moe_onnx/ops/moe.py is its meaning; docs/ops/MOE.md its doc).
#pragma once

#include <memory>
#include <string>

#include "constant_experts.h"
#include "expert_block.h"
#include "op_signatures.h"
#include "packed_weights.h"
#include "signature_op.h"
#include "status.h"

namespace moe_onnx {

struct MoeKernel : NodeKernel<MoeKernel> {
  MoeKernel(const OrtKernelInfo* info, const PackedWeightsFiles* files);
  void Compute(OrtKernelContext* context);

  ExpertConfig config;
  int64_t tp_size = 1, tp_rank = 0;
  int64_t accuracy_level = 0;  // 3: the bf16 GEMM where the table has one (packed_weights.h: weight_format)
  comm::TpGroup tp;  // with tp_size > 1, made at the first run (after the inputs' checks, as the reference)
  ExpertPacker packing;
  std::unique_ptr<ConstantExperts> constant;  // when the weights are initializers: packed on first use
};

// One registration per element type of hidden_states (SignatureOp): the output has that type.
struct MoeOp : SignatureOp<MoeOp, MoeKernel, signatures::MOE> {
  // files: the packed-weights files of the sessions this op is registered for (null: none)
  MoeOp(ElemType hidden_type, const PackedWeightsFiles* files) : SignatureOp(hidden_type), files_(files) {}
  MoeKernel* make_kernel(const OrtKernelInfo* info) const { return new MoeKernel(info, files_); }
  ElemType GetOutputType(size_t) const { return type_; }

 private:
  const PackedWeightsFiles* files_;
};

}  // namespace moe_onnx
