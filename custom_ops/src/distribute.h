// MoeDistributeDispatch and MoeDistributeCombine: expert parallelism over the ranks of a layout
// (moe_onnx/ops/distribute.py is their meaning; docs/distributed.md the path of the rows and the
// assist_info layout; docs/ops/MoeDistributeDispatch.md and MoeDistributeCombine.md their docs).
#pragma once

#include <string>

#include "comm.h"
#include "common.h"
#include "op_signatures.h"

namespace moe_onnx {

// The attributes both ops share: where the node sits and how many experts the world has.
struct ExpertLayout {
  comm::Layout ranks;
  int64_t num_experts = 0;
  int64_t local_experts() const { return num_experts / ranks.ep_size; }
};

struct DistributeDispatchKernel {
  DistributeDispatchKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  ExpertLayout layout;
  int64_t capacity = 0;  // 0: dropless
};

struct DistributeCombineKernel {
  DistributeCombineKernel(const OrtKernelInfo* info);
  void Compute(OrtKernelContext* context);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  std::string where;
  ExpertLayout layout;
  bool gather_tokens = false;
};

// One registration per element type of input 0 (every numeric type, so that a wrong type reaches
// Compute and gets the op's own message). Dispatch's expand_x and combine's out have that type.
template <class Kernel, const OpSignature& Sig>
struct DistributeOp : Ort::CustomOpBase<DistributeOp<Kernel, Sig>, Kernel, true> {
  explicit DistributeOp(ElemType type) : type_(type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel_status(api, Sig.name, info, kernel, [&] { return new Kernel(info); });
  }
  const char* GetName() const { return Sig.name; }
  size_t GetInputTypeCount() const { return Sig.inputs.size(); }
  ElemType GetInputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return Sig.outputs.size(); }
  ElemType GetOutputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }

 private:
  ElemType type_;
};

using DistributeDispatchOp = DistributeOp<DistributeDispatchKernel, signatures::MoeDistributeDispatch>;
using DistributeCombineOp = DistributeOp<DistributeCombineKernel, signatures::MoeDistributeCombine>;

}  // namespace moe_onnx
