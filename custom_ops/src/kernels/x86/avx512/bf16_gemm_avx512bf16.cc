// bf16_gemm_panels on AVX512-BF16 (the table's bf16_gemm slot where the CPU has it); this file alone
// is compiled with the AVX-512 flags and -mavx512bf16, and is called only after the table's check.
//
// A pair row of a panel (16 columns x 2 k) is one zmm and vdpbf16ps multiplies it by a row's pair
// broadcast to every lane (32 products per instruction): a tile is rows x panels accumulators, as in
// the fp32 kernel (gemm_avx512.cc): up to 12 rows x 2 panels, 1 or 2 rows x 4 panels for decode.
// Each result element is one chain over the pairs in increasing k (the odd k's product, then the
// even k's), whatever the tile it falls in; partial sums cross the K blocks through C (exact).
#include <immintrin.h>

#include <cstring>

#include "bf16_gemm.h"
#include "row_dispatch.h"

namespace moe_onnx {
namespace detail {
namespace {

// K is split into equal blocks of at most kKBlockPairs pairs so the block of the two panels a tile
// reads (16 KB) stays in L1 while every row tile of the call passes over it.
constexpr int64_t kKBlockPairs = 128;
constexpr int64_t kMaxRows = 12;          // 12 rows x 2 panels = 24 accumulators
constexpr int64_t kPairRow = 2 * kPanel;  // bf16 elements of a pair row
// Decode streams each panel once: its pair rows are prefetched this many pair rows (1 KB) ahead.
constexpr int64_t kPrefetchPairs = 16;

inline __m512bh pair_of(const uint16_t* row, int64_t j) {
  uint32_t pair;
  std::memcpy(&pair, row + 2 * j, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// C[r, 16 jj + c] (+)= the pairs [0, pairs) of A's rows r < MR times panel jj < NP (at B + jj *
// bstride elements).
template <int MR, int NP, bool kPrefetch = false>
inline void micro(const uint16_t* A, int64_t lda, int64_t pairs, const uint16_t* B, int64_t bstride, float* C,
                  int64_t ldc, bool accumulate) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int jj = 0; jj < NP; ++jj)
      acc[r][jj] = accumulate ? _mm512_loadu_ps(C + r * ldc + jj * kPanel) : _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh b[NP];
#pragma GCC unroll 16
    for (int jj = 0; jj < NP; ++jj) b[jj] = (__m512bh)_mm512_loadu_si512(B + jj * bstride + j * kPairRow);
    if (kPrefetch) {
#pragma GCC unroll 16
      for (int jj = 0; jj < NP; ++jj)
        _mm_prefetch(reinterpret_cast<const char*>(B + jj * bstride + (j + kPrefetchPairs) * kPairRow), _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = pair_of(A + r * lda, j);
#pragma GCC unroll 16
      for (int jj = 0; jj < NP; ++jj) acc[r][jj] = _mm512_dpbf16_ps(acc[r][jj], a, b[jj]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int jj = 0; jj < NP; ++jj) _mm512_storeu_ps(C + r * ldc + jj * kPanel, acc[r][jj]);
}

// Rows [0, M) x NP panels from panel B on: K in blocks, rows in tiles of equal height.
template <int NP>
void panels(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* B, float* C, int64_t ldc) {
  const int64_t stride = K * kPanel;  // elements per panel
  const int64_t pairs = K / 2;
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t blocks = (pairs + kKBlockPairs - 1) / kKBlockPairs, block = (pairs + blocks - 1) / blocks;
  const int64_t base = M / tiles, extra = M % tiles;
  for (int64_t j0 = 0; j0 < pairs; j0 += block) {
    const int64_t jb = pairs - j0 < block ? pairs - j0 : block;
    const uint16_t* Bk = B + j0 * kPairRow;
    const bool acc = j0 > 0;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      const uint16_t* At = A + m * lda + 2 * j0;
      float* Ct = C + m * ldc;
      with_rows<kMaxRows>(rows, [&](auto r) {
        micro<decltype(r)::value, NP>(At, lda, jb, Bk, stride, Ct, ldc, acc);
      });
      m += rows;
    }
  }
}

}  // namespace

void bf16_gemm_avx512bf16(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                          int64_t p1, float* C, int64_t ldc) {
  const auto* B = static_cast<const uint16_t*>(B_packed);
  const int64_t stride = K * kPanel;
  int64_t p = p0;
  // Decode: one or two rows stream four panels at once, whole K (each weight read once).
  if (M == 1) {
    for (; p + 4 <= p1; p += 4) micro<1, 4, true>(A, lda, K / 2, B + p * stride, stride, C + (p - p0) * kPanel, ldc, false);
  } else if (M == 2) {
    for (; p + 4 <= p1; p += 4) micro<2, 4, true>(A, lda, K / 2, B + p * stride, stride, C + (p - p0) * kPanel, ldc, false);
  }
  for (; p + 2 <= p1; p += 2) panels<2>(A, lda, M, K, B + p * stride, C + (p - p0) * kPanel, ldc);
  if (p < p1) panels<1>(A, lda, M, K, B + p * stride, C + (p - p0) * kPanel, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
