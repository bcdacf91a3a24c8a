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
#include "signature_op.h"
#include "status.h"

namespace moe_onnx {

// The quantization attributes (bits, block_size, quant_type, accuracy_level) after their checks.
struct Quantization {
  int64_t bits = 4;
  int64_t block_size = 0;  // 0: per column
  bool mxfp4 = false;
  bool int8_activations = false;  // accuracy_level 4
  bool bf16_prefill = false;      // accuracy_level 3 where the ISA table has a bf16 GEMM (qgemm.h)
};

struct QMoeKernel : NodeKernel<QMoeKernel> {
  QMoeKernel(const OrtKernelInfo* info, ElemType hidden_type, const PackedWeightsFiles* files);
  void Compute(OrtKernelContext* context);

  ExpertConfig config;
  Quantization quant;
  ExpertPacker packing;
  std::unique_ptr<ConstantExperts> constant;  // when the weights are initializers: packed on first use
};

// One registration per element type of hidden_states (SignatureOp): the output has that type.
struct QMoeOp : SignatureOp<QMoeOp, QMoeKernel, signatures::QMOE> {
  // files: the packed-weights files of the sessions this op is registered for (null: none)
  QMoeOp(ElemType hidden_type, const PackedWeightsFiles* files) : SignatureOp(hidden_type), files_(files) {}
  QMoeKernel* make_kernel(const OrtKernelInfo* info) const { return new QMoeKernel(info, type_, files_); }
  ElemType GetOutputType(size_t) const { return type_; }

 private:
  const PackedWeightsFiles* files_;
};

}  // namespace moe_onnx
