// AVX2 + FMA (+ F16C) micro-kernels of gemm_panels; this file alone is compiled with -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
#include <immintrin.h>

#include "gemm.h"
#include "row_dispatch.h"
#include "x86/avx2/simd_avx2.h"

namespace moe_onnx {
namespace detail {
namespace {

// K is split into equal blocks of at most kKBlock so a block of the B panel (32 KB in fp32) stays in
// L1/L2 while every row tile of the task passes over it; the partial sums go through C between blocks
// (a float stored and loaded back is exact, so the sum over k keeps its order and its bits).
constexpr int64_t kKBlock = 512;

// One 16-wide panel row widened to fp32 (exact for fp16 and bf16): lo = columns 0-7, hi = 8-15 (bf16
// rows are stored in bf16_lane's order: the even elements are columns 0-7, the odd ones 8-15).
template <FloatType W>
inline void load16(const void* B, int64_t i, __m256& lo, __m256& hi) {
  const uint16_t* row16 = static_cast<const uint16_t*>(B) + i;
  if (W == FloatType::kF16) {
    lo = Avx2::widen_f16(row16);
    hi = Avx2::widen_f16(row16 + 8);
  } else if (W == FloatType::kBF16) {
    Avx2::widen_bf16_pairs(row16, lo, hi);
  } else {
    lo = _mm256_loadu_ps(static_cast<const float*>(B) + i);
    hi = _mm256_loadu_ps(static_cast<const float*>(B) + i + 8);
  }
}

// Accumulators are named variables, not arrays: with arrays GCC writes them back to the stack on
// every k step.
//
// Prefetch: while the row tiles of a task compute on one K block of B (from L1 after the first
// tile), the next block (contiguous after it: the next K block, or the next panel) is fetched into
// L2 a line every `pf_every` k steps, each tile taking its share. Without it the weights stream in
// only while the first tile runs and the memory sits idle during the others.
template <FloatType W, int MR>
inline void micro(const float* A, int64_t lda, int64_t K, const void* B, float* C, int64_t ldc, bool accumulate,
                  const char* pf, int64_t pf_every) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (accumulate) {
    c00 = _mm256_loadu_ps(C), c01 = _mm256_loadu_ps(C + 8);
    if (MR > 1) c10 = _mm256_loadu_ps(C + ldc), c11 = _mm256_loadu_ps(C + ldc + 8);
    if (MR > 2) c20 = _mm256_loadu_ps(C + 2 * ldc), c21 = _mm256_loadu_ps(C + 2 * ldc + 8);
    if (MR > 3) c30 = _mm256_loadu_ps(C + 3 * ldc), c31 = _mm256_loadu_ps(C + 3 * ldc + 8);
    if (MR > 4) c40 = _mm256_loadu_ps(C + 4 * ldc), c41 = _mm256_loadu_ps(C + 4 * ldc + 8);
    if (MR > 5) c50 = _mm256_loadu_ps(C + 5 * ldc), c51 = _mm256_loadu_ps(C + 5 * ldc + 8);
  }
  const float* a0 = A;
  const float* a1 = A + lda;
  const float* a2 = A + 2 * lda;
  const float* a3 = A + 3 * lda;
  const float* a4 = A + 4 * lda;
  const float* a5 = A + 5 * lda;
  int64_t countdown = pf_every;
  for (int64_t k = 0; k < K; ++k) {
    if (--countdown == 0) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
      countdown = pf_every;
    }
    __m256 b0, b1;
    load16<W>(B, k * kPanel, b0, b1);
    __m256 a = _mm256_broadcast_ss(a0 + k);
    c00 = _mm256_fmadd_ps(a, b0, c00);
    c01 = _mm256_fmadd_ps(a, b1, c01);
    if (MR > 1) {
      a = _mm256_broadcast_ss(a1 + k);
      c10 = _mm256_fmadd_ps(a, b0, c10);
      c11 = _mm256_fmadd_ps(a, b1, c11);
    }
    if (MR > 2) {
      a = _mm256_broadcast_ss(a2 + k);
      c20 = _mm256_fmadd_ps(a, b0, c20);
      c21 = _mm256_fmadd_ps(a, b1, c21);
    }
    if (MR > 3) {
      a = _mm256_broadcast_ss(a3 + k);
      c30 = _mm256_fmadd_ps(a, b0, c30);
      c31 = _mm256_fmadd_ps(a, b1, c31);
    }
    if (MR > 4) {
      a = _mm256_broadcast_ss(a4 + k);
      c40 = _mm256_fmadd_ps(a, b0, c40);
      c41 = _mm256_fmadd_ps(a, b1, c41);
    }
    if (MR > 5) {
      a = _mm256_broadcast_ss(a5 + k);
      c50 = _mm256_fmadd_ps(a, b0, c50);
      c51 = _mm256_fmadd_ps(a, b1, c51);
    }
  }
  _mm256_storeu_ps(C, c00), _mm256_storeu_ps(C + 8, c01);
  if (MR > 1) _mm256_storeu_ps(C + ldc, c10), _mm256_storeu_ps(C + ldc + 8, c11);
  if (MR > 2) _mm256_storeu_ps(C + 2 * ldc, c20), _mm256_storeu_ps(C + 2 * ldc + 8, c21);
  if (MR > 3) _mm256_storeu_ps(C + 3 * ldc, c30), _mm256_storeu_ps(C + 3 * ldc + 8, c31);
  if (MR > 4) _mm256_storeu_ps(C + 4 * ldc, c40), _mm256_storeu_ps(C + 4 * ldc + 8, c41);
  if (MR > 5) _mm256_storeu_ps(C + 5 * ldc, c50), _mm256_storeu_ps(C + 5 * ldc + 8, c51);
}

// One row (decode): four panels at once, so 8 independent FMA chains hide the FMA latency and four
// weight streams are in flight. Same per-element order as `micro` (k increasing, one chain).
template <FloatType W>
inline void micro_one_row(const float* A, int64_t K, const void* B0, const void* B1, const void* B2, const void* B3,
                          float* C) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t o = k * kPanel;
    // Each panel row is used as soon as it is widened: 8 accumulators + 3 temporaries fit the 16
    // registers (widening all four rows first spills an accumulator to the stack, and the FMA chain
    // through memory halves the fp16 speed).
    const __m256 a = _mm256_broadcast_ss(A + k);
    __m256 lo, hi;
    load16<W>(B0, o, lo, hi);
    c0 = _mm256_fmadd_ps(a, lo, c0);
    c1 = _mm256_fmadd_ps(a, hi, c1);
    load16<W>(B1, o, lo, hi);
    c2 = _mm256_fmadd_ps(a, lo, c2);
    c3 = _mm256_fmadd_ps(a, hi, c3);
    load16<W>(B2, o, lo, hi);
    c4 = _mm256_fmadd_ps(a, lo, c4);
    c5 = _mm256_fmadd_ps(a, hi, c5);
    load16<W>(B3, o, lo, hi);
    c6 = _mm256_fmadd_ps(a, lo, c6);
    c7 = _mm256_fmadd_ps(a, hi, c7);
  }
  _mm256_storeu_ps(C, c0), _mm256_storeu_ps(C + 8, c1), _mm256_storeu_ps(C + 16, c2), _mm256_storeu_ps(C + 24, c3);
  _mm256_storeu_ps(C + 32, c4), _mm256_storeu_ps(C + 40, c5), _mm256_storeu_ps(C + 48, c6);
  _mm256_storeu_ps(C + 56, c7);
}

