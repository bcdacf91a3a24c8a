// Pieces the kernels share: attribute readers that fail in the references' words, views of
// constant inputs, element loads (int32/int64 indices, fp32/fp16/bf16 values) and positions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace moe_onnx {

// Attributes of one node, read at kernel creation; failures say "<where>: attribute 'x' ...".
// Construction checks that every attribute the node gives has the type of the op's signature (in
// signature order, as check_attribute_types in Python). The get_* readers apply the signature as
// NodeView.attr does: an absent attribute takes its default, or fails "is required".
class Attributes {
 public:
  Attributes(const OrtKernelInfo* info, const OpSignature& op, std::string where);
  [[noreturn]] void fail(const char* name, const std::string& message) const;
  bool has_int(const char* name, int64_t* out) const { return reader_.has_int(name, out); }
  bool has_ints(const char* name, std::vector<int64_t>* out) const { return reader_.has_ints(name, out); }
  int64_t get_int(const char* name) const;
  float get_float(const char* name) const;
  std::string get_string(const char* name) const;
  // The attribute (or its default) after checking it is one of `choices` (check_choice in Python).
  int64_t choice(const char* name, const std::vector<int64_t>& choices) const;

 private:
  // The default of an absent attribute (fails "is required" when it has to be given).
  double default_of(const char* name) const;

  AttrReader reader_;
  const OpSignature& op_;
  std::string where_;
};

// A group's size attribute (>= 1) and this rank's index in it ([0, size)), as check_group_attrs
// (Python) checks them: {size, rank}.
std::pair<int64_t, int64_t> read_group(const Attributes& attrs, const char* size_name, const char* rank_name);

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

// Element i of a float32, float16 or bfloat16 buffer, as float32.
inline float load_float(ElemType type, const void* p, int64_t i) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// "[2, 1]": the position of flat element f in a tensor of this shape (numpy's unravel_index).
std::string fmt_position(const std::vector<int64_t>& shape, int64_t f);

}  // namespace moe_onnx
