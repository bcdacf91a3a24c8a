#include "common.h"

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>

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

std::string py_float(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  std::string s(buf);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

namespace {

// Length of the valid UTF-8 sequence at value[i], or 0 (then the maximal invalid subpart, which
// errors="replace" turns into one U+FFFD, is *invalid bytes long).
size_t utf8_sequence(const std::string& value, size_t i, size_t* invalid) {
  const auto byte = [&](size_t k) { return k < value.size() ? static_cast<unsigned char>(value[k]) : 0u; };
  const unsigned lead = byte(i);
  size_t length = 0;
  unsigned low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  }
  *invalid = 1;
  if (!length) return 0;
  for (size_t k = 1; k < length; ++k) {
    const unsigned b = byte(i + k);
    if (k == 1 ? (b < low || b > high) : (b < 0x80 || b > 0xBF)) return 0;
    *invalid = k + 1;
  }
  return length;
}

}  // namespace

std::string py_str(const std::string& value) {
  const bool double_quotes = value.find('\'') != std::string::npos && value.find('"') == std::string::npos;
  const char quote = double_quotes ? '"' : '\'';
  std::string s(1, quote);
  char buf[8];
  for (size_t i = 0; i < value.size();) {
    const char c = value[i];
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x80) {
      size_t invalid = 0;
      const size_t length = utf8_sequence(value, i, &invalid);
      const unsigned second = length ? static_cast<unsigned char>(value[i + 1]) : 0;
      const unsigned code = length == 2 ? ((byte & 0x1Fu) << 6) | (second & 0x3Fu) : 0x100;
      if (!length) {
        s += "\xEF\xBF\xBD";  // U+FFFD
      } else if (code <= 0xA0 || code == 0xAD) {  // not printable for Python: escaped
        std::snprintf(buf, sizeof buf, "\\x%02x", code);
        s += buf;
      } else {
        s.append(value, i, length);
      }
      i += length ? length : invalid;
      continue;
    }
    if (c == '\\' || c == quote) {
      s += '\\';
      s += c;
    } else if (c == '\n') {
      s += "\\n";
    } else if (c == '\r') {
      s += "\\r";
    } else if (c == '\t') {
      s += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      std::snprintf(buf, sizeof buf, "\\x%02x", byte);
      s += buf;
    } else {
      s += c;
    }
    ++i;
  }
  return s + quote;
}

std::string fmt_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

void throw_invalid(const std::string& message) { throw Ort::Exception(std::string(message), ORT_INVALID_ARGUMENT); }

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

const FormalAttr& OpSignature::attribute(const char* attr_name) const {
  for (const FormalAttr& attr : attributes)
    if (std::strcmp(attr.name, attr_name) == 0) return attr;
  throw std::logic_error(std::string("internal: ") + name + " has no attribute '" + attr_name + "'");
}

void Checker::fail(const std::string& subject, const std::string& message) const {
  throw_invalid(where_ + ": " + subject + " " + message);
}

const Input& Checker::require(size_t i) const {
  if (!has(i)) fail(input_name(i), "is required");
  return inputs_[i];
}

ElemType Checker::expect_elem(size_t i) const {
  const Input& in = require(i);
  if (op_.inputs[i].allows(in.type)) return in.type;
  const std::vector<ElemType>& allowed = op_.inputs[i].types;
  std::string names;
  for (size_t j = 0; j < allowed.size(); ++j) names += (j ? ", " : "") + std::string(elem_name(allowed[j]));
  fail(input_name(i), std::string("has type ") + elem_name(in.type) + "; expected " + names);
}

void Checker::expect_same_elem(size_t i, size_t ref) const {
  if (!has(i) || !has(ref)) return;
  if (inputs_[i].type != inputs_[ref].type)
    fail(input_name(i), std::string("has type ") + elem_name(inputs_[i].type) + "; expected " +
                            elem_name(inputs_[ref].type) + ", the type of " + input_name(ref));
}

