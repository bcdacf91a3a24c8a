// quant_gemm_int8_rows' accuracy level 4 on AMX's TDPBSUD (qgemm.h has which calls take it): a
// template over the tile layer's policy (amx_tiles.h), instantiated in qgemm_amx.cc (the instructions)
// and qgemm_amx_model.cc (their model). Include it only there.
//
// TDPBSUD multiplies signed A bytes by unsigned B bytes: A is the quantized rows as they are (qa, each
// block's k zero padded to whole tile rows of 64 k: a row tile of one step is 16 rows of 64 bytes, ldq
// apart) and B the codes q: 8-bit codes of blocks of whole tile rows are the B tiles in place (a group
// of 4 k x 16 columns is a tile row; the block's groups one after the other); other codes (4-bit ones,
// per-column blocks of K % 64 != 0) go through the `code_rows` step once per panel and call.
// Per pair of row tiles (the outer loop: one tile configuration each) and pair of panels (the inner
// loop), block after block: the C tiles start from zero, take the block's TDPBSUDs, one per step, and
// go to memory, from where the `add_dots` step adds (sa * scale) * float(sum - zp * sum qa) to C:
// sum qa (q - zp), the VNNI kernel's integers.
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
  static constexpr int64_t kStepBytes = kDepth * kPanel;  // a panel's B tile of one step
  // Blocks whose dots go into C together (add_dots keeps a row's sums in registers over them); one
  // group's products are on the tiles while the group before goes into C (two buffers).
  static constexpr int64_t kGroup = 4;
  static constexpr int64_t kDotInts = 2 * 2 * kRows * kPanel;  // a block's dots: [2 panels][32 rows][16]
  // The B tile (and header) of the step this many steps on, past a pair's last block the next pair's,
  // is fetched into the cache ahead: the first row block reads them from memory.
  static constexpr int64_t kPrefetchSteps = 4;

  const QuantTileSteps& steps;
  const QuantPanels& layout;
  int64_t blocks, block_k;  // block_k: a block's k in the rows (activation_block), whole steps
  int64_t panel_bytes, block_bytes;  // the layout's, computed once: not in the steps' loop (they divide)
  const int8_t* qa;
  int64_t ldq;
  const int32_t* sums;
  const float* sa;
  const uint8_t* B;
  int64_t p0, p1;
  float* C;
  int64_t ldc;
  bool in_place;              // the codes are the B tiles as they are
  int64_t code_block_stride;  // bytes from a block's B rows to the next block's
  const uint8_t* codes[2];    // the pair's B rows (block b's at codes[j] + b * code_block_stride)
  uint8_t* rows;              // code_rows' scratch, panel p's [blocks][block_k / 4][64] at (p - p0) (not in place)
  int32_t* dots;              // [2 buffers][kGroup][kDotInts]

  // Panel p's B rows (code_rows' done).
  const uint8_t* codes_of(int64_t p) const {
    return in_place ? B + p * panel_bytes + layout.header_bytes()
                    : rows + (p - p0) * code_block_stride * blocks;
  }
  void find_codes(int64_t p, int panels) {
    for (int j = 0; j < panels; ++j) codes[j] = codes_of(p + j);
  }

  // Rows m.. (rows in all: one row tile, or two when kTwoRows) x panels p.. (one or two).
  template <bool kTwoRows, bool kTwoPanels>
  void block(int64_t m, int64_t row_count, int64_t p) const {
    using amx::tmm;
    constexpr int64_t kPanelInts = 2 * kRows * kPanel;
    const int64_t per_block = block_k / kDepth;
    // Block b's products into `out` ([2 panels][32 rows][16]).
    auto issue = [&](int64_t b, int32_t* out) {
      Tiles::zero(tmm<0>);
      if (kTwoPanels) Tiles::zero(tmm<1>);
      if (kTwoRows) Tiles::zero(tmm<2>);
      if (kTwoRows && kTwoPanels) Tiles::zero(tmm<3>);
      const int8_t* a0 = qa + m * ldq + b * block_k;
      const int8_t* a1 = a0 + kRows * ldq;
      const uint8_t* b0 = codes[0] + b * code_block_stride;
      const uint8_t* b1 = codes[kTwoPanels ? 1 : 0] + b * code_block_stride;
      for (int64_t s = 0; s < per_block; ++s) {
        // The step kPrefetchSteps on, in this pair of panels or past its end in the next pair's.
        // (here, not in a function of its own: GCC drops a call that only prefetches)
        const int64_t ahead = b * per_block + s + kPrefetchSteps, next = ahead / per_block;
        const int64_t pair = next < blocks ? p : p + 2, next_block = next < blocks ? next : next - blocks;
        if (next_block < blocks)
          for (int64_t q = pair; q < std::min(pair + 2, p1); ++q) {
            const uint8_t* tile = codes_of(q) + next_block * code_block_stride + ahead % per_block * kStepBytes;
            for (int64_t line = 0; line < kStepBytes; line += 64) __builtin_prefetch(tile + line, 0, 3);
            __builtin_prefetch(B + q * panel_bytes + next_block * block_bytes, 0, 3);  // header
          }
        amx::block_step<Tiles, kTwoRows, kTwoPanels>(a0 + s * kDepth, a1 + s * kDepth, ldq, b0 + s * kStepBytes,
                                                     b1 + s * kStepBytes,
                                                     [](auto c, auto x, auto y) { Tiles::dpbsud(c, x, y); });
      }
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
                               B + (p + j) * panel_bytes + b0 * block_bytes,
                               block_bytes,
                               layout.zero_points,
                               layout.default_zero_point()};
        steps.add_dots(d, C + (m + r0) * ldc + (p + j - p0) * kPanel, ldc);
      }
    };
    // The group before goes into C a part of its rows after each block of this group: a tile
    // instruction retires only when done, so the vector work between two must be short to overlap.
    const int64_t part = (row_count + kGroup - 1) / kGroup;
    for (int64_t b0 = 0, n = 0; b0 < blocks; b0 += kGroup, ++n) {
      int32_t* group = dots + (n % 2) * kGroup * kDotInts;
      const int32_t* before = dots + ((n + 1) % 2) * kGroup * kDotInts;
      for (int64_t i = 0; i < kGroup; ++i) {
        if (b0 + i < blocks) issue(b0 + i, group + i * kDotInts);
        if (n > 0 && i * part < row_count)
          finish(b0 - kGroup, kGroup, before, i * part, std::min(row_count, (i + 1) * part));
      }
    }
    const int64_t last = (blocks - 1) / kGroup * kGroup;
    finish(last, blocks - last, dots + (last / kGroup % 2) * kGroup * kDotInts, 0, row_count);
  }
};

