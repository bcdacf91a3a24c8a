// AVX2 + FMA micro-kernels of gemm_panels; this file alone is compiled with -mavx2 -mfma and is
// only called after a run-time check of the CPU.
#include <immintrin.h>

#include "gemm.h"

namespace moe_onnx {
namespace detail {

// K is split into blocks so a block of the B panel (kKBlock x 16 floats) stays in L1 while every
// row tile of the task passes over it; the partial sums go through C between blocks (a float stored
// and loaded back is exact, so the sum over k keeps its order and its bits).
constexpr int64_t kKBlock = 256;

// Accumulators are named variables, not arrays: with arrays GCC writes them back to the stack on
// every k step.
template <int MR>
static inline void micro_avx2(const float* A, int64_t lda, int64_t K, const float* B, float* C, int64_t ldc,
                              bool accumulate) {
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
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * kPanel);
    const __m256 b1 = _mm256_loadu_ps(B + k * kPanel + 8);
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

void gemm_panels_avx2(const float* A, int64_t lda, int64_t M, int64_t K, const float* B_packed, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    float* Cp = C + (p - p0) * kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      const int64_t kb = K - k0 < kKBlock ? K - k0 : kKBlock;
      const float* B = B_packed + (p * K + k0) * kPanel;
      const float* Ak = A + k0;
      const bool acc = k0 > 0;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) micro_avx2<6>(Ak + m * lda, lda, kb, B, Cp + m * ldc, ldc, acc);
      switch (M - m) {
        case 5: micro_avx2<5>(Ak + m * lda, lda, kb, B, Cp + m * ldc, ldc, acc); break;
        case 4: micro_avx2<4>(Ak + m * lda, lda, kb, B, Cp + m * ldc, ldc, acc); break;
        case 3: micro_avx2<3>(Ak + m * lda, lda, kb, B, Cp + m * ldc, ldc, acc); break;
        case 2: micro_avx2<2>(Ak + m * lda, lda, kb, B, Cp + m * ldc, ldc, acc); break;
        case 1: micro_avx2<1>(Ak + m * lda, lda, kb, B, Cp + m * ldc, ldc, acc); break;
        default: break;
      }
    }
  }
}

}  // namespace detail
}  // namespace moe_onnx
