// Shared helpers of the kernels: input views, error messages in the words of the numpy references
// (moe_onnx/ops/_common.py), shape checks and fp16/bf16 <-> fp32 conversions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "ort_api.h"

namespace moe_onnx {

using ElemType = ONNXTensorElementDataType;

// Readable name of an element type, as the references print it (float32, int64, bfloat16...).
const char* elem_name(ElemType type);
size_t elem_size(ElemType type);
// Every numeric tensor element type (for registering one kernel variant per type of an input).
const std::vector<ElemType>& numeric_types();

// Python's repr of a float (shortest round trip, "nan", "inf", "1.0"), for messages.
std::string py_float(double value);
// Python's repr of UTF-8 bytes decoded as Python decodes them with errors="replace" ('GEMM3',
// "it's", 'a\x00b', 'a\ufffd' shown as the character), for messages: the quotes Python picks,
// control characters escaped (a raw NUL would cut onnxruntime's message short), invalid UTF-8 as
// U+FFFD (onnxruntime's Python binding cannot decode a message with it). Escapes the non-printable
// characters up to U+00FF only (Python also escapes e.g. U+200B).
std::string py_str(const std::string& value);
// "[7, 8]"
std::string fmt_shape(const std::vector<int64_t>& shape);

// An error of the op's contract: becomes an onnxruntime INVALID_ARGUMENT error.
[[noreturn]] void throw_invalid(const std::string& message);

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

std::vector<Input> read_inputs(const Ort::KernelContext& ctx, size_t n_formal);
// A tensor value viewed as an Input (present; data null when it has no elements).
Input tensor_input(const Ort::ConstValue& value);

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

// The formal signature of an op as moe_onnx/ops/signatures.py declares it. The build generates one
// per op (custom_ops/cmake/gen_op_tables.py): moe_onnx::signatures::<op name> in op_signatures.h.
struct OpSignature {
  const char* name;
  std::vector<FormalParam> inputs;
  std::vector<FormalParam> outputs;
  std::vector<FormalAttr> attributes;

  // The attribute called `name` (an internal error when the op has none).
  const FormalAttr& attribute(const char* name) const;
};

// The checks of the references' NodeView, with the same wording, over concrete inputs.
class Checker {
 public:
  Checker(std::string where, const OpSignature& op, const std::vector<Input>& inputs)
      : where_(std::move(where)), op_(op), inputs_(inputs) {}

  [[noreturn]] void fail(const std::string& subject, const std::string& message) const;
  std::string input_name(size_t i) const { return std::string("input '") + name(i) + "'"; }
  const char* name(size_t i) const { return op_.inputs[i].name; }
  bool has(size_t i) const { return i < inputs_.size() && inputs_[i].present; }
  const Input& require(size_t i) const;
  // Input i's element type, after checking it is one the signature allows.
  ElemType expect_elem(size_t i) const;
  void expect_same_elem(size_t i, size_t ref) const;
  const std::vector<int64_t>& expect_rank(size_t i, int rank, int min_rank = -1) const;

 private:
  std::string where_;
  const OpSignature& op_;
  const std::vector<Input>& inputs_;
};

// Binds named sizes (E, H, k...) to the first value seen and reports disagreements.
class DimBinder {
 public:
  explicit DimBinder(const Checker& checker) : checker_(checker) {}
  int64_t bind(const std::string& symbol, int64_t value, const std::string& source);
  // Bind each dim of input i to its symbol: "" skips a dim, "2X" binds X to half an even dim.
  void shape(size_t i, const std::vector<std::string>& symbols);
  int64_t get(const std::string& symbol) const;

 private:
  const Checker& checker_;
  std::map<std::string, std::pair<int64_t, std::string>> values_;
};

int64_t product(const std::vector<int64_t>& dims, size_t begin, size_t end);

// "MOE node 'name'" (or "MOE" for an unnamed node), as NodeView.where() says it.
std::string node_where(const char* op, const Ort::ConstKernelInfo& info);

// ---------------------------------------------------------------------------- conversions

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {                         // below the smallest normal half: subnormal or zero
    if (ax < 0x33000000u) return sign;            // < 2^-25: rounds to zero
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ax + 0xc8000fffu + ((ax >> 13) & 1u);  // rebias (-112 << 23) and round
  return sign | static_cast<uint16_t>(r >> 13);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// dst[i] = float(src[i]) for a float32/float16/bfloat16 buffer.
void to_float(ElemType type, const void* src, float* dst, int64_t n);
// dst[i] = T(src[i]) for a float32/float16/bfloat16 destination.
void from_float(ElemType type, const float* src, void* dst, int64_t n);

// Memory a kernel cannot have: "cannot allocate N bytes for <what>" (count elements of
// element_bytes each, N exact even past 2^64). create_kernel_status and compute_status put the
// node before it.
class AllocationFailure : public std::bad_alloc {
 public:
  AllocationFailure(uint64_t count, size_t element_bytes, const std::string& what);
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// v = `count` copies of `value`, for `what` (messages): failing, or past what a vector can hold, is
// an AllocationFailure.
template <class T>
void allocate(std::vector<T>& v, int64_t count, const T& value, const char* what) {
  const uint64_t n = count < 0 ? 0 : static_cast<uint64_t>(count);
  if (n > v.max_size()) throw AllocationFailure(n, sizeof(T), what);
  try {
    v.assign(static_cast<size_t>(n), value);
  } catch (const std::bad_alloc&) {
    throw AllocationFailure(n, sizeof(T), what);
  }
}

// An AllocationFailure for `what` unless a tensor of this shape, element_bytes each, has at most
// INT64_MAX bytes (onnxruntime's size arithmetic overflows past that, in words naming nothing).
void check_allocatable(const std::vector<int64_t>& shape, size_t element_bytes, const std::string& what);

// The status of an exception escaping kernel creation or Compute: the op's errors as they are
// (their messages name the node), memory and other failures prefixed with `where`.
OrtStatusPtr exception_status(const OrtApi& api, const std::string& where);

// Runs `make` (which builds the kernel of `op`'s node) and reports an exception as the status
// onnxruntime expects.
template <class Make>
OrtStatusPtr create_kernel_status(const OrtApi& api, const char* op, const OrtKernelInfo* info, void** kernel,
                                  Make&& make) {
  try {
    *kernel = make();
    return nullptr;
  } catch (...) {
    return exception_status(api, node_where(op, Ort::ConstKernelInfo(info)));
  }
}

// Runs `compute` and reports an exception as a status (INVALID_ARGUMENT for the op's contract).
template <class Compute>
OrtStatusPtr compute_status(const std::string& where, Compute&& compute) {
  try {
    compute();
    return nullptr;
  } catch (...) {
    return exception_status(Ort::GetApi(), where);
  }
}

}  // namespace moe_onnx
