// MoeInitRouting: sort the (token, k) slots by expert and gather (optionally quantize) their rows
// (moe_onnx/ops/init_routing.py is its meaning; docs/ops/MoeInitRouting.md its doc).
#pragma once

#include <string>

#include "op_signatures.h"
#include "signature_op.h"
#include "status.h"

namespace moe_onnx {

// The checked attributes of one node (read_attributes in init_routing.py).
struct RoutingMode {
  int64_t expert_num = 0;
  int64_t active_num = -1;  // <= 0: no limit
  int64_t capacity = 0;
  bool drop_pad = false;
  int64_t count_type = 0;  // 0 cumsum, 1 count, 2 key_value
  bool count_flag = true;
  int64_t quant_mode = -1;  // -1 none, 0 static, 1 dynamic
  int64_t start = 0, end = 0;
  bool scatter = false;
  int64_t active_experts() const { return end - start; }
};

struct InitRoutingKernel : NodeKernel<InitRoutingKernel> {
  InitRoutingKernel(const OrtKernelInfo* info, ElemType output_type);
  void Compute(OrtKernelContext* context);

  RoutingMode mode;
  ElemType output_type;       // of expanded_x, as this registration declares it
  bool count_output_named;    // the node names output 2 (expert_tokens_count_or_cumsum)
};

// onnxruntime learns output types from the registration that matches the input types; it cannot
// read quant_mode. So there are two sets of registrations, one per element type of x each:
// in domain "moe_onnx" expanded_x has x's type (quant_mode -1), in the library's private domain
// "moe_onnx.cpp" it is int8 (quant_mode 0 and 1; moe_onnx.runtime moves such nodes there).
struct InitRoutingOp : SignatureOp<InitRoutingOp, InitRoutingKernel, signatures::MoeInitRouting> {
  InitRoutingOp(ElemType x_type, bool quantized) : SignatureOp(x_type), quantized_(quantized) {}
  InitRoutingKernel* make_kernel(const OrtKernelInfo* info) const {
    return new InitRoutingKernel(info, GetOutputType(0));  // expanded_x
  }
  ElemType GetOutputType(size_t i) const;
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const;

 private:
  bool quantized_;
};

}  // namespace moe_onnx
