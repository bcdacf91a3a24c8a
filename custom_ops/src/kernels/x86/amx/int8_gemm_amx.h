// int8_gemm_panels on AMX's TDPBUSD, over the quad layout as it is (int8_gemm.h): a template over the
// tile layer's policy (amx_tiles.h), instantiated in int8_gemm_amx.cc (the instructions) and
// int8_gemm_amx_model.cc (their model). Include it only there.
//
// TDPBUSD adds, for each C[m][n], the products of 64 unsigned bytes of A's row m with the signed bytes
// B[k][4n + i], int32, wrapping. A's rows are the prepared X rows (u = x + 128) and each B tile is 16
// quad rows of a panel read in place (64 bytes apart), so a C tile is 16 rows x 16 columns over 64 k;
// it starts from the panel's corrections (-128 * column sum, the same for every row: loaded with row
// stride 0) and ends at sum x * w modulo 2^32, numpy's int32, as the VNNI kernel gets it.
//
// Tiles: C tmm0-3 (two row tiles x two panels), A tmm4-5, B tmm6-7; a configuration per pair of row
// tiles (16 rows each, the last tile the rows left). K tail: when K's quads are not a multiple of 16,
// the last step reads A's last quads and B's last quad rows from scratch tiles padded with zero B
// rows (A's bytes there multiply zeros), built once per call; measured against a second configuration
// for that step (it would zero the C tiles, so they would go through memory), it is the faster one.
#pragma once

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "int8_gemm.h"
#include "workspace.h"

namespace moe_onnx::detail {

template <class Tiles>
struct Int8QuadTiles {
  static constexpr int64_t kStepQuads = amx::kTileRows;  // quad rows of a B tile: 64 k
  static constexpr int64_t kStepBytes = kStepQuads * 4 * kInt8Panel;
  static constexpr int64_t kPrefetchSteps = 4;

  const uint8_t* A;
  int64_t lda;
  const char* W;  // panel p at W + p * panel_bytes
  int64_t panel_bytes, steps;
  const uint8_t* a_tail;  // the last step's A, 64 bytes per row (null: no tail)
  const int8_t* b_tail;   // the last step's B of panel p0 + j at b_tail + j * kStepBytes
  int64_t p0;
  int32_t* C;
  int64_t ldc;

  // Rows m.. (one row tile, or two: rows m + 16..) x panels p.. (one or two).
  template <bool kTwoRows, bool kTwoPanels>
  void block(int64_t m, int64_t p) const {
    using amx::tmm;
    const char* w0 = W + p * panel_bytes;
    const char* w1 = w0 + panel_bytes;
    Tiles::load(tmm<0>, w0, 0);  // the corrections, in every row
    if (kTwoPanels) Tiles::load(tmm<1>, w1, 0);
    if (kTwoRows) Tiles::load(tmm<2>, w0, 0);
    if (kTwoRows && kTwoPanels) Tiles::load(tmm<3>, w1, 0);
    const uint8_t* a = A + m * lda;
    w0 += kInt8QuadHeader;
    w1 += kInt8QuadHeader;
    auto step = [&](const uint8_t* a0, int64_t a_stride, const void* b0, const void* b1) {
      amx::block_step<Tiles, kTwoRows, kTwoPanels>(a0, a0 + amx::kTileRows * a_stride, a_stride, b0, b1,
                                                   [](auto c, auto x, auto y) { Tiles::dpbusd(c, x, y); });
    };
    for (int64_t s = 0; s < steps; ++s) {
      const char* next0 = w0 + (s + kPrefetchSteps) * kStepBytes;
      for (int i = 0; i < 16; ++i) __builtin_prefetch(next0 + 64 * i, 0, 3);
      if (kTwoPanels) for (int i = 0; i < 16; ++i) __builtin_prefetch(next0 + panel_bytes + 64 * i, 0, 3);
      step(a + s * 64, lda, w0 + s * kStepBytes, w1 + s * kStepBytes);
    }
    if (a_tail) {
      const int8_t* b = b_tail + (p - p0) * kStepBytes;
      step(a_tail + m * 64, 64, b, b + kStepBytes);
    }
    amx::store_block<Tiles, kTwoRows, kTwoPanels>(C + m * ldc + (p - p0) * kInt8Panel, amx::kTileRows * ldc,
                                                  kInt8Panel, ldc * 4);
  }
};

// int8_gemm_panels' contract (int8_gemm.h), A prepared as quads (bias_int8_rows_*), W quad panels.
template <class Tiles>
void int8_gemm_quads_tiles(const void* A_rows, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                           int64_t p1, int32_t* C, int64_t ldc) {
  using Kernel = Int8QuadTiles<Tiles>;
  const int64_t quads = int8_quads(K), tail = quads % Kernel::kStepQuads;
  Kernel k{static_cast<const uint8_t*>(A_rows), lda, static_cast<const char*>(W_packed), int8_quad_panel_bytes(K),
           quads / Kernel::kStepQuads, nullptr, nullptr, p0, C, ldc};
  Scratch scratch;
  if (tail) {
    const int64_t done = quads - tail;
    uint8_t* a_tail = scratch.take<uint8_t>(M * 64, "the int8 GEMM's last A tile");
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(a_tail + m * 64, k.A + m * lda + done * 4, static_cast<size_t>(tail * 4));
      std::memset(a_tail + m * 64 + tail * 4, 0, static_cast<size_t>(64 - tail * 4));
    }
    int8_t* b_tail = scratch.take<int8_t>((p1 - p0) * Kernel::kStepBytes, "the int8 GEMM's last B tiles");
    for (int64_t p = p0; p < p1; ++p) {
      int8_t* b = b_tail + (p - p0) * Kernel::kStepBytes;
      std::memcpy(b, k.W + p * k.panel_bytes + kInt8QuadHeader + done * 64, static_cast<size_t>(tail * 64));
      std::memset(b + tail * 64, 0, static_cast<size_t>(Kernel::kStepBytes - tail * 64));
    }
    k.a_tail = a_tail;
    k.b_tail = b_tail;
  }
  amx::run_row_blocks<Tiles>(k, M, p0, p1);
}

}  // namespace moe_onnx::detail
