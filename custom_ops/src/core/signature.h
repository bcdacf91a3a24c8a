// The formal signature of an op as moe_onnx/ops/signatures.py declares it: its inputs, outputs and
// attributes, and the allowed values of its string attributes. The build generates the tables from
// the Python signatures (custom_ops/cmake/gen_op_tables.py): moe_onnx::signatures::<op name> and the
// StringChoices of every string attribute with choices in op_signatures.h, their enums in op_choices.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor.h"

namespace moe_onnx {

// A formal input or output of an op.
struct FormalParam {
  const char* name;
  bool optional;
  std::vector<ElemType> types;  // the element types it may have, in the signature's order

  bool allows(ElemType type) const { return std::find(types.begin(), types.end(), type) != types.end(); }
};

// A formal attribute of an op. int and float attributes have a numeric default, string attributes
// a text one (gen_op_tables.py refuses a default of another kind).
struct FormalAttr {
  const char* name;
  const char* kind;  // "int", "float", "string" or "ints"
  bool required;
  bool has_default;
  double default_value;
  const char* default_string = nullptr;  // a string attribute's default
};

struct OpSignature {
  const char* name;
  std::vector<FormalParam> inputs;
  std::vector<FormalParam> outputs;
  std::vector<FormalAttr> attributes;

  // The attribute called `attr_name` (an internal error when the op has none).
  const FormalAttr& attribute(const char* attr_name) const {
    for (const FormalAttr& attr : attributes)
      if (std::strcmp(attr.name, attr_name) == 0) return attr;
    throw std::logic_error(std::string("internal: ") + name + " has no attribute '" + attr_name + "'");
  }
};

// The allowed values of a string attribute, for its enum Choice (op_choices.h: value i of the
// signature's `choices` is enumerator i). Each generated specialization has
//   static constexpr const char* attribute;   the attribute's name ("expert_type")
//   static constexpr const char* names[];     the values as the signature spells them
template <class Choice>
struct StringChoices;

// The spelling of a choice ("GEMM2_ACT").
template <class Choice>
const char* choice_name(Choice choice) {
  return StringChoices<Choice>::names[static_cast<size_t>(choice)];
}

}  // namespace moe_onnx
