// The library's entry point: RegisterCustomOps adds every kernel to the "moe_onnx" domain (and the
// variants of kPrivateDomain to theirs).
// Adding an op: its .cc/.h, then one line in kernels() below (one variant per type of the input
// that decides the output type, see MoeOp).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "distribute_combine.h"
#include "distribute_dispatch.h"
#include "finalize_routing.h"
#include "gating_topk.h"
#include "init_routing.h"
#include "isa.h"
#include "moe.h"
#include "qmoe.h"
#include "ort_api.h"
#include "packed_file.h"
#include "packed_weights.h"
#include "parallel.h"
#include "row_parallel_linear.h"
#include "status.h"
#include "tensor.h"
#include "x86/amx/tile_dot.h"

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

// The library's domains with their ops for one packed-weights setting, made on the first registration
// with that setting and shared by every later one: onnxruntime keeps pointers to them (so they live
// until the process ends), and a session only reads them, so one set per setting serves every
// SessionOptions without growing per registration.
const std::vector<OrtCustomOpDomain*>& domains(const OrtApi& api, const moe_onnx::PackedWeightsFiles& files) {
  static std::mutex mutex;
  static std::map<std::string, std::pair<moe_onnx::PackedWeightsFiles, std::vector<OrtCustomOpDomain*>>> made;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = files.dir + '\n' + std::to_string(files.write) + '\n' + std::to_string(files.threads);
  auto found = made.find(key);
  if (found != made.end()) return found->second.second;
  auto& [kept, domains] = made[key];
  kept = files;
  for (const auto& [name, ops] : {std::make_pair(kDomain, kernels(kept.dir.empty() ? nullptr : &kept)),
                                  std::make_pair(kPrivateDomain, private_kernels())}) {
    OrtCustomOpDomain* domain = nullptr;
    Ort::ThrowOnError(api.CreateCustomOpDomain(name, &domain));
    for (const OrtCustomOp* op : ops) Ort::ThrowOnError(api.CustomOpDomain_Add(domain, op));
    domains.push_back(domain);
  }
  return domains;
}

// A test hook's result: fn()'s, or -1 with the exception's message in `error` (at most error_size bytes).
template <class Fn>
int64_t hook_result(char* error, int64_t error_size, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    if (error_size > 0) std::snprintf(error, static_cast<size_t>(error_size), "%s", e.what());
    return -1;
  }
}

// The packing hooks' copy: at most out_bytes of the first `slots` slots' panels to `out`; their bytes.
int64_t copy_panels(const moe_onnx::PackedWeights& packed, int64_t slots, void* out, int64_t out_bytes) {
  const int64_t bytes = slots * packed.slot_bytes();
  std::memcpy(out, packed.at(0), static_cast<size_t>(std::min(bytes, out_bytes)));
  return bytes;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  // The API table of the headers' version: every onnxruntime from that version up provides it.
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // cannot even report: the runtime is older than the headers
  Ort::InitApi(api);
  try {
    moe_onnx::kernels();  // an invalid MOE_ONNX_GEMM or MOE_ONNX_AMX fails the registration, naming the choices
    for (OrtCustomOpDomain* domain : domains(*api, packed_weights_files(*api, options)))
      Ort::ThrowOnError(api->AddCustomOpDomain(options, domain));
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
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

// The tile layer's test hook (tile_dot.h; tests/test_amx_tiles.py): runs `count` TDPBUSD / TDPBF16PS / TDPBSUD
// dots on `threads` threads, on the model of the tile instructions (hardware = 0) or on the AMX
// instructions (hardware = 1). Returns 0, or 1 with the reason, nothing run, in `error` (a string of at
// most error_size bytes).
__attribute__((visibility("default"))) int MoeOnnxTileDots(int hardware, const moe_onnx::amx::TileDot* dots,
                                                           int64_t count, int threads, char* error,
                                                           int64_t error_size) {
  std::string why;
  try {
    why = moe_onnx::amx::run_tile_dots(hardware != 0, dots, count, threads);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why.empty()) return 0;
  if (error_size > 0) std::snprintf(error, static_cast<size_t>(error_size), "%s", why.c_str());
  return 1;
}

// Packing's test hook (tests/test_packing.py): packs one expert's weights, `source` [N, K] (nn.Linear's
// layout, transposed_columns) or, with plain != 0, [K, N] (plain_columns), of element type `type` (an
// ONNX element type) into panels of `format` (packed_weights.h's WeightFormat, as its int), copying at
// most out_bytes of them to `out`. Returns the panels' bytes, or -1 with the reason in `error`.
__attribute__((visibility("default"))) int64_t MoeOnnxPackExpert(int format, int type, int plain, int64_t N, int64_t K,
                                                                 const void* source, void* out, int64_t out_bytes,
                                                                 char* error, int64_t error_size) {
  return hook_result(error, error_size, [&] {
    const auto weights = static_cast<moe_onnx::WeightFormat>(format);
    const auto source_type = static_cast<ONNXTensorElementDataType>(type);
    const bool floats = source_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    moe_onnx::PackedWeights packed(weights, N, K, 1, false,
                                   floats ? moe_onnx::float_type(source_type) : moe_onnx::FloatType::kF32);
    packed.pack(0, {plain ? moe_onnx::plain_columns(source, 0, K, N) : moe_onnx::transposed_columns(source, 0, N, K)});
    return copy_panels(packed, 1, out, out_bytes);
  });
}

// Packing's test hook for quantized panels (tests/test_packing.py): packs `slots` slots of QMOE panels
// (qgemm.h's QuantPanels: `code` its QuantCode as an int, K, block (K: per-column scales), whether the
// headers have zero points, accuracy level 4) of N columns, slot s from the `per_slot` (1 or 2)
// sources at sources + s * per_slot (packed_weights.h's QuantizedColumns), on `threads` threads
// (slot s on thread s % threads), and copies at most out_bytes of the slots' panels to `out`. Returns
// the panels' bytes, or -1 with the reason in `error`.
__attribute__((visibility("default"))) int64_t MoeOnnxPackQuantized(int code, int64_t K, int64_t block, int zero_points,
                                                                    int int8_activations, int64_t N,
                                                                    const moe_onnx::QuantizedColumns* sources,
                                                                    int64_t per_slot, int64_t slots, int threads,
                                                                    void* out, int64_t out_bytes, char* error,
                                                                    int64_t error_size) {
  return hook_result(error, error_size, [&] {
    if (per_slot != 1 && per_slot != 2) throw std::invalid_argument("per_slot is not 1 or 2");
    moe_onnx::QuantPanels layout;
    layout.code = static_cast<moe_onnx::QuantCode>(code);
    layout.K = K;
    layout.block = block;
    layout.zero_points = zero_points != 0;
    layout.int8_activations = int8_activations != 0;
    moe_onnx::PackedWeights packed(layout, N, slots, false);
    moe_onnx::on_own_threads(threads, [&](int64_t t) {
      for (int64_t s = t; s < slots; s += threads) {
        const moe_onnx::QuantizedColumns* src = sources + s * per_slot;
        if (per_slot == 1) packed.pack_quantized(s, {src[0]});
        else packed.pack_quantized(s, {src[0], src[1]});
      }
    });
    return copy_panels(packed, slots, out, out_bytes);
  });
}

}  // extern "C"
