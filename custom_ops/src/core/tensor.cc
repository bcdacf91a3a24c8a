#include "tensor.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moe_onnx {

const char* elem_name(ElemType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return "int16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return "uint16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return "uint32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return "uint64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING: return "string";
    default: return "undefined";
  }
}

size_t elem_size(ElemType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return 8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return 1;
    default: return 0;
  }
}

const std::vector<ElemType>& numeric_types() {
  static const std::vector<ElemType> types = {
      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,    ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16,  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16,  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,   ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64,
      ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL};
  return types;
}

FloatType float_type(ElemType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return FloatType::kF32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return FloatType::kF16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return FloatType::kBF16;
    default: throw std::logic_error(std::string("internal: ") + elem_name(type) + " is not a float type");
  }
}

std::vector<Input> read_inputs(const Ort::KernelContext& ctx, size_t n_formal) {
  std::vector<Input> inputs(n_formal);
  const size_t n = std::min(ctx.GetInputCount(), n_formal);
  for (size_t i = 0; i < n; ++i) {
    Ort::ConstValue value = ctx.GetInput(i);
    if (value) inputs[i] = tensor_input(value);
  }
  return inputs;
}

Input tensor_input(const Ort::ConstValue& value) {
  Input in;
  auto info = value.GetTensorTypeAndShapeInfo();
  in.present = true;
  in.type = info.GetElementType();
  in.shape = info.GetShape();
  in.count = static_cast<int64_t>(info.GetElementCount());
  in.data = in.count ? value.GetTensorRawData() : nullptr;
  return in;
}

bool node_has_input(const Ort::ConstKernelInfo& info, size_t i) {
  return i < info.GetInputCount() && !info.GetInputName(i).empty();
}

bool node_has_output(const Ort::ConstKernelInfo& info, size_t i) {
  return i < info.GetOutputCount() && !info.GetOutputName(i).empty();
}

Input constant_input(const Ort::ConstKernelInfo& info, size_t i) {
  Input in;
  if (!node_has_input(info, i)) return in;
  int is_constant = 0;
  Ort::ConstValue value = info.GetTensorConstantInput(i, &is_constant);
  return is_constant && value ? tensor_input(value) : in;
}

int64_t product(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

}  // namespace moe_onnx
