// libmoe_onnx_ops's entry point: RegisterCustomOps adds every kernel to the "moe_onnx" domain (and the
// variants of kPrivateDomain to theirs), through the registration both libraries share (registration.h);
// MoeOnnxKernelReport reports the ISA table. (The C test hooks: test_hooks.cc.)
// Adding an op: its .cc/.h in ops/, then one line in kernels() below (one variant per type of the input
// that decides the output type, see MoeOp).
#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "distribute_combine.h"
#include "distribute_dispatch.h"
#include "finalize_routing.h"
#include "gating_topk.h"
#include "init_routing.h"
#include "isa.h"
#include "moe.h"
#include "packed_file.h"
#include "qmoe.h"
#include "registration.h"
#include "row_parallel_linear.h"
#include "tensor.h"

namespace {

const char* kDomain = "moe_onnx";  // moe_onnx.DOMAIN
// Private domain: variants whose output types onnxruntime cannot infer from input types alone
// (MoeInitRouting with int8 expanded_x; moe_onnx/runtime/private_domain.py moves quantizing nodes here).
const char* kPrivateDomain = "moe_onnx.cpp";

// One instance of each op per element type, for the life of the process (onnxruntime keeps pointers to them).
template <class Op, class... Args>
void add_per_type(std::vector<const OrtCustomOp*>& all, const Args&... args) {
  for (auto type : moe_onnx::numeric_types()) all.push_back(new Op(type, args...));  // never freed
}

// The ops of the "moe_onnx" domain; the expert ops use the packed-weights files of `files`.
std::vector<const OrtCustomOp*> kernels(const moe_onnx::PackedWeightsFiles* files) {
  std::vector<const OrtCustomOp*> ops;
  add_per_type<moe_onnx::MoeOp>(ops, files);
  add_per_type<moe_onnx::QMoeOp>(ops, files);
  for (auto type : moe_onnx::numeric_types()) ops.push_back(new moe_onnx::InitRoutingOp(type, false));
  add_per_type<moe_onnx::RowParallelLinearOp>(ops, files);
  add_per_type<moe_onnx::FinalizeRoutingOp>(ops);
  add_per_type<moe_onnx::GatingTopKOp>(ops);
  add_per_type<moe_onnx::DistributeDispatchOp>(ops);
  add_per_type<moe_onnx::DistributeCombineOp>(ops);
  return ops;
}

std::vector<const OrtCustomOp*> private_kernels() {
  std::vector<const OrtCustomOp*> ops;
  for (auto type : moe_onnx::numeric_types()) ops.push_back(new moe_onnx::InitRoutingOp(type, true));
  return ops;
}

// The packed-weights settings in `options`' session config entries (packed_file.h).
moe_onnx::PackedWeightsFiles packed_weights_files(const OrtApi& api, const OrtSessionOptions* options) {
  moe_onnx::PackedWeightsFiles files;
  files.dir = moe_onnx::session_config_entry(api, options, moe_onnx::kPackedWeightsKey);
  files.write = moe_onnx::session_config_entry(api, options, moe_onnx::kPackedWeightsWriteKey) == "1";
  const std::string threads = moe_onnx::session_config_entry(api, options, moe_onnx::kPackedWeightsThreadsKey);
  files.threads = threads.empty() ? 0 : std::max(0, std::atoi(threads.c_str()));
  return files;
}

// The session's setting, named (registration.h): its packed-weights settings. An invalid MOE_ONNX_GEMM or
// MOE_ONNX_AMX fails the registration here, naming the choices.
std::string setting(const OrtApi& api, const OrtSessionOptions* options) {
  moe_onnx::kernels();
  const moe_onnx::PackedWeightsFiles files = packed_weights_files(api, options);
  return files.dir + '\n' + std::to_string(files.write) + '\n' + std::to_string(files.threads);
}

// The domains of a setting: every kernel, and the private variants.
std::vector<moe_onnx::OpDomain> domains(const OrtApi& api, const OrtSessionOptions* options) {
  // kept for the kernels of the sessions of this setting: until the process ends, as the ops
  const auto* files = new moe_onnx::PackedWeightsFiles(packed_weights_files(api, options));
  return {{kDomain, kernels(files->dir.empty() ? nullptr : files)}, {kPrivateDomain, private_kernels()}};
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  return moe_onnx::register_domains(options, api_base, setting, domains);
}

// The ISA table's report (isa.h: "level=...;gemm_panels=...;..."), or "error=" and the message when
// MOE_ONNX_GEMM or MOE_ONNX_AMX is invalid; for diagnostics (ctypes: moe_onnx.runtime.kernel_report()).
__attribute__((visibility("default"))) const char* MoeOnnxKernelReport() {
  static thread_local std::string text;
  try {
    text = moe_onnx::kernels().report();
  } catch (const std::exception& e) {
    text = std::string("error=") + e.what();
  }
  return text.c_str();
}

}  // extern "C"
