// How a GEMM driver splits its work around a micro-kernel: K (in the kernel's steps) in equal blocks, C's
// rows in tiles of equal height, and a tile's row count as a template argument. The panel drivers
// (panel_gemm.h), the aarch64 octet driver (arm64/int8_octets.h) and qgemm.h's loops use them.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace moe_onnx::detail {

template <class F, int... kRows>
inline void with_rows_of(int64_t rows, F& f, std::integer_sequence<int, kRows...>) {
  (void)((rows == kRows + 1 ? (f(std::integral_constant<int, kRows + 1>{}), true) : false) || ...);
}

// f(std::integral_constant<int, rows>{}) for a run-time `rows` in [1, kMax], nothing for another count: the
// micro-kernel instantiated once per height.
template <int kMax, class F>
inline void with_rows(int64_t rows, F&& f) {
  with_rows_of(rows, f, std::make_integer_sequence<int, kMax>{});
}

// Rows [0, M) (M > 0) in tiles of equal height, at most kMax each (16 rows of at most 6: 6 + 5 + 5, not
// 6 + 6 + 4; 7 rows: 4 + 3, not 6 + 1: a short tile has too few accumulator chains to hide the latency):
// f(rows, m, t, tiles) per tile, rows a std::integral_constant (with_rows), m the tile's first row, t its
// index of `tiles`.
template <int kMax, class F>
inline void row_tiles(int64_t M, F&& f) {
  const int64_t tiles = (M + kMax - 1) / kMax, base = M / tiles, extra = M % tiles;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < extra ? 1 : 0);
    with_rows<kMax>(rows, [&](auto r) { f(r, m, t, tiles); });
    m += rows;
  }
}

// Steps [0, n) in equal blocks of at most `most` steps, each but the last a multiple of `multiple` (a
// micro-kernel's unroll): f(first, count) per block, in increasing order. A block of the weights stays in
// L1 while every row tile passes over it; the partial sums go through C between blocks (a float or an
// int32 stored and loaded back is exact: each sum keeps its order and its bits).
template <class F>
inline void equal_blocks(int64_t n, int64_t most, int64_t multiple, F&& f) {
  if (n <= 0) return;
  const int64_t blocks = (n + most - 1) / most, block = (n + blocks - 1) / blocks / multiple * multiple;
  for (int64_t first = 0; first < n; first += block) f(first, n - first < block ? n - first : block);
}

}  // namespace moe_onnx::detail