const std::vector<int64_t>& Checker::expect_rank(size_t i, int rank, int min_rank) const {
  const auto& shape = require(i).shape;
  const int r = static_cast<int>(shape.size());
  if (rank >= 0 && r != rank)
    fail(input_name(i), "has rank " + std::to_string(r) + " (shape " + fmt_shape(shape) + "); expected rank " +
                            std::to_string(rank));
  if (min_rank >= 0 && r < min_rank)
    fail(input_name(i), "has rank " + std::to_string(r) + " (shape " + fmt_shape(shape) + "); expected rank >= " +
                            std::to_string(min_rank));
  return shape;
}

int64_t DimBinder::bind(const std::string& symbol, int64_t value, const std::string& source) {
  auto it = values_.find(symbol);
  if (it == values_.end()) {
    values_[symbol] = {value, source};
    return value;
  }
  if (it->second.first != value)
    checker_.fail(source, "is " + std::to_string(value) + "; expected " + symbol + " = " +
                              std::to_string(it->second.first) + " (from " + it->second.second + ")");
  return value;
}

void DimBinder::shape(size_t i, const std::vector<std::string>& symbols) {
  const auto& shape = checker_.require(i).shape;
  for (size_t axis = 0; axis < symbols.size() && axis < shape.size(); ++axis) {
    const std::string& symbol = symbols[axis];
    const int64_t dim = shape[axis];
    if (symbol.empty()) continue;
    if (symbol.size() > 1 && symbol[0] == '2') {
      if (dim % 2)
        checker_.fail(checker_.input_name(i), "dim " + std::to_string(axis) + " is " + std::to_string(dim) +
                                                  "; expected an even size (" + symbol + ")");
      bind(symbol.substr(1), dim / 2,
           std::string("input '") + checker_.name(i) + "' dim " + std::to_string(axis) + " (= " + symbol + ")");
    } else {
      bind(symbol, dim, std::string("input '") + checker_.name(i) + "' dim " + std::to_string(axis));
    }
  }
}

int64_t DimBinder::get(const std::string& symbol) const {
  auto it = values_.find(symbol);
  return it == values_.end() ? -1 : it->second.first;
}

int64_t product(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

std::string node_where(const char* op, const Ort::ConstKernelInfo& info) {
  std::string name;
  try {
    name = info.GetNodeName();
  } catch (const Ort::Exception&) {
  }
  return name.empty() ? std::string(op) : std::string(op) + " node '" + name + "'";
}

void to_float(ElemType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      if (n) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
      break;
    }
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
    default:
      throw_invalid(std::string("internal: to_float of ") + elem_name(type));
  }
}

void from_float(ElemType type, const float* src, void* dst, int64_t n) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      if (n) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
      break;
    }
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      break;
    }
    default:
      throw_invalid(std::string("internal: from_float to ") + elem_name(type));
  }
}

AllocationFailure::AllocationFailure(uint64_t count, size_t element_bytes, const std::string& what) {
  unsigned __int128 bytes = static_cast<unsigned __int128>(count) * element_bytes;
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(bytes % 10)));
    bytes /= 10;
  } while (bytes);
  message_ = "cannot allocate " + digits + " bytes for " + what;
}

void check_allocatable(const std::vector<int64_t>& shape, size_t element_bytes, const std::string& what) {
  unsigned __int128 count = 1;
  for (int64_t dim : shape) {
    count *= static_cast<uint64_t>(std::max<int64_t>(dim, 0));
    if (count > std::numeric_limits<uint64_t>::max()) break;  // past any size: report what fits in the message
  }
  if (count == 0 || count * element_bytes <= static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max()))
    return;
  if (count > std::numeric_limits<uint64_t>::max()) count = std::numeric_limits<uint64_t>::max();
  throw AllocationFailure(static_cast<uint64_t>(count), element_bytes, what);
}

OrtStatusPtr exception_status(const OrtApi& api, const std::string& where) {
  try {
    throw;
  } catch (const Ort::Exception& e) {
    return api.CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const AllocationFailure& e) {
    return api.CreateStatus(ORT_FAIL, (where + ": " + e.what()).c_str());
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (where + ": out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (where + ": " + e.what()).c_str());
  } catch (...) {
    return api.CreateStatus(ORT_FAIL, (where + ": unknown exception").c_str());
  }
}

}  // namespace moe_onnx
