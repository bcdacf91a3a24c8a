#include "attributes.h"

#include <cstring>
#include <stdexcept>

#include "status.h"

namespace moe_onnx {

bool AttrReader::has_string(const char* name, std::string* out) const {
  size_t size = 0;
  const OrtApi& api = Ort::GetApi();
  OrtStatus* status = api.KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (status) {
    api.ReleaseStatus(status);
    return false;
  }
  std::string value(size, '\0');
  Ort::ThrowOnError(api.KernelInfoGetAttribute_string(info, name, &value[0], &size));
  value.resize(size ? size - 1 : 0);
  *out = value;
  return true;
}

bool AttrReader::has_float(const char* name, float* out) const {
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_float(info, name, out);
  if (status) Ort::GetApi().ReleaseStatus(status);
  return status == nullptr;
}

bool AttrReader::has_int(const char* name, int64_t* out) const {
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, out);
  if (status) Ort::GetApi().ReleaseStatus(status);
  return status == nullptr;
}

namespace {

// An array attribute through `get` (KernelInfoGetAttributeArray_int64 or _float); false when absent.
template <class T, class Get>
bool read_array(const OrtKernelInfo* info, const char* name, std::vector<T>* out, Get get) {
  size_t size = 0;
  if (OrtStatus* status = get(info, name, nullptr, &size)) {
    Ort::GetApi().ReleaseStatus(status);
    return false;
  }
  out->assign(size, T());
  if (size) Ort::ThrowOnError(get(info, name, out->data(), &size));
  return true;
}

}  // namespace

bool AttrReader::has_ints(const char* name, std::vector<int64_t>* out) const {
  return read_array(info, name, out, Ort::GetApi().KernelInfoGetAttributeArray_int64);
}

bool AttrReader::has_floats(const char* name, std::vector<float>* out) const {
  return read_array(info, name, out, Ort::GetApi().KernelInfoGetAttributeArray_float);
}

namespace {

// The ONNX type a node gives attribute `name` with, as far as the C API tells: "" when absent, "?"
// when present but unreadable as any type (an empty list, STRINGS, GRAPH...): the array readers
// accept an attribute of any type, as the elements of their own list.
std::string given_attr_type(const AttrReader& reader, const char* name) {
  float f;
  int64_t i;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<float> floats;
  if (reader.has_float(name, &f)) return "FLOAT";
  if (reader.has_int(name, &i)) return "INT";
  if (reader.has_string(name, &s)) return "STRING";
  const bool present = reader.has_ints(name, &ints) && reader.has_floats(name, &floats);
  if (!ints.empty()) return "INTS";
  if (!floats.empty()) return "FLOATS";
  OrtValue* tensor = nullptr;
  Ort::AllocatorWithDefaultOptions allocator;
  if (OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_tensor(reader.info, name, allocator, &tensor)) {
    Ort::GetApi().ReleaseStatus(status);
  } else {
    Ort::GetApi().ReleaseValue(tensor);
    return "TENSOR";
  }
  return present ? "?" : "";
}

}  // namespace

std::string AttrReader::type_problem(const char* name, const char* kind) const {
  const std::string expected = std::strcmp(kind, "int") == 0      ? "INT"
                               : std::strcmp(kind, "float") == 0  ? "FLOAT"
                               : std::strcmp(kind, "string") == 0 ? "STRING"
                               : std::strcmp(kind, "ints") == 0   ? "INTS"
                                                                  : "FLOATS";
  const std::string given = given_attr_type(*this, name);
  const bool list = expected == "INTS" || expected == "FLOATS";
  if (given.empty() || given == expected || (given == "?" && list)) return "";  // an empty list passes
  const std::string prefix = std::string("attribute '") + name + "' ";
  if (given == "?")
    return prefix + "has an empty list or a type onnxruntime does not show kernels (STRINGS, GRAPH...); expected " +
           expected;
  return prefix + "has type " + given + "; expected " + expected;
}

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

std::string Attributes::quoted(const char* const* names, size_t count) {
  std::string listed;
  for (size_t i = 0; i < count; ++i) listed += (i ? ", " : "") + py_str(names[i]);
  return listed;
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

}  // namespace moe_onnx
