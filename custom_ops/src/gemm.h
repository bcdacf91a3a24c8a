// A small fp32 GEMM on packed B panels, with AVX2/FMA chosen at run time and a portable fallback.
//
// Packed B ([K, N] logically): ceil(N / 16) panels, each [K][16] contiguous and zero padded, so a
// micro-kernel streams one panel while it keeps up to 6 x 16 results in registers. Every result
// element sums over k in increasing order, whatever the tile it falls in: results do not depend on
// how the caller splits rows or panels into tasks.
#pragma once

#include <cstdint>

namespace moe_onnx {

constexpr int64_t kPanel = 16;

inline int64_t panel_count(int64_t n) { return (n + kPanel - 1) / kPanel; }

// C[m, 16 * (p - p0) + c] = sum_k A[m, k] * panel_p[k][c] for m < M, p in [p0, p1), c < 16.
// A is row-major with row stride lda; C is row-major with row stride ldc (>= 16 * (p1 - p0)).
void gemm_panels(const float* A, int64_t lda, int64_t M, int64_t K, const float* B_packed, int64_t p0, int64_t p1,
                 float* C, int64_t ldc);

// Which implementation gemm_panels uses on this machine ("avx2-fma" or "portable").
const char* gemm_isa();

namespace detail {
void gemm_panels_portable(const float* A, int64_t lda, int64_t M, int64_t K, const float* B_packed, int64_t p0,
                          int64_t p1, float* C, int64_t ldc);
#if defined(MOE_ONNX_HAVE_AVX2)
void gemm_panels_avx2(const float* A, int64_t lda, int64_t M, int64_t K, const float* B_packed, int64_t p0,
                      int64_t p1, float* C, int64_t ldc);
#endif
}  // namespace detail

}  // namespace moe_onnx
