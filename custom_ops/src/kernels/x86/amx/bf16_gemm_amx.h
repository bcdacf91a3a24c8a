// bf16_gemm_panels on AMX's TDPBF16PS (bf16_gemm.h's layout as it is): a template over the tile
// layer's policy (amx_tiles.h), instantiated in bf16_gemm_amx.cc (the instructions) and
// bf16_gemm_amx_model.cc (their model). Include it only there.
//
// A step is 32 k: an A tile is 16 rows x 32 bf16 of the rows in place (row stride lda), a B tile the
// step's 16 pair rows of a panel (1 KB, contiguous), a C tile 16 rows x 16 fp32 columns. Tiles: C
// tmm0-3 (two row tiles x two panels), A tmm4-5, B tmm6-7. Per pair of row tiles, every pair of panels
// runs all of K in one go, C in the tiles from the first step to the last, so each panel is one
// sequential stream. The weights come from memory at every row count the MOE sees (a panel's bytes
// serve 2 FLOPs per row), so the stream is what bounds the kernel: each step prefetches the B tiles
// kFarSteps on into L2 (prefetcht2: L2's queue holds far more misses in flight than L1's fill
// buffers, which prefetcht0 from memory would fill) and those kNearSteps on into L1. Measured on a
// 2-core Xeon with AMX against passes of 256 k with prefetcht0 4 steps on (each pass reloading and
// storing C; the MOE's shapes, 8-96 rows per task, 8 panels, K = 768-2880): 0.75-0.9x the CPU time.
// One configuration per pair of row tiles (16 rows each, the last tile the rows left; loaded only
// when it changes), so no read goes past row M. K needs no tail: the layout pads it to whole steps
// with zeros.
#pragma once

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "bf16_gemm.h"

namespace moe_onnx::detail {

template <class Tiles>
struct Bf16PairTiles {
  static constexpr int64_t kStepBytes = amx::kTileRows * amx::kTileRowBytes;  // a B tile: 16 pair rows
  static constexpr int64_t kNearSteps = 2;
  static constexpr int64_t kFarSteps = 16;

  const uint16_t* A;
  int64_t lda;
  const char* B;  // panel p at B + p * panel_bytes
  int64_t panel_bytes, steps;
  int64_t p0;
  float* C;
  int64_t ldc;

  // Rows m.. (one row tile, or two: rows m + 16..) x panels p.. (one or two), all of K.
  template <bool kTwoRows, bool kTwoPanels>
  void block(int64_t m, int64_t p) const {
    using amx::tmm;
    Tiles::zero(tmm<0>);
    if (kTwoPanels) Tiles::zero(tmm<1>);
    if (kTwoRows) Tiles::zero(tmm<2>);
    if (kTwoRows && kTwoPanels) Tiles::zero(tmm<3>);
    const uint16_t* a = A + m * lda;
    const int64_t a_stride = lda * 2;
    const char* b0 = B + p * panel_bytes;
    const char* b1 = b0 + panel_bytes;
    const auto dot = [](auto c, auto x, auto y) { Tiles::dpbf16ps(c, x, y); };
    for (int64_t s = 0; s < steps; ++s) {
      // (past the panel's last step: the next panel's, or past the weights: prefetches do not fault)
      for (int64_t line = 0; line < kStepBytes; line += 64) {
        __builtin_prefetch(b0 + (s + kFarSteps) * kStepBytes + line, 0, 1);
        __builtin_prefetch(b0 + (s + kNearSteps) * kStepBytes + line, 0, 3);
        if (kTwoPanels) {
          __builtin_prefetch(b1 + (s + kFarSteps) * kStepBytes + line, 0, 1);
          __builtin_prefetch(b1 + (s + kNearSteps) * kStepBytes + line, 0, 3);
        }
      }
      amx::block_step<Tiles, kTwoRows, kTwoPanels>(a + s * kBf16StepK, a + amx::kTileRows * lda + s * kBf16StepK,
                                                   a_stride, b0 + s * kStepBytes, b1 + s * kStepBytes, dot);
    }
    amx::store_block<Tiles, kTwoRows, kTwoPanels>(C + m * ldc + (p - p0) * kPanel, amx::kTileRows * ldc, kPanel,
                                                  ldc * 4);
  }
};

// bf16_gemm_panels' contract (bf16_gemm.h; K padded, a multiple of kBf16StepK).
template <class Tiles>
void bf16_gemm_tiles(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                     int64_t p1, float* C, int64_t ldc) {
  Bf16PairTiles<Tiles> kernel{A, lda, static_cast<const char*>(B_packed), K * kPanel * 2, K / kBf16StepK, p0, C, ldc};
  amx::run_row_blocks<Tiles>(kernel, M, p0, p1);
}

}  // namespace moe_onnx::detail
