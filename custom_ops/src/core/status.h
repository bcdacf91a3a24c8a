// How a kernel's errors reach onnxruntime: an error of the op's contract (throw_invalid, an
// INVALID_ARGUMENT status with the op's own message), and the statuses of exceptions escaping kernel
// creation or Compute (memory and other failures prefixed with the node).
#pragma once

#include <string>

#include "allocation.h"
#include "messages.h"
#include "ort_api.h"

namespace moe_onnx {

// An error of the op's contract: becomes an onnxruntime INVALID_ARGUMENT error.
[[noreturn]] void throw_invalid(const std::string& message);

// The status of an exception escaping kernel creation or Compute: the op's errors as they are
// (their messages name the node), memory and other failures prefixed with `where`.
OrtStatusPtr exception_status(const OrtApi& api, const std::string& where);

// The session config entry `key` of `options` (read when a library is registered on them); empty when
// it is not set.
std::string session_config_entry(const OrtApi& api, const OrtSessionOptions* options, const char* key);

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
