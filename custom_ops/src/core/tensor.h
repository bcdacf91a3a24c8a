// A node's tensors as the kernels see them: element types, the view of one input (Input), a node's
// inputs read at Compute and its constant ones read at kernel creation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "float_convert.h"
#include "ort_api.h"

namespace moe_onnx {

using ElemType = ONNXTensorElementDataType;

// Readable name of an element type, as the references print it (float32, int64, bfloat16...).
const char* elem_name(ElemType type);
size_t elem_size(ElemType type);
// Every numeric tensor element type (for registering one kernel variant per type of an input).
const std::vector<ElemType>& numeric_types();
// The FloatType of float32, float16 and bfloat16 (std::logic_error for another type: an internal error).
FloatType float_type(ElemType type);

// One input of a node as the kernel sees it at Compute.
struct Input {
  bool present = false;
  ElemType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t count = 0;  // number of elements

  template <class T>
  const T* as() const { return static_cast<const T*>(data); }
};

// The node's inputs at Compute, one per formal input (absent ones not present).
std::vector<Input> read_inputs(const Ort::KernelContext& ctx, size_t n_formal);
// A tensor value viewed as an Input (present; data null when it has no elements).
Input tensor_input(const Ort::ConstValue& value);

// Whether input i of the node is connected (a name, not "").
bool node_has_input(const Ort::ConstKernelInfo& info, size_t i);
// Whether output i of the node is named.
bool node_has_output(const Ort::ConstKernelInfo& info, size_t i);
// An input that is an initializer, viewed as an Input (not present when it is computed at run time).
// The view stays valid for the life of the session.
Input constant_input(const Ort::ConstKernelInfo& info, size_t i);

// Element f of an int32 or int64 tensor, widened.
inline int64_t load_index(const Input& in, int64_t f) {
  return in.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 ? in.as<int32_t>()[f] : in.as<int64_t>()[f];
}

// dims[begin] * ... * dims[end - 1].
int64_t product(const std::vector<int64_t>& dims, size_t begin, size_t end);

}  // namespace moe_onnx
