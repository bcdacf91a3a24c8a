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

#include "bf16_gemm.h"
#include "row_dispatch.h"

namespace moe_onnx {
namespace detail {
namespace {

constexpr int64_t kKBlockPairs = 128;     // a panel's block of pairs: 8 KB, in L1 while the row tiles pass
constexpr int64_t kMaxRows = 6;
constexpr int64_t kPairRow = 2 * kPanel;  // bf16 elements of a pair row

// Rows 2p, 2p + 1 (or zeros) of MR: their k [k, k + 4) side by side.
template <int MR>
inline bfloat16x8_t row_pair(const uint16_t* A, int64_t lda, int p, int64_t k) {
  const uint16x4_t top = vld1_u16(A + 2 * p * lda + k);
  const uint16x4_t bottom = 2 * p + 1 < MR ? vld1_u16(A + (2 * p + 1) * lda + k) : vdup_n_u16(0);
  return vreinterpretq_bf16_u16(vcombine_u16(top, bottom));
}

// C[r, c] (+)= pairs [0, pairs) of rows r < MR times the panel at B; `pairs` is even.
template <int MR>
void micro(const uint16_t* A, int64_t lda, int64_t pairs, const uint16_t* B, float* C, int64_t ldc, bool accumulate) {
  constexpr int kPairs = (MR + 1) / 2;
  // acc[p][j]: rows 2p, 2p + 1 x columns 2j, 2j + 1, lanes (2p, 2j), (2p, 2j + 1), (2p + 1, 2j), (2p + 1, 2j + 1)
  float32x4_t acc[kPairs][8];
#pragma GCC unroll 4
  for (int p = 0; p < kPairs; ++p) {
    const bool second = 2 * p + 1 < MR;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const float32x2_t top = accumulate ? vld1_f32(C + 2 * p * ldc + 2 * j) : vdup_n_f32(0.0f);
      const float32x2_t bottom = accumulate && second ? vld1_f32(C + (2 * p + 1) * ldc + 2 * j) : vdup_n_f32(0.0f);
      acc[p][j] = vcombine_f32(top, bottom);
    }
  }
  for (int64_t j = 0; j < pairs; j += 2, B += 2 * kPairRow) {  // k [2j, 2j + 4): pair rows j and j + 1
    bfloat16x8_t a[kPairs];
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) a[p] = row_pair<MR>(A, lda, p, 2 * j);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {  // columns 4q .. 4q + 3
      const uint32x4_t first = vreinterpretq_u32_u16(vld1q_u16(B + 8 * q));
      const uint32x4_t second = vreinterpretq_u32_u16(vld1q_u16(B + kPairRow + 8 * q));
      const bfloat16x8_t left = vreinterpretq_bf16_u32(vzip1q_u32(first, second));    // columns 4q, 4q + 1
      const bfloat16x8_t right = vreinterpretq_bf16_u32(vzip2q_u32(first, second));   // columns 4q + 2, 4q + 3
#pragma GCC unroll 4
      for (int p = 0; p < kPairs; ++p) {
        acc[p][2 * q] = vbfmmlaq_f32(acc[p][2 * q], a[p], left);
        acc[p][2 * q + 1] = vbfmmlaq_f32(acc[p][2 * q + 1], a[p], right);
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < kPairs; ++p) {
    const bool second = 2 * p + 1 < MR;
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const float64x2_t left = vreinterpretq_f64_f32(acc[p][j]), right = vreinterpretq_f64_f32(acc[p][j + 1]);
      vst1q_f32(C + 2 * p * ldc + 2 * j, vreinterpretq_f32_f64(vzip1q_f64(left, right)));
      if (second) vst1q_f32(C + (2 * p + 1) * ldc + 2 * j, vreinterpretq_f32_f64(vzip2q_f64(left, right)));
    }
  }
}

}  // namespace

void bf16_gemm_bfmmla(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  const auto* B = static_cast<const uint16_t*>(B_packed);
  const int64_t stride = K * kPanel, pairs = K / 2;  // elements per pair panel
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows, base = M / tiles, extra = M % tiles;
  const int64_t blocks = (pairs + kKBlockPairs - 1) / kKBlockPairs, block = (pairs + blocks - 1) / blocks / 2 * 2;
  for (int64_t p = p0; p < p1; ++p) {
    float* Cp = C + (p - p0) * kPanel;
    for (int64_t j0 = 0; j0 < pairs; j0 += block) {
      const int64_t jb = pairs - j0 < block ? pairs - j0 : block;
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = base + (t < extra ? 1 : 0);
        const uint16_t* At = A + m * lda + 2 * j0;
        float* Ct = Cp + m * ldc;
        with_rows<kMaxRows>(rows, [&](auto r) {
          micro<decltype(r)::value>(At, lda, jb, B + p * stride + j0 * kPairRow, Ct, ldc, j0 > 0);
        });
        m += rows;
      }
    }
  }
}

}  // namespace detail
}  // namespace moe_onnx
