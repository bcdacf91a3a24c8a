#include "kernel_util.h"

#include <stdexcept>

namespace moe_onnx {

Attributes::Attributes(const OrtKernelInfo* info, const OpSignature& op, std::string where)
    : reader_{info}, op_(op), where_(std::move(where)) {
  for (const FormalAttr& attr : op_.attributes) {
    const std::string problem = reader_.type_problem(attr.name, attr.kind);
    if (!problem.empty()) throw_invalid(where_ + ": " + problem);
  }
}

void Attributes::fail(const char* name, const std::string& message) const {
  throw_invalid(where_ + ": attribute '" + name + "' " + message);
}

double Attributes::default_of(const char* name) const {
  const FormalAttr& attr = op_.attribute(name);
  if (attr.required) fail(name, "is required");
  if (!attr.has_default) throw std::logic_error(std::string("internal: attribute '") + name + "' has no default");
  return attr.default_value;
}

int64_t Attributes::get_int(const char* name) const {
  int64_t value = 0;
  return reader_.has_int(name, &value) ? value : static_cast<int64_t>(default_of(name));
}

float Attributes::get_float(const char* name) const {
  float value = 0;
  return reader_.has_float(name, &value) ? value : static_cast<float>(default_of(name));
}

std::string Attributes::get_string(const char* name) const {
  std::string value;
  if (reader_.has_string(name, &value)) return value;
  default_of(name);  // fails when the attribute is required or has no default
  return op_.attribute(name).default_string;
}

int64_t Attributes::choice(const char* name, const std::vector<int64_t>& choices) const {
  const int64_t value = get_int(name);
  std::string listed;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == value) return value;
    listed += (i ? ", " : "") + std::to_string(choices[i]);
  }
  fail(name, "is " + std::to_string(value) + "; expected one of " + listed);
}

std::pair<int64_t, int64_t> read_group(const Attributes& attrs, const char* size_name, const char* rank_name) {
  const int64_t size = attrs.get_int(size_name), rank = attrs.get_int(rank_name);
  if (size < 1) attrs.fail(size_name, "is " + std::to_string(size) + "; expected >= 1");
  if (rank < 0 || rank >= size)
    attrs.fail(rank_name, "is " + std::to_string(rank) + "; expected 0 <= " + rank_name + " < " + size_name + " = " +
                              std::to_string(size));
  return {size, rank};
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

std::string fmt_position(const std::vector<int64_t>& shape, int64_t f) {
  std::vector<int64_t> pos(shape.size());
  for (size_t a = shape.size(); a-- > 0;) {
    pos[a] = shape[a] ? f % shape[a] : 0;
    f = shape[a] ? f / shape[a] : 0;
  }
  return fmt_shape(pos);
}

}  // namespace moe_onnx
