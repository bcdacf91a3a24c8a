// A node's attributes, read at kernel creation: onnxruntime's readers (AttrReader) and the op's
// signature applied to them (Attributes: types, defaults, allowed values), failing in the words of
// the references' NodeView.attr and check_choice.
#pragma once

#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "messages.h"
#include "signature.h"

namespace moe_onnx {

// Reads attributes at kernel creation; absent ones are reported by `has`.
struct AttrReader {
  const OrtKernelInfo* info;
  bool has_string(const char* name, std::string* out) const;
  bool has_float(const char* name, float* out) const;
  bool has_int(const char* name, int64_t* out) const;
  bool has_ints(const char* name, std::vector<int64_t>* out) const;
  bool has_floats(const char* name, std::vector<float>* out) const;
  // "attribute 'x' has type INT; expected FLOAT" when the node gives attribute `name` with another
  // ONNX type than `kind` ("int", "float", "string", "ints", "floats") says; "" when it is absent or
  // has that type. onnxruntime's C API tells types apart only by which reader succeeds: FLOAT, INT,
  // STRING, TENSOR and non-empty INTS/FLOATS are named as check_attribute_types (Python) names them;
  // an empty list, STRINGS, GRAPH and the other kinds cannot be told apart (a list kind takes them
  // as an empty list; a scalar kind says so).
  std::string type_problem(const char* name, const char* kind) const;
};

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
  // The string attribute of Choice (or its default) after checking it is one of the values its
  // signature allows (check_choice in Python).
  template <class Choice>
  Choice choice() const {
    using Values = StringChoices<Choice>;
    const std::string value = get_string(Values::attribute);
    for (size_t i = 0; i < std::size(Values::names); ++i)
      if (value == Values::names[i]) return static_cast<Choice>(i);
    fail(Values::attribute,
         "is " + py_str(value) + "; expected one of " + quoted(Values::names, std::size(Values::names)));
  }

 private:
  // The default of an absent attribute (fails "is required" when it has to be given).
  double default_of(const char* name) const;
  // "'a', 'b'" as Python lists the reprs of the choices.
  static std::string quoted(const char* const* names, size_t count);

  AttrReader reader_;
  const OpSignature& op_;
  std::string where_;
};

// A group's size attribute (>= 1) and this rank's index in it ([0, size)), as check_group_attrs
// (Python) checks them: {size, rank}.
std::pair<int64_t, int64_t> read_group(const Attributes& attrs, const char* size_name, const char* rank_name);

}  // namespace moe_onnx
