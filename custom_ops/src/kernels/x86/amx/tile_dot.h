// TDPBUSD, TDPBSUD or TDPBF16PS on given buffers, through either build of the tile layer (amx_tiles.h): the
// tile layer's test hook (host/ops_library.cc's MoeOnnxTileDots, tests/test_amx_tiles.py), and the smallest kernel
// written as the AMX kernels are: a template over Tiles (detail::tile_dots) instantiated in
// tile_dot_amx.cc (the instructions) and tile_dot_amx_model.cc (the model); tile_dot.cc checks the
// dots, picks the build and runs the threads.
#pragma once

#include <cstdint>
#include <string>

#include "amx_tiles.h"

namespace moe_onnx::amx {

enum TileInstruction : int32_t { kTdpbusd = 0, kTdpbf16ps = 1, kTdpbsud = 2 };

// C += A x B by one instruction, each operand row-major with its row stride in bytes (a C struct:
// the tests fill it through ctypes):
//   C  rows x c_colsb bytes: int32 (TDPBUSD, TDPBSUD) or fp32 (TDPBF16PS)
//   A  rows x a_colsb bytes: uint8 (TDPBUSD), int8 (TDPBSUD) or bf16
//   B  a_colsb / 4 rows x c_colsb bytes: int8 (TDPBUSD), uint8 (TDPBSUD) or bf16, in the VNNI layout
//      (amx_tiles.h)
struct TileDot {
  int32_t instruction;  // TileInstruction
  int32_t rows;         // 1..16
  int32_t a_colsb;      // 4..64, a multiple of 4
  int32_t c_colsb;      // 4..64, a multiple of 4
  const void* a;
  int64_t a_stride;
  const void* b;
  int64_t b_stride;
  void* c;
  int64_t c_stride;
};

// Runs dots[0..count) on the model (hardware false) or the AMX instructions, on `threads` threads at
// once (thread t the dots t, t + threads, ...), each thread configuring its own tiles for each dot
// (loaded only when the shape changes) and releasing them at its end. Returns "" or, having run
// nothing, what is wrong: a dot's instruction or shape, or (hardware) why AMX is not usable here.
std::string run_tile_dots(bool hardware, const TileDot* dots, int64_t count, int threads);

// The dots first, first + step, ... < count on this thread, its tiles released at the end.
void tile_dots_model(const TileDot* dots, int64_t count, int64_t first, int64_t step);
#if defined(MOE_ONNX_HAVE_AMX)
void tile_dots_hardware(const TileDot* dots, int64_t count, int64_t first, int64_t step);
#endif

namespace detail {

template <class Tiles>
void tile_dots(const TileDot* dots, int64_t count, int64_t first, int64_t step) {
  ReleaseTiles<Tiles> release;
  for (int64_t i = first; i < count; i += step) {
    const TileDot& dot = dots[i];
    Tiles::configure(TileConfig()
                         .shape(0, dot.rows, dot.c_colsb)
                         .shape(1, dot.rows, dot.a_colsb)
                         .shape(2, dot.a_colsb / 4, dot.c_colsb));
    Tiles::load(tmm<0>, dot.c, dot.c_stride);
    Tiles::load(tmm<1>, dot.a, dot.a_stride);
    Tiles::load(tmm<2>, dot.b, dot.b_stride);
    if (dot.instruction == kTdpbusd)
      Tiles::dpbusd(tmm<0>, tmm<1>, tmm<2>);
    else if (dot.instruction == kTdpbsud)
      Tiles::dpbsud(tmm<0>, tmm<1>, tmm<2>);
    else
      Tiles::dpbf16ps(tmm<0>, tmm<1>, tmm<2>);
    Tiles::store(tmm<0>, dot.c, dot.c_stride);
  }
}

}  // namespace detail

}  // namespace moe_onnx::amx
