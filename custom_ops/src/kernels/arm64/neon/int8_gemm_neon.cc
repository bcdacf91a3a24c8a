// The int8 GEMM on the octet layout (int8_gemm.h) with Advanced SIMD alone (no dot product
// instructions): SMULL multiplies 8 int8 pairs into int16 (at most 128 * 128, exact) and SADALP adds
// adjacent int16 products into int32 lanes (wrapping). Each column keeps its own accumulator of 4 lanes
// (its k = 0-1, 2-3, 4-5, 6-7 of every octet), added across at the end; so a tile is 1 or 2 rows x 8
// columns (16 accumulators), the panel taken in two halves. Two int16 products are never summed in
// int16 (SMLAL2 would overflow at (-128)^2 * 2).
#include <arm_neon.h>

#include "arm64/int8_octets.h"

namespace moe_onnx {
namespace detail {
namespace {

struct NeonTile {
  static constexpr int kMaxRows = 2;

  template <int MR>
  static void run(const int8_t* A, int64_t lda, int64_t octets, const int8_t* B, int32_t* C, int64_t ldc,
                  bool accumulate, arm64::Prefetch& prefetch) {
    for (int half = 0; half < 2; ++half) {  // columns 8 half .. 8 half + 7: bytes 64 half .. of each octet row
      int32x4_t acc[MR][8];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 8; ++c)
          acc[r][c] = vsetq_lane_s32(accumulate ? C[r * ldc + 8 * half + c] : 0, vdupq_n_s32(0), 0);
      const int8_t* b = B + 64 * half;
      for (int64_t o = 0; o < octets; ++o, b += arm64::kOctetRowBytes) {
        if (half == 0) prefetch.step();
        int8x16_t a[MR];
        for (int r = 0; r < MR; ++r) a[r] = arm64::octet_in_both_halves(A + r * lda + 8 * o);
        for (int q = 0; q < 4; ++q) {  // columns 2q, 2q + 1 of the half
          const int8x16_t w = vld1q_s8(b + 16 * q);
          for (int r = 0; r < MR; ++r) {
            acc[r][2 * q] = vpadalq_s16(acc[r][2 * q], vmull_s8(vget_low_s8(w), vget_low_s8(a[r])));
            acc[r][2 * q + 1] = vpadalq_s16(acc[r][2 * q + 1], vmull_high_s8(w, a[r]));
          }
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 8; c += 4) {
          const int32x4_t sums = vpaddq_s32(vpaddq_s32(acc[r][c], acc[r][c + 1]), vpaddq_s32(acc[r][c + 2], acc[r][c + 3]));
          vst1q_s32(C + r * ldc + 8 * half + c, sums);
        }
    }
  }
};

}  // namespace

void int8_gemm_octets_neon(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                           int64_t p1, int32_t* C, int64_t ldc) {
  arm64::octet_gemm<NeonTile>(A, lda, M, K, W_packed, p0, p1, C, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
