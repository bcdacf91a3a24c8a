// The bf16 GEMM of accuracy_level 3 (MOE's GEMMs, QMOE's prefill, MoeRowParallelLinear with float
// X): both operands rounded to bfloat16 (round to nearest even), products summed in fp32. The ISA
// table's bf16_gemm and bf16_gemm_tiles slots (isa.h); the ops reach it through
// PackedWeights::multiply (packed_weights.h), whose WeightFormat::kBF16Pairs holds B.
//
// One layout serves both bf16 dot-product instructions:
//   B  ceil(N / 16) pair panels, each [K / 2 pairs][16 columns][2] bf16: a pair row (the two k of a
//      pair for 16 columns) is 64 bytes, a zmm for vdpbf16ps (AVX512-BF16) and a row of a B tile for
//      TDPBF16PS (AMX), 16 pair rows (32 k) a whole tile. K is padded with zeros to a multiple of
//      kBf16StepK (32), so the AMX kernel has no K tail.
//   A  bf16 rows of bf16_padded_k(K) elements, zero past K (a pad NaN would poison the zero weights
//      there), row stride lda elements (bf16_row_stride: 64-byte rows, never a multiple of 1 KB).
//
// The kernels, by the rows of a call (the caller's task plan fixes them, never the thread count):
//   M >= kBf16TileRows and the table has AMX-BF16 (the hardware, or its model with
//   MOE_ONNX_AMX=model): bf16_gemm_tiles, TDPBF16PS on tiles of 16 rows x 16 columns x 32 k
//   (bf16_gemm_amx.h). Per element, each instruction adds to C the sum of a chain over the 16 even k
//   of its step and a chain over the 16 odd k (amx_tiles.h), steps in increasing k.
//   Fewer rows: bf16_gemm, vdpbf16ps (AVX512-BF16), which adds, per pair in increasing k, the odd k's
//   product and then the even k's to C, each a fused multiply-add. Where the table has AMX-BF16 but
//   no AVX512-BF16 (the model on a CPU without it), a portable kernel does the same arithmetic, so
//   the small-row results have the same bits on every machine (finite data).
// Both instructions read bf16 denormals as zero and flush fp32 results below 2^-126 to zero; the two
// orders give results within the fp32 accumulation error of each other, not the same bits: which
// kernel a call runs is part of its result, as the rows decide it.
#pragma once

#include <cstdint>

#include "float_convert.h"
#include "gemm.h"

namespace moe_onnx {

// k of one AMX step (a tile row of A: 64 bytes); pair panels and bf16 rows are padded to it.
constexpr int64_t kBf16StepK = 32;
inline int64_t bf16_padded_k(int64_t K) { return (K + kBf16StepK - 1) / kBf16StepK * kBf16StepK; }
// bf16 elements of one pair panel of K rows.
inline int64_t bf16_pair_panel_elements(int64_t K) { return bf16_padded_k(K) * kPanel; }
// Row stride, in bf16 elements, of bf16 rows of K values: the padded K, plus one step when the row's
// bytes are a multiple of 1 KB (the rows of a tile would crowd the same L1 sets).
inline int64_t bf16_row_stride(int64_t K) {
  const int64_t ld = bf16_padded_k(K);
  return (2 * ld) % 1024 == 0 ? ld + kBf16StepK : ld;
}

// Rows of a call from which the AMX kernel runs (where the table has one). Measured on a 2-core Xeon
// with AMX (K=2048, N=1536, 2 threads): with 1-2 rows both stream the weights in about the same time;
// from 4 rows the tiles take 0.3-0.7x vdpbf16ps's time (docs/building.md, "bf16 compute"). The model
// takes the same rows, so tests cross it on any machine.
constexpr int64_t kBf16TileRows = 4;

// C[m, 16 * (p - p0) + c] = sum_k A[m, k] * B_p[k, c] for m < M, p in [p0, p1), c < 16: A bf16 rows
// (lda elements apart, bf16_padded_k(K) elements each, zero past K), B pair panels of K rows, C fp32
// (row stride ldc).
void bf16_gemm_panels(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                      int64_t p1, float* C, int64_t ldc);

// dst[i] = src[i] (`type`) rounded to bf16 (float_to_bf16; bf16 copied) for i < n.
void round_to_bf16(FloatType type, const void* src, int64_t n, uint16_t* dst);
// round_to_bf16, then zeros up to bf16_padded_k(n): one row as bf16_gemm_panels reads it.
void bf16_row(FloatType type, const void* src, int64_t n, uint16_t* dst);

namespace detail {
// The kernels of bf16_gemm_panels (the table's slots), arguments as there with K padded (a multiple
// of kBf16StepK, > 0), M > 0, p1 > p0.
using Bf16GemmFn = void (*)(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                            int64_t p1, float* C, int64_t ldc);
// vdpbf16ps's arithmetic in scalar code: for the model of AMX on CPUs without AVX512-BF16.
void bf16_gemm_portable(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*, int64_t);
// The AMX kernel (bf16_gemm_amx.h) on the model of the tiles, and on the instructions.
void bf16_gemm_amx_model(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*, int64_t);
#if defined(MOE_ONNX_HAVE_AMX)
void bf16_gemm_amx(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*, int64_t);
#endif
#if defined(MOE_ONNX_HAVE_AVX512_BF16)
void bf16_gemm_avx512bf16(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*,
                          int64_t);
#endif
#if defined(MOE_ONNX_HAVE_ARM_BF16)
// aarch64's bf16 level: BFDOT (bf16_gemm) and BFMMLA (bf16_gemm_tiles), the same bits (arm64/bf16/).
void bf16_gemm_bfdot(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*, int64_t);
void bf16_gemm_bfmmla(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, int64_t, float*, int64_t);
#endif
}  // namespace detail

}  // namespace moe_onnx
