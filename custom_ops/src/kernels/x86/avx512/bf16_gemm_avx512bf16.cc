// bf16_gemm_panels on AVX512-BF16 (the table's bf16_gemm slot where the CPU has it); this file alone
// is compiled with the AVX-512 flags and -mavx512bf16, and is called only after the table's check.
//
// A pair row of a panel (16 columns x 2 k) is one zmm and vdpbf16ps multiplies it by a row's pair
// broadcast to every lane (32 products per instruction): a tile is rows x panels accumulators, as in
// the fp32 kernel (gemm_avx512.cc).
// Each result element is one chain over the pairs in increasing k (the odd k's product, then the
// even k's), whatever the tile it falls in; partial sums cross the K blocks through C (exact).
#include <immintrin.h>

#include <cstring>

#include "bf16_gemm.h"
#include "panel_gemm.h"
#include "x86/avx512/simd_avx512.h"

namespace moe_onnx {
namespace detail {
namespace {

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
template <int MR, int NP, bool kPrefetch>
inline void pair_tile(const uint16_t* A, int64_t lda, int64_t pairs, const uint16_t* B, int64_t bstride, float* C,
                      int64_t ldc, bool accumulate) {
  __m512 acc[MR][NP];
  load_accumulators<Avx512>(acc, C, ldc, accumulate);
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
  store_accumulators<Avx512>(acc, C, ldc);
}

// The driver's kernel (panel_gemm.h): K blocks of at most 128 pairs (the block of the two panels a tile
// reads, 16 KB, stays in L1), row tiles of up to 12 rows x two panels (24 accumulators); one or two rows
// stream four panels at once, whole K (each weight read once), each panel's rows prefetched ahead.
struct Avx512Bf16Gemm : PairPanelSteps {
  static constexpr int64_t kBlockSteps = 128, kBlockMultiple = 1;
  static constexpr int kMaxRows = 12, kPanels = 2, kOneRowPanels = 4, kTwoRowPanels = 4;
  static constexpr bool kPrefetch = false;

  template <int MR, int NP>
  static void micro(const uint16_t* A, int64_t lda, int64_t pairs, const void* B, int64_t bstride, float* C,
                    int64_t ldc, bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
    pair_tile<MR, NP, NP == kOneRowPanels>(A, lda, pairs, static_cast<const uint16_t*>(B), bstride, C, ldc, accumulate);
  }
};

}  // namespace

void bf16_gemm_avx512bf16(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                          int64_t p1, float* C, int64_t ldc) {
  panel_gemm<Avx512Bf16Gemm>(A, lda, M, K / 2, B_packed, p0, p1, C, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