// QuantTilesFn's contract (qgemm.h), for blocks of at least 64 k (so activation_block() is whole steps).
template <class Tiles>
void quant_dots_tiles(const QuantTileSteps& steps, const QuantPanels& layout, const int8_t* qa, int64_t ldq,
                      const int32_t* qa_sums, const float* sa, int64_t M, const uint8_t* B, int64_t p0, int64_t p1,
                      float* C, int64_t ldc) {
  using Kernel = QuantTiles<Tiles>;
  constexpr int kRows = Kernel::kRows;
  const int64_t blocks = layout.blocks(), block_k = layout.activation_block();
  const bool in_place = layout.code == QuantCode::kInt8 && layout.block % Kernel::kDepth == 0;
  const int64_t code_block_stride = in_place ? layout.block_bytes() : block_k * kPanel;
  Kernel k{steps, layout, blocks, block_k, layout.panel_bytes(), layout.block_bytes(), qa, ldq, qa_sums, sa, B, p0, p1,
           C, ldc, in_place, code_block_stride, {}, nullptr, nullptr};
  Scratch scratch;
  if (!in_place) {
    k.rows = scratch.take<uint8_t>((p1 - p0) * blocks * code_block_stride, "the level-4 tiles' codes");
    for (int64_t p = p0; p < p1; ++p)
      steps.code_rows(layout, B + p * layout.panel_bytes(), block_k, k.rows + (p - p0) * blocks * code_block_stride);
  }
  k.dots = scratch.take<int32_t>(2 * Kernel::kGroup * Kernel::kDotInts, "the level-4 tiles' dots");
  for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kPanel) * sizeof(float));

  // Row blocks outside, pairs of panels inside: one tile configuration per row block (LDTILECFG is
  // slow; a last, shorter row block has its own); the later row blocks read the panels from the cache.
  amx::ReleaseTiles<Tiles> release;
  for (int64_t m = 0; m < M; m += 2 * kRows) {
    const amx::RowBlock rows = amx::RowBlock::at(m, M);
    Tiles::configure(rows.config(Kernel::kDepth, Kernel::kDepth / 4));
    for (int64_t p = p0; p < p1; p += 2) {
      const bool two_panels = p + 1 < p1;
      k.find_codes(p, two_panels ? 2 : 1);
      rows.run(k, two_panels, m, int64_t{rows.rows0 + rows.rows1}, p);
    }
  }
}

}  // namespace moe_onnx::detail
