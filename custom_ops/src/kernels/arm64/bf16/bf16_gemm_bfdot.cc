// bf16_gemm_panels on BFDOT (FEAT_BF16: the table's bf16_gemm slot at the bf16 level, the calls of fewer
// than kBf16TileRows rows); this folder's files alone are compiled with +bf16 and called only after the
// ISA table's check of the CPU.
//
// A pair row of a panel (16 columns x 2 k) is four q registers; BFDOT by element multiplies one (4
// columns' pairs) by a row's pair and adds the pair's dot product into each column's lane. As the Arm
// ARM defines BFDOT (FPCR.EBF = 0, Linux's setting): the two products and their sum are rounded to odd,
// then the sum is added to the accumulator, rounded to odd; denormal inputs and results are zeros;
// NaN results are the default NaN. Per element one chain of such steps over the pairs in increasing k,
// whatever the tile (bf16_gemm.h). Tiles of up to 5 rows x 16 columns; 1 row x 4 panels and 2 rows x 2
// panels for decode.
#include <arm_neon.h>

#include "bf16_gemm.h"
#include "row_dispatch.h"

namespace moe_onnx {
namespace detail {
namespace {

constexpr int64_t kKBlockPairs = 128;     // a panel's block of pairs: 8 KB, in L1 while the row tiles pass
constexpr int64_t kMaxRows = 5;           // 20 accumulators
constexpr int64_t kPairRow = 2 * kPanel;  // bf16 elements of a pair row

inline bfloat16x8_t load8(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }

template <int MR, int NP>
struct Tile {
  float32x4_t acc[MR][NP][4];

  // Pair j of the NP panels (panel jj at B + jj * bstride elements) times pair L of a[r].
  template <int L>
  inline void step(const bfloat16x8_t (&a)[MR], const uint16_t* B, int64_t bstride, int64_t j) {
#pragma GCC unroll 4
    for (int jj = 0; jj < NP; ++jj) {
      const uint16_t* row = B + jj * bstride + j * kPairRow;
      bfloat16x8_t b[4];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) b[q] = load8(row + 8 * q);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[r][jj][q] = vbfdotq_laneq_f32(acc[r][jj][q], b[q], a[r], L);
    }
  }
};

// C[r, 16 jj + c] (+)= pairs [0, pairs) of rows r < MR times panel jj < NP (at B + jj * bstride elements);
// `pairs` is a multiple of 4 (K is padded to 32).
template <int MR, int NP>
inline void micro(const uint16_t* A, int64_t lda, int64_t pairs, const uint16_t* B, int64_t bstride, float* C,
                  int64_t ldc, bool accumulate) {
  Tile<MR, NP> t;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int jj = 0; jj < NP; ++jj)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
        t.acc[r][jj][q] = accumulate ? vld1q_f32(C + r * ldc + jj * kPanel + 4 * q) : vdupq_n_f32(0.0f);
  for (int64_t j = 0; j < pairs; j += 4) {
    bfloat16x8_t a[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) a[r] = load8(A + r * lda + 2 * j);
    t.template step<0>(a, B, bstride, j);
    t.template step<1>(a, B, bstride, j + 1);
    t.template step<2>(a, B, bstride, j + 2);
    t.template step<3>(a, B, bstride, j + 3);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int jj = 0; jj < NP; ++jj)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) vst1q_f32(C + r * ldc + jj * kPanel + 4 * q, t.acc[r][jj][q]);
}

// Rows [0, M) x one panel: K in blocks, rows in tiles of equal height.
void panel(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* B, float* C, int64_t ldc) {
  const int64_t pairs = K / 2;
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows, base = M / tiles, extra = M % tiles;
  const int64_t blocks = (pairs + kKBlockPairs - 1) / kKBlockPairs, block = (pairs + blocks - 1) / blocks / 4 * 4;
  for (int64_t j0 = 0; j0 < pairs; j0 += block) {
    const int64_t jb = pairs - j0 < block ? pairs - j0 : block;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      const uint16_t* At = A + m * lda + 2 * j0;
      float* Ct = C + m * ldc;
      with_rows<kMaxRows>(rows, [&](auto r) {
        micro<decltype(r)::value, 1>(At, lda, jb, B + j0 * kPairRow, 0, Ct, ldc, j0 > 0);
      });
      m += rows;
    }
  }
}

}  // namespace

void bf16_gemm_bfdot(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                     int64_t p1, float* C, int64_t ldc) {
  const auto* B = static_cast<const uint16_t*>(B_packed);
  const int64_t stride = K * kPanel;  // elements per pair panel
  int64_t p = p0;
  if (M == 1) {
    for (; p + 4 <= p1; p += 4) micro<1, 4>(A, lda, K / 2, B + p * stride, stride, C + (p - p0) * kPanel, ldc, false);
  } else if (M == 2) {
    for (; p + 2 <= p1; p += 2) micro<2, 2>(A, lda, K / 2, B + p * stride, stride, C + (p - p0) * kPanel, ldc, false);
  }
  for (; p < p1; ++p) panel(A, lda, M, K, B + p * stride, C + (p - p0) * kPanel, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