// Two rows: two panels at once (8 FMA chains, 14 registers; four panels would need 26 and spill).
template <FloatType W>
inline void micro_two_rows(const float* A, int64_t lda, int64_t K, const void* B0, const void* B1, float* C,
                           int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
  __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  const float* a1p = A + lda;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t o = k * kPanel;
    __m256 b0, b1, b2, b3;
    load16<W>(B0, o, b0, b1);
    load16<W>(B1, o, b2, b3);
    const __m256 a0 = _mm256_broadcast_ss(A + k);
    const __m256 a1 = _mm256_broadcast_ss(a1p + k);
    c00 = _mm256_fmadd_ps(a0, b0, c00);
    c01 = _mm256_fmadd_ps(a0, b1, c01);
    c02 = _mm256_fmadd_ps(a0, b2, c02);
    c03 = _mm256_fmadd_ps(a0, b3, c03);
    c10 = _mm256_fmadd_ps(a1, b0, c10);
    c11 = _mm256_fmadd_ps(a1, b1, c11);
    c12 = _mm256_fmadd_ps(a1, b2, c12);
    c13 = _mm256_fmadd_ps(a1, b3, c13);
  }
  _mm256_storeu_ps(C, c00), _mm256_storeu_ps(C + 8, c01), _mm256_storeu_ps(C + 16, c02);
  _mm256_storeu_ps(C + 24, c03);
  float* D = C + ldc;
  _mm256_storeu_ps(D, c10), _mm256_storeu_ps(D + 8, c11), _mm256_storeu_ps(D + 16, c12);
  _mm256_storeu_ps(D + 24, c13);
}

