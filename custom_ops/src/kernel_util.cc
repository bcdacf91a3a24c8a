#include "kernel_util.h"

namespace moe_onnx {

void Attributes::fail(const char* name, const std::string& message) const {
  throw_invalid(where_ + ": attribute '" + name + "' " + message);
}

int64_t Attributes::get_int(const char* name, int64_t fallback) const {
  int64_t value = fallback;
  return reader_.has_int(name, &value) ? value : fallback;
}

bool Attributes::has_ints(const char* name, std::vector<int64_t>* out) const {
  const OrtApi& api = Ort::GetApi();
  size_t size = 0;
  if (OrtStatus* status = api.KernelInfoGetAttributeArray_int64(reader_.info, name, nullptr, &size)) {
    api.ReleaseStatus(status);
    return false;
  }
  out->assign(size, 0);
  if (size) Ort::ThrowOnError(api.KernelInfoGetAttributeArray_int64(reader_.info, name, out->data(), &size));
  return true;
}

int64_t Attributes::choice(const char* name, int64_t fallback, const std::vector<int64_t>& choices) const {
  const int64_t value = get_int(name, fallback);
  std::string listed;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == value) return value;
    listed += (i ? ", " : "") + std::to_string(choices[i]);
  }
  fail(name, "is " + std::to_string(value) + "; expected one of " + listed);
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
