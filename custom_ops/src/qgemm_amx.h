// quant_gemm_panels' accuracy level 4 on AMX's TDPBUSD (qgemm.h has the identity and which calls take
// it): a template over the tile layer's policy (amx_tiles.h), instantiated in qgemm_amx.cc (the
// instructions) and qgemm_amx_model.cc (their model). Include it only there.
//
// Per call: A = qa + 128 (u8) into a scratch, each block's k padded to whole steps of 64 k (a tile
// row); per pair of panels, every block's codes as B rows (the `signed_codes` step: q - o, zero past
// the block, so A's bytes there add nothing) with the block's terms. Then per pair of row tiles and
// pair of panels, block after block: the C tiles start from the block's -128 * sum (q - o) (one row
// loaded with stride 0), take the block's TDPBUSDs, one per step, and go to memory, from where the
// `add_dots` step adds (sa * scale) * float(dot) to C.
//
// Tiles: C tmm0-3 (two row tiles x two panels), A tmm4-5, B tmm6-7; a configuration per pair of row
// tiles (16 rows each, the last tile the rows left).
#pragma once

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "qgemm.h"
#include "workspace.h"

namespace moe_onnx::detail {

template <class Tiles>
struct QuantTiles {
  static constexpr int kRows = amx::kTileRows;
  static constexpr int64_t kDepth = amx::kTileRowBytes;  // k per step
  static constexpr int64_t kTileBytes = kRows * kDepth;
  static constexpr int64_t kTermInts = 2 * kPanel;  // a block's terms (signed_codes)
  // Blocks whose dots go into C together (add_dots keeps a row's sums in registers over them); one
  // group's products are on the tiles while the group before goes into C (two buffers).
  static constexpr int64_t kGroup = 4;
  static constexpr int64_t kDotInts = 2 * 2 * kRows * kPanel;  // a block's dots: [2 panels][32 rows][16]

  const QuantTileSteps& steps;
  const QuantPanels& layout;
  int64_t blocks, block_k;  // block_k: a block's k in the scratches, whole steps
  const uint8_t* A;         // [row tiles][step_count][16 rows][64]: a row tile's k of one step together
  int64_t step_count;       // blocks * block_k / 64
  const int32_t* sums;
  const float* sa;
  const uint8_t* B;
  int64_t p0;
  float* C;
  int64_t ldc;
  int8_t* codes[2];   // the pair's B rows, [blocks][block_k / 4][64]
  int32_t* terms[2];  // their terms, [blocks][32]
  int32_t* dots;      // [2 buffers][kGroup][kDotInts]

  // Panel p's (and p + 1's) blocks as B rows and terms.
  void sign_codes(int64_t p, int panels) {
    for (int j = 0; j < panels; ++j)
      steps.signed_codes(layout, B + (p + j) * layout.panel_bytes(), block_k, codes[j], terms[j]);
  }