template <FloatType W>
void gemm(const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0, int64_t p1, float* C,
          int64_t ldc) {
  const int64_t stride = K * kPanel;  // elements per panel
  int64_t p = p0;
  if (M == 1) {
    for (; p + 4 <= p1; p += 4) {
      const void* B = panel_advance<W>(B_packed, p * stride);
      const void *B1 = panel_advance<W>(B, stride), *B2 = panel_advance<W>(B, 2 * stride),
                 *B3 = panel_advance<W>(B, 3 * stride);
      micro_one_row<W>(A, K, B, B1, B2, B3, C + (p - p0) * kPanel);
    }
  } else if (M == 2) {
    for (; p + 2 <= p1; p += 2) {
      const void* B = panel_advance<W>(B_packed, p * stride);
      micro_two_rows<W>(A, lda, K, B, panel_advance<W>(B, stride), C + (p - p0) * kPanel, ldc);
    }
  }
  const int64_t tiles = (M + 5) / 6;
  const int64_t kblocks = (K + kKBlock - 1) / kKBlock, kblock = (K + kblocks - 1) / kblocks;  // equal blocks
  for (; p < p1; ++p) {
    float* Cp = C + (p - p0) * kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kblock) {
      const int64_t kb = K - k0 < kblock ? K - k0 : kblock;
      const void* B = panel_advance<W>(B_packed, p * stride + k0 * kPanel);
      const float* Ak = A + k0;
      const bool acc = k0 > 0;
      // The next block's lines, shared out over the tiles (each prefetches `share` lines).
      const int64_t lines = (kb * kPanel * static_cast<int64_t>(W == FloatType::kF32 ? 4 : 2) + 63) / 64;
      const int64_t share = (lines + tiles - 1) / tiles;
      const int64_t every = kb / share > 0 ? kb / share : 1;
      const char* next = static_cast<const char*>(panel_advance<W>(B, kb * kPanel));
      // Row tiles of equal height (16 rows: 6 + 5 + 5, not 6 + 6 + 4; 7 rows: 4 + 3, not 6 + 1): a
      // short tile has too few FMA chains to hide the FMA latency.
      const int64_t base = M / tiles, extra = M % tiles;
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = base + (t < extra ? 1 : 0);
        const char* pf = next + t * share * 64;
        const float* At = Ak + m * lda;
        float* Ct = Cp + m * ldc;
        with_rows<6>(rows, [&](auto r) { micro<W, decltype(r)::value>(At, lda, kb, B, Ct, ldc, acc, pf, every); });
        m += rows;
      }
    }
  }
}

}  // namespace

void gemm_panels_avx2(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                      int64_t p0, int64_t p1, float* C, int64_t ldc) {
  switch (type) {
    case FloatType::kF16: return gemm<FloatType::kF16>(A, lda, M, K, B_packed, p0, p1, C, ldc);
    case FloatType::kBF16: return gemm<FloatType::kBF16>(A, lda, M, K, B_packed, p0, p1, C, ldc);
    default: return gemm<FloatType::kF32>(A, lda, M, K, B_packed, p0, p1, C, ldc);
  }
}

}  // namespace detail
}  // namespace moe_onnx
