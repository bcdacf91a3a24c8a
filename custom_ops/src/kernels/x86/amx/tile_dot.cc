#include "tile_dot.h"

#include "isa.h"
#include "parallel.h"

namespace moe_onnx::amx {
namespace {

const char* shape_error(const TileDot& dot) {
  if (dot.instruction != kTdpbusd && dot.instruction != kTdpbf16ps && dot.instruction != kTdpbsud)
    return "instruction must be 0 (TDPBUSD), 1 (TDPBF16PS) or 2 (TDPBSUD)";
  if (dot.rows < 1 || dot.rows > kTileRows) return "rows must be in 1..16";
  for (int32_t colsb : {dot.a_colsb, dot.c_colsb})
    if (colsb < 4 || colsb > kTileRowBytes || colsb % 4 != 0) return "a_colsb and c_colsb must be multiples of 4 in 4..64";
  if (dot.a_stride < dot.a_colsb || dot.b_stride < dot.c_colsb || dot.c_stride < dot.c_colsb)
    return "a row stride is shorter than its row";
  if (!dot.a || !dot.b || !dot.c) return "a buffer is null";
  return nullptr;
}

using TileDotsPart = void (*)(const TileDot*, int64_t, int64_t, int64_t);

// The AMX kernel for the dots, or null with `error` saying why AMX is not usable here.
TileDotsPart hardware_part(const TileDot* dots, int64_t count, std::string& error) {
  const KernelTable& table = kernels();
  if (table.amx != AmxState::kUsable) {
    error = std::string("AMX is not usable here (") + amx_state_name(table.amx) + ": " + table.amx_reason + ")";
    return nullptr;
  }
  for (int64_t i = 0; i < count; ++i)
    if (const bool int8 = dots[i].instruction != kTdpbf16ps; !(int8 ? table.amx_int8 : table.amx_bf16)) {
      error = int8 ? "this CPU has no AMX-INT8" : "this CPU has no AMX-BF16";
      return nullptr;
    }
#if defined(MOE_ONNX_HAVE_AMX)
  return tile_dots_hardware;
#else
  error = "this build has no AMX kernels";  // not reached: the table says kNotInBuild
  return nullptr;
#endif
}

}  // namespace

std::string run_tile_dots(bool hardware, const TileDot* dots, int64_t count, int threads) {
  if (threads < 1 || threads > 64) return "threads must be in 1..64";
  for (int64_t i = 0; i < count; ++i)
    if (const char* error = shape_error(dots[i])) return "dot " + std::to_string(i) + ": " + error;
  std::string error;
  const TileDotsPart part = hardware ? hardware_part(dots, count, error) : tile_dots_model;
  if (part == nullptr) return error;
  on_own_threads(threads, [&](int64_t t) { part(dots, count, t, threads); });
  return "";
}

}  // namespace moe_onnx::amx