  // Rows m.. (rows in all: one row tile, or two when kTwoRows) x panels p.. (one or two).
  template <bool kTwoRows, bool kTwoPanels>
  void block(int64_t m, int64_t rows, int64_t p) const {
    using amx::tmm;
    constexpr int64_t kPanelInts = 2 * kRows * kPanel;
    const int64_t per_block = block_k / kDepth;
    // Block b's products into `out` ([2 panels][32 rows][16]).
    auto issue = [&](int64_t b, int32_t* out) {
      Tiles::load(tmm<0>, terms[0] + b * kTermInts, 0);  // -128 * sum (q - o), in every row
      if (kTwoPanels) Tiles::load(tmm<1>, terms[1] + b * kTermInts, 0);
      if (kTwoRows) Tiles::load(tmm<2>, terms[0] + b * kTermInts, 0);
      if (kTwoRows && kTwoPanels) Tiles::load(tmm<3>, terms[1] + b * kTermInts, 0);
      const uint8_t* a0 = A + (m / kRows * step_count + b * per_block) * kTileBytes;
      const uint8_t* a1 = a0 + step_count * kTileBytes;
      const int8_t* b0 = codes[0] + b * block_k * kPanel;
      const int8_t* b1 = codes[1] + b * block_k * kPanel;
      for (int64_t s = 0; s < per_block; ++s)
        amx::block_step<Tiles, kTwoRows, kTwoPanels>(a0 + s * kTileBytes, a1 + s * kTileBytes, kDepth,
                                                     b0 + s * kDepth * kPanel, b1 + s * kDepth * kPanel,
                                                     [](auto c, auto x, auto y) { Tiles::dpbusd(c, x, y); });
      amx::store_block<Tiles, kTwoRows, kTwoPanels>(out, kRows * kPanel, kPanelInts, 64);
    };
    // Rows r0..r1 (of rows m..) of blocks b0.. (count) from `group` into C.
    auto finish = [&](int64_t b0, int64_t count, const int32_t* group, int64_t r0, int64_t r1) {
      for (int j = 0; j < (kTwoPanels ? 2 : 1); ++j) {
        const QuantBlockDots d{r1 - r0,
                               count,
                               group + j * kPanelInts + r0 * kPanel,
                               kDotInts,
                               sums + (m + r0) * blocks + b0,
                               sa + (m + r0) * blocks + b0,
                               blocks,
                               B + (p + j) * layout.panel_bytes() + b0 * layout.block_bytes(),
                               layout.block_bytes(),
                               layout.zero_points ? terms[j] + b0 * kTermInts + kPanel : nullptr};
        steps.add_dots(d, C + (m + r0) * ldc + (p + j - p0) * kPanel, ldc);
      }
    };
    // The group before goes into C a part of its rows after each block of this group: a tile
    // instruction retires only when done, so the vector work between two must be short to overlap.
    const int64_t part = (rows + kGroup - 1) / kGroup;
    for (int64_t b0 = 0, n = 0; b0 < blocks; b0 += kGroup, ++n) {
      int32_t* group = dots + (n % 2) * kGroup * kDotInts;
      const int32_t* before = dots + ((n + 1) % 2) * kGroup * kDotInts;
      for (int64_t i = 0; i < kGroup; ++i) {
        if (b0 + i < blocks) issue(b0 + i, group + i * kDotInts);
        if (n > 0 && i * part < rows) finish(b0 - kGroup, kGroup, before, i * part, std::min(rows, (i + 1) * part));
      }
    }
    const int64_t last = (blocks - 1) / kGroup * kGroup;
    finish(last, blocks - last, dots + (last / kGroup % 2) * kGroup * kDotInts, 0, rows);
  }
};

// QuantTilesFn's contract (qgemm.h), for blocks of at least 64 k.
template <class Tiles>
void quant_dots_tiles(const QuantTileSteps& steps, const QuantPanels& layout, const int8_t* qa, int64_t ldq,
                      const int32_t* qa_sums, const float* sa, int64_t M, const uint8_t* B, int64_t p0, int64_t p1,
                      float* C, int64_t ldc) {
  using Kernel = QuantTiles<Tiles>;
  constexpr int kRows = Kernel::kRows;
  constexpr int64_t kDepth = Kernel::kDepth;
  const int64_t blocks = layout.blocks(), padded = layout.groups_per_block() * layout.group_rows();
  const int64_t block_k = (padded + kDepth - 1) / kDepth * kDepth;
  const int64_t step_count = blocks * block_k / kDepth, tiles = (M + kRows - 1) / kRows;
  Scratch scratch;
  uint8_t* A = scratch.take<uint8_t>(tiles * step_count * Kernel::kTileBytes, "the level-4 tiles' activations");
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* a = A + (m / kRows * step_count * kRows + m % kRows) * kDepth;  // step s at a + s * kTileBytes
    const int8_t* q = qa + m * ldq;
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k = 0; k < block_k; k += kDepth) {
        const int64_t s = (b * block_k + k) / kDepth, n = std::clamp<int64_t>(padded - k, 0, kDepth);
        uint8_t* step = a + s * Kernel::kTileBytes;
        for (int64_t i = 0; i < n; ++i) step[i] = static_cast<uint8_t>(q[b * padded + k + i] ^ 0x80);
        std::memset(step + n, 0x80, static_cast<size_t>(kDepth - n));  // qa = 0 (B's rows there are zero)
      }
  }
  Kernel k{steps, layout, blocks, block_k, A, step_count, qa_sums, sa, B, p0, C, ldc, {}, {}, nullptr};
  for (int j = 0; j < 2; ++j) {
    k.codes[j] = scratch.take<int8_t>(blocks * block_k * kPanel, "the level-4 tiles' codes");
    k.terms[j] = scratch.take<int32_t>(blocks * Kernel::kTermInts, "the level-4 tiles' code terms");
  }
  k.dots = scratch.take<int32_t>(2 * Kernel::kGroup * Kernel::kDotInts, "the level-4 tiles' dots");
  for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kPanel) * sizeof(float));

  amx::ReleaseTiles<Tiles> release;
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two_panels = p + 1 < p1;
    k.sign_codes(p, two_panels ? 2 : 1);
    for (int64_t m = 0; m < M; m += 2 * kRows) {
      const amx::RowBlock rows = amx::RowBlock::at(m, M);
      Tiles::configure(rows.config(kDepth, kDepth / 4));
      rows.run(k, two_panels, m, int64_t{rows.rows0 + rows.rows1}, p);
    }
  }
}

}  // namespace moe_onnx::detail
