// The int8 GEMM on the octet layout (int8_gemm.h) with SDOT (Armv8.2's FEAT_DotProd); this folder's
// files alone are compiled with +dotprod and called only after the ISA table's check of the CPU.
//
// SDOT multiplies 4 int8 pairs per int32 lane and adds their sum (at most 4 * 128 * 128) into the lane,
// wrapping. A 16-byte load of a panel's octet row holds two columns' 8 k (lanes: column c's k 0-3 and
// 4-7, then column c + 1's); times the row's octet loaded into both halves, SDOT adds each column's two
// 4-k halves into two lanes, which ADDP adds at the end. A tile is up to 3 rows x 16 columns (24
// accumulators).
#include <arm_neon.h>

#include "arm64/int8_octets.h"

namespace moe_onnx {
namespace detail {
namespace {

struct DotprodTile {
  static constexpr int kMaxRows = 3;

  template <int MR>
  static void run(const int8_t* A, int64_t lda, int64_t octets, const int8_t* B, int32_t* C, int64_t ldc,
                  bool accumulate, arm64::Prefetch& prefetch) {
    int32x4_t acc[MR][8];  // acc[r][j]: columns 2j (lanes 0, 1) and 2j + 1 (lanes 2, 3)
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        int32x4_t start = vdupq_n_s32(0);
        if (accumulate) {
          start = vsetq_lane_s32(C[r * ldc + 2 * j], start, 0);
          start = vsetq_lane_s32(C[r * ldc + 2 * j + 1], start, 2);
        }
        acc[r][j] = start;
      }
    for (int64_t o = 0; o < octets; ++o, B += arm64::kOctetRowBytes) {
      prefetch.step();
      int8x16_t a[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) a[r] = arm64::octet_in_both_halves(A + r * lda + 8 * o);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int8x16_t w = vld1q_s8(B + 16 * j);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) acc[r][j] = vdotq_s32(acc[r][j], w, a[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) vst1q_s32(C + r * ldc + 2 * j, vpaddq_s32(acc[r][j], acc[r][j + 1]));
  }
};

}  // namespace

void int8_gemm_octets_dotprod(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                              int64_t p1, int32_t* C, int64_t ldc) {
  arm64::octet_gemm<DotprodTile>(A, lda, M, K, W_packed, p0, p1, C, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
