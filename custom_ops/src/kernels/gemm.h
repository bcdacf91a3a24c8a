// A small GEMM on packed B panels (fp32 activations, fp32/fp16/bf16 weights, fp32 accumulation),
// with AVX-512, AVX2/FMA/F16C and portable kernels (the ISA table's gemm_panels slot, isa.h).
//
// Packed B ([K, N] logically): ceil(N / 16) panels, each [K][16] contiguous and zero padded, so a
// micro-kernel streams a panel while it keeps a tile of rows x 16 results in registers (one zmm or
// two ymm per row). The panels hold
// the weights in their own type (fp16 and bf16 stay 16-bit: decode reads half the bytes) and the
// micro-kernel widens them to fp32, which is exact. Every result element sums over k in increasing
// order in one fp32 chain, whatever the tile it falls in: results do not depend on how the caller splits
// rows or panels into tasks. The chain's steps are fused multiply-adds in the SIMD kernels (AVX2, AVX-512,
// NEON: the same bits on x86-64 and aarch64) and in the portable kernel where the target's base
// instruction set has one (aarch64: every level gives the same bits there), else a multiply then an add
// (the portable kernel on x86-64). packed_weights.h packs the panels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "float_convert.h"

namespace moe_onnx {

constexpr int64_t kPanel = 16;

inline int64_t panel_count(int64_t n) { return (n + kPanel - 1) / kPanel; }

// bf16 panels store each 16-column row with its two halves interleaved (columns 0, 8, 1, 9, ..., 7,
// 15), so the AVX2 kernel widens 16 weights with one load, a shift and a mask (the AVX-512 one
// with a broadcast load and one byte shuffle): column c is in lane bf16_lane(c).
inline int64_t bf16_lane(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

// C[m, 16 * (p - p0) + c] = sum_k A[m, k] * panel_p[k][c] for m < M, p in [p0, p1), c < 16, with
// B_packed holding elements of `type` (uint16_t bits for fp16 and bf16). Ops reach it through
// PackedWeights::multiply (packed_weights.h).
// A is row-major with row stride lda; C is row-major with row stride ldc (>= 16 * (p1 - p0)).
// (A row stride that is a multiple of 4 KB makes the rows of a tile share L1 sets: pad it.)
void gemm_panels(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                 int64_t p1, float* C, int64_t ldc);

namespace detail {
// A float panel's element size in bytes (fp32: 4; fp16, bf16: 2), and B moved on by `elems` of them: how
// the SIMD GEMMs step through their panels.
template <FloatType W>
constexpr int64_t panel_element_bytes() {
  return W == FloatType::kF32 ? 4 : 2;
}
template <FloatType W>
inline const void* panel_advance(const void* B, int64_t elems) {
  return static_cast<const char*>(B) + elems * panel_element_bytes<W>();
}

// The kernels of gemm_panels (the table's slot), arguments as there (M > 0, K > 0, p1 > p0).
using GemmFn = void (*)(FloatType, const float*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*,
                        int64_t);
void gemm_panels_portable(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                          int64_t p0, int64_t p1, float* C, int64_t ldc);
#if defined(MOE_ONNX_HAVE_AVX2)
void gemm_panels_avx2(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                      int64_t p0, int64_t p1, float* C, int64_t ldc);
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
void gemm_panels_avx512(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                        int64_t p0, int64_t p1, float* C, int64_t ldc);
#endif
#if defined(MOE_ONNX_HAVE_NEON)
void gemm_panels_neon(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                      int64_t p0, int64_t p1, float* C, int64_t ldc);
#endif

}  // namespace detail

}  // namespace moe_onnx
