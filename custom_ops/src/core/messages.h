// The words of the kernels' messages, as the numpy references (moe_onnx/ops/_common.py) write them:
// Python's repr of floats and strings, shapes and positions as numpy prints them, a node's name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ort_api.h"

namespace moe_onnx {

// Python's repr of a float (shortest round trip, "nan", "inf", "1.0").
std::string py_float(double value);
// Python's repr of UTF-8 bytes decoded as Python decodes them with errors="replace" ('GEMM3',
// "it's", 'a\x00b', 'a\ufffd' shown as the character): the quotes Python picks, control characters
// escaped (a raw NUL would cut onnxruntime's message short), invalid UTF-8 as U+FFFD (onnxruntime's
// Python binding cannot decode a message with it). Escapes the non-printable characters up to U+00FF
// only (Python also escapes e.g. U+200B).
std::string py_str(const std::string& value);
// "[7, 8]"
std::string fmt_shape(const std::vector<int64_t>& shape);
// "[2, 1]": the position of flat element f in a tensor of this shape (numpy's unravel_index).
std::string fmt_position(const std::vector<int64_t>& shape, int64_t f);
// "MOE node 'name'" (or "MOE" for an unnamed node), as NodeView.where() says it.
std::string node_where(const char* op, const Ort::ConstKernelInfo& info);

}  // namespace moe_onnx
