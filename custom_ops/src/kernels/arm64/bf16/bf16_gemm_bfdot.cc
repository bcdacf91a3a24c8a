// bf16_gemm_panels on BFDOT (FEAT_BF16: the table's bf16_gemm slot at the bf16 level, the calls of fewer
// than kBf16TileRows rows); this folder's files alone are compiled with +bf16 and called only after the
// ISA table's check of the CPU.
//
// A pair row of a panel (16 columns x 2 k) is four q registers; BFDOT by element multiplies one (4
// columns' pairs) by a row's pair and adds the pair's dot product into each column's lane. As the Arm
// ARM defines BFDOT (FPCR.EBF = 0, Linux's setting): the two products and their sum are rounded to odd,
// then the sum is added to the accumulator, rounded to odd; denormal inputs and results are zeros;
// NaN results are the default NaN. Per element one chain of such steps over the pairs in increasing k,
// whatever the tile (bf16_gemm.h).
#include <arm_neon.h>

#include "arm64/lane_tile.h"
#include "bf16_gemm.h"
#include "panel_gemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// The driver's kernel (panel_gemm.h) and its lanes (arm64/lane_tile.h): BFDOT by element on pair rows. K
// blocks of at most 128 pairs (a panel's block, 8 KB, stays in L1), a multiple of 4 (A's q register);
// row tiles of up to 5 rows x one panel (20 accumulators); one row streams four panels, two rows two.
struct BfdotGemm : PairPanelSteps {
  using ARegister = bfloat16x8_t;
  using BRegister = bfloat16x8_t;
  static constexpr int64_t kBlockSteps = 128, kBlockMultiple = 4;
  static constexpr int kMaxRows = 5, kPanels = 1, kOneRowPanels = 4, kTwoRowPanels = 2;
  static constexpr bool kPrefetch = false, kWholeGroups = true;  // K is padded to 32: pairs come in fours

  static inline bfloat16x8_t load_a(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }

  static inline void load_b(const void* B, int64_t i, bfloat16x8_t (&b)[4]) {
    const uint16_t* row = static_cast<const uint16_t*>(B) + i;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) b[q] = load_a(row + 8 * q);
  }

  template <int L>
  static inline float32x4_t multiply_add(float32x4_t acc, bfloat16x8_t b, bfloat16x8_t a) {
    return vbfdotq_laneq_f32(acc, b, a, L);
  }

  template <int MR, int NP>
  static void micro(const uint16_t* A, int64_t lda, int64_t pairs, const void* B, int64_t bstride, float* C,
                    int64_t ldc, bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
    arm64::lane_tile<BfdotGemm, MR, NP>(A, lda, pairs, B, bstride, C, ldc, accumulate, pf, pf_stride, pf_every);
  }
};

}  // namespace

void bf16_gemm_bfdot(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                     int64_t p1, float* C, int64_t ldc) {
  panel_gemm<BfdotGemm>(A, lda, M, K / 2, B_packed, p0, p1, C, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
