// int8 x int8 -> int32 GEMM for Y = X @ W^T (W in nn.Linear layout [N, K]), exact: every product
// and pair sum fits int32 and the sum over k wraps modulo 2^32 like numpy's int32 matmul, so the
// result does not depend on the summation order. AVX2 (vpmaddwd on int16-widened values) chosen at
// run time; portable fallback (MOE_ONNX_GEMM=portable forces it, as for the float GEMM).
//
// Layouts: A rows are widened to int16 with K padded to an even K2 = 2 * pairs (zeros); W is packed
// into ceil(N / 16) panels, each [pairs][16 columns][2] int16: the two k of a pair side by side, so
// one 32-bit broadcast of an A pair times one panel row gives 8 columns' pair sums per instruction.
// packed_weights.h packs W.
#pragma once

#include <cstdint>

#include "gemm.h"

namespace moe_onnx {

// Columns per panel: the float GEMM's, so callers split int8 and float work into the same tasks.
constexpr int64_t kInt8Panel = kPanel;

inline int64_t int8_pairs(int64_t K) { return (K + 1) / 2; }
// dst[r * 2 * pairs + k] = src[r * K + k] as int16, zero for the padding k = K (odd K).
void widen_int8_rows(const int8_t* src, int64_t rows, int64_t K, int16_t* dst);

// C[m, 16 * (p - p0) + c] = sum_k A[m, k] * W[16 p + c, k] (int32, wrapping) for m < M, p in [p0, p1),
// c < 16. A: widened rows with row stride lda (>= 2 * pairs); C row stride ldc (>= 16 * (p1 - p0)).
void int8_gemm_panels(const int16_t* A, int64_t lda, int64_t M, int64_t pairs, const int16_t* W_packed, int64_t p0,
                      int64_t p1, int32_t* C, int64_t ldc);

namespace detail {
void widen_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, int16_t* dst);
void int8_gemm_panels_portable(const int16_t* A, int64_t lda, int64_t M, int64_t pairs, const int16_t* W_packed,
                               int64_t p0, int64_t p1, int32_t* C, int64_t ldc);
#if defined(MOE_ONNX_HAVE_AVX2)
void widen_int8_rows_avx2(const int8_t* src, int64_t rows, int64_t K, int16_t* dst);
void int8_gemm_panels_avx2(const int16_t* A, int64_t lda, int64_t M, int64_t pairs, const int16_t* W_packed,
                           int64_t p0, int64_t p1, int32_t* C, int64_t ldc);
#endif
}  // namespace detail

}  // namespace moe_onnx
