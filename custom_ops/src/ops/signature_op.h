// What every op's registration with onnxruntime shares, from the op's generated signature
// (op_signatures.h): SignatureOp, the op struct (name, arity, the types and characteristics of the
// inputs, the kernel's creation with its errors as statuses), and NodeKernel, what each kernel starts
// from (the node as messages name it, Compute with its errors as statuses).
#pragma once

#include <string>

#include "signature.h"
#include "status.h"
#include "tensor.h"

namespace moe_onnx {

// An op registered once per element type of input 0, every numeric type, the invalid ones too (so that
// a wrong type reaches Compute and gets the op's own message): input 0 has that type, the others are
// typed at Compute, and every input is optional for onnxruntime (a missing one gets the op's own message
// too). Op gives GetOutputType (onnxruntime learns the output types from the registration, not from a
// node's attributes) and, when its kernel takes more than the node's info, make_kernel.
template <class Op, class Kernel, const OpSignature& kSignature>
struct SignatureOp : Ort::CustomOpBase<Op, Kernel, true> {
  explicit SignatureOp(ElemType type) : type_(type) {}
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel_status(api, kSignature.name, info, kernel,
                                [&] { return static_cast<const Op*>(this)->make_kernel(info); });
  }
  Kernel* make_kernel(const OrtKernelInfo* info) const { return new Kernel(info); }
  const char* GetName() const { return kSignature.name; }
  size_t GetInputTypeCount() const { return kSignature.inputs.size(); }
  ElemType GetInputType(size_t i) const { return i == 0 ? type_ : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_OPTIONAL; }
  size_t GetOutputTypeCount() const { return kSignature.outputs.size(); }

 protected:
  ElemType type_;  // of input 0
};

// A node's kernel: `where` names the node in its messages, and ComputeV2 runs Kernel::Compute with any
// error as the status onnxruntime expects (INVALID_ARGUMENT for the op's contract).
template <class Kernel>
struct NodeKernel {
  NodeKernel(const OpSignature& op, const OrtKernelInfo* info)
      : where(node_where(op.name, Ort::ConstKernelInfo(info))) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return compute_status(where, [&] { static_cast<Kernel*>(this)->Compute(context); });
  }

  std::string where;
};

}  // namespace moe_onnx
