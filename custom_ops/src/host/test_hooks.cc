// libmoe_onnx_ops's test hooks: C functions the tests call through ctypes to run one layer alone (the
// tile layer: tests/test_amx_tiles.py; packing: tests/test_packing.py; the packed-weights files'
// checksum: tests/test_packed_file.py, benchmarks/startup_memory.py). Not part of the ops' API.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "packed_file.h"
#include "packed_weights.h"
#include "parallel.h"
#include "x86/amx/tile_dot.h"

namespace {

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

// The packed-weights files' checksum (packed_file.h's checksum) of `bytes` bytes at `data`, from `seed`.
__attribute__((visibility("default"))) uint64_t MoeOnnxChecksum(const void* data, int64_t bytes, uint64_t seed) {
  return moe_onnx::checksum(data, static_cast<size_t>(std::max<int64_t>(bytes, 0)), seed);
}

}  // extern "C"
