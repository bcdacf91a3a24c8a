// MoeRowParallelLinear: one linear layer per expert over contiguous row ranges
// (moe_onnx/ops/row_parallel_linear.py is its meaning; docs/ops/MoeRowParallelLinear.md its doc).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm.h"
#include "constant_experts.h"
#include "op_signatures.h"
#include "packed_weights.h"
#include "signature_op.h"
#include "status.h"
#include "workspace.h"

namespace moe_onnx {

struct RowParallelLinearKernel : NodeKernel<RowParallelLinearKernel> {
  RowParallelLinearKernel(const OrtKernelInfo* info, const PackedWeightsFiles* files);
  void Compute(OrtKernelContext* context);

  // num_experts, in_features, out_features as given (has_size false: absent)
  bool has_size[3] = {false, false, false};
  int64_t size[3] = {0, 0, 0};
  std::unique_ptr<ConstantExperts> constant;  // when W is an initializer: packed on first use
  WorkspacePool workspaces{1};              // for the runs' rows of X (float32 or int8) and TP partials
  bool input_is_parallel = false;
  int64_t accuracy_level = 0;  // 3 (float X): the bf16 GEMM where the ISA table has one
  int64_t tp_size = 1, tp_rank = 0;
  comm::TpGroup tp;  // with tp_size > 1, made at the first run (after the inputs' checks, as the reference)
  // Every TP rank's K_q (W's dim 2), gathered over the group; kept when W is an initializer.
  std::mutex widths_mutex;
  std::vector<int64_t> constant_widths;
  std::vector<int64_t> group_widths(const comm::Group& group, int64_t K_q);
};

// One registration per element type of X (SignatureOp): Y has X's type, int32 for int8 X.
struct RowParallelLinearOp : SignatureOp<RowParallelLinearOp, RowParallelLinearKernel, signatures::MoeRowParallelLinear> {
  // files: the packed-weights files of the sessions this op is registered for (null: none)
  RowParallelLinearOp(ElemType x_type, const PackedWeightsFiles* files) : SignatureOp(x_type), files_(files) {}
  RowParallelLinearKernel* make_kernel(const OrtKernelInfo* info) const {
    return new RowParallelLinearKernel(info, files_);
  }
  ElemType GetOutputType(size_t) const;

 private:
  const PackedWeightsFiles* files_;
};

}  // namespace moe_onnx
