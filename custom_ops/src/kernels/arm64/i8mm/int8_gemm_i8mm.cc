// The int8 GEMM on the octet layout (int8_gemm.h) with SMMLA (FEAT_I8MM); this folder's files alone
// are compiled with +i8mm and called only after the ISA table's check of the CPU.
//
// SMMLA multiplies a 2 x 8 int8 matrix by the transpose of another and adds the 2 x 2 int32 result
// (each a sum of 8 products, at most 8 * 128 * 128) into its lanes, wrapping: 32 products per
// instruction, twice SDOT's. A 16-byte load of a panel's octet row is two columns' 8 k, SMMLA's right
// operand as it is; the left is two rows' octets side by side. A tile is up to 2 row pairs x 16
// columns (16 accumulators); an odd row is paired with zeros (one row costs the instructions SDOT
// needs for it).
#include <arm_neon.h>

#include "arm64/int8_octets.h"
#include "arm64/row_pairs.h"

namespace moe_onnx {
namespace detail {
namespace {

struct I8mmTile {
  static constexpr int kMaxRows = 4;

  template <int MR>
  static void run(const int8_t* A, int64_t lda, int64_t octets, const int8_t* B, int32_t* C, int64_t ldc,
                  bool accumulate, arm64::Prefetch& prefetch) {
    constexpr int kPairs = (MR + 1) / 2;
    int32x4_t acc[kPairs][8];  // arm64/row_pairs.h
    arm64::load_row_pairs<MR>(acc, C, ldc, accumulate);
    for (int64_t o = 0; o < octets; ++o, B += arm64::kOctetRowBytes) {
      prefetch.step();
      int8x16_t a[kPairs];
#pragma GCC unroll 2
      for (int p = 0; p < kPairs; ++p) {
        const bool second = 2 * p + 1 < MR;
        const int8x8_t top = vld1_s8(A + 2 * p * lda + 8 * o);
        a[p] = vcombine_s8(top, second ? vld1_s8(A + (2 * p + 1) * lda + 8 * o) : vdup_n_s8(0));
      }
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int8x16_t w = vld1q_s8(B + 16 * j);
#pragma GCC unroll 2
        for (int p = 0; p < kPairs; ++p) acc[p][j] = vmmlaq_s32(acc[p][j], a[p], w);
      }
    }
    arm64::store_row_pairs<MR>(acc, C, ldc);
  }
};

}  // namespace

void int8_gemm_octets_i8mm(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                           int64_t p1, int32_t* C, int64_t ldc) {
  arm64::octet_gemm<I8mmTile>(A, lda, M, K, W_packed, p0, p1, C, ldc);
}

}  // namespace detail
}  // namespace moe_onnx
