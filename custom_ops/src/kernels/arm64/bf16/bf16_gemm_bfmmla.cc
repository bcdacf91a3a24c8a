// bf16_gemm_panels on BFMMLA (FEAT_BF16: the table's bf16_gemm_tiles slot at the bf16 level, the calls
// of kBf16TileRows rows or more); this folder's files alone are compiled with +bf16 and called only
// after the ISA table's check of the CPU.
//
// BFMMLA multiplies a 2 x 4 bf16 matrix (two rows' 4 k) by the transpose of another (two columns' 4 k)
// and adds the 2 x 2 result: 16 products per instruction, twice BFDOT's. As the Arm ARM defines it
// (FPCR.EBF = 0), each result element takes two BFDOT steps, k 0-1 then k 2-3 (bf16_gemm_bfdot.cc:
// round to odd, denormals as zeros, default NaN), so a result has the bits of the BFDOT kernel's chain.
// The pair panels hold a column's 4 k in two pair rows: one ZIP1 (ZIP2) of the two rows' registers
// makes the operand of columns 4q and 4q + 1 (4q + 2 and 4q + 3). A tile is up to 3 row pairs x 16
// columns (24 accumulators); an odd row is paired with zeros.
#include <arm_neon.h>

#include "arm64/row_pairs.h"
#include "bf16_gemm.h"
#include "panel_gemm.h"

namespace moe_onnx {
namespace detail {
namespace {

constexpr int64_t kPairRow = 2 * kPanel;  // bf16 elements of a pair row

// Rows 2p, 2p + 1 (or zeros) of MR: their k [k, k + 4) side by side.
template <int MR>
inline bfloat16x8_t row_pair(const uint16_t* A, int64_t lda, int p, int64_t k) {
  const uint16x4_t top = vld1_u16(A + 2 * p * lda + k);
  const uint16x4_t bottom = 2 * p + 1 < MR ? vld1_u16(A + (2 * p + 1) * lda + k) : vdup_n_u16(0);
  return vreinterpretq_bf16_u16(vcombine_u16(top, bottom));
}

// The driver's kernel (panel_gemm.h): K blocks of at most 128 pairs (a panel's block, 8 KB, stays in L1), an
// even number (a step of the loop takes two pair rows); row tiles of up to 6 rows x one panel (3 row pairs:
// 24 accumulators), whatever the call's rows.
struct BfmmlaGemm : PairPanelSteps {
  static constexpr int64_t kBlockSteps = 128, kBlockMultiple = 2;
  static constexpr int kMaxRows = 6, kPanels = 1, kOneRowPanels = 0, kTwoRowPanels = 0;
  static constexpr bool kPrefetch = false;

  // As panel_gemm.h says, over `pairs` pairs (even) of one panel.
  template <int MR, int NP>
  static void micro(const uint16_t* A, int64_t lda, int64_t pairs, const void* B_panel, int64_t bstride, float* C,
                    int64_t ldc, bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
    static_assert(NP == 1, "the BFMMLA tiles are one panel wide");
    constexpr int kPairs = (MR + 1) / 2;
    const auto* B = static_cast<const uint16_t*>(B_panel);
    float32x4_t acc[kPairs][8];  // arm64/row_pairs.h
    arm64::load_row_pairs<MR>(acc, C, ldc, accumulate);
    for (int64_t j = 0; j < pairs; j += 2, B += 2 * kPairRow) {  // k [2j, 2j + 4): pair rows j and j + 1
      bfloat16x8_t a[kPairs];
#pragma GCC unroll 4
      for (int p = 0; p < kPairs; ++p) a[p] = row_pair<MR>(A, lda, p, 2 * j);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {  // columns 4q .. 4q + 3
        const uint32x4_t first = vreinterpretq_u32_u16(vld1q_u16(B + 8 * q));
        const uint32x4_t second = vreinterpretq_u32_u16(vld1q_u16(B + kPairRow + 8 * q));
        const bfloat16x8_t left = vreinterpretq_bf16_u32(vzip1q_u32(first, second));   // columns 4q, 4q + 1
        const bfloat16x8_t right = vreinterpretq_bf16_u32(vzip2q_u32(first, second));  // columns 4q + 2, 4q + 3
#pragma GCC unroll 4
        for (int p = 0; p < kPairs; ++p) {
          acc[p][2 * q] = vbfmmlaq_f32(acc[p][2 * q], a[p], left);
          acc[p][2 * q + 1] = vbfmmlaq_f32(acc[p][2 * q + 1], a[p], right);
        }
      }
    }
    arm64::store_row_pairs<MR>(acc, C, ldc);
  }
};

}  // namespace

void bf16_gemm_bfmmla(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  panel_gemm<BfmmlaGemm>(A, lda, M, K / 2, B_packed, p0, p1, C, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
