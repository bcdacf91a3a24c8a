// AVX2 + FMA (+ F16C) micro-kernels of gemm_panels; this file alone is compiled with -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
#include <immintrin.h>

#include "gemm.h"
#include "panel_gemm.h"
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

// Prefetch: while the row tiles of a task compute on one K block of B (from L1 after the first
// tile), the next block (contiguous after it: the next K block, or the next panel) is fetched into
// L2 a line every `pf_every` k steps, each tile taking its share. Without it the weights stream in
// only while the first tile runs and the memory sits idle during the others.
template <FloatType W, int MR>
inline void micro_tile(const float* A, int64_t lda, int64_t K, const void* B, float* C, int64_t ldc, bool accumulate,
                       const char* pf, int64_t pf_every) {
  __m256 acc[MR][2];  // row r's columns 0-7 and 8-15
  load_accumulators<Avx2>(acc, C, ldc, accumulate);
  int64_t countdown = pf_every;
  for (int64_t k = 0; k < K; ++k) {
    if (--countdown == 0) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
      countdown = pf_every;
    }
    __m256 b0, b1;
    load16<W>(B, k * kPanel, b0, b1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  store_accumulators<Avx2>(acc, C, ldc);
}

// One row (decode): four panels at once, so 8 independent FMA chains hide the FMA latency and four
// weight streams are in flight. Same per-element order as `micro_tile` (k increasing, one chain).
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

// The driver's kernel (panel_gemm.h): tiles of up to 6 rows x one panel, K in blocks of up to 512; one
// row streams four panels at once, two rows two.
template <FloatType W>
struct Avx2Gemm : FloatPanelSteps<W> {
  static constexpr int64_t kBlockSteps = kKBlock, kBlockMultiple = 1;
  static constexpr int kMaxRows = 6, kPanels = 1, kOneRowPanels = 4, kTwoRowPanels = 2;
  static constexpr bool kPrefetch = true;

  template <int MR, int NP>
  static void micro(const float* A, int64_t lda, int64_t K, const void* B, int64_t bstride, float* C, int64_t ldc,
                    bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
    if constexpr (MR == 1 && NP == 4) {
      micro_one_row<W>(A, K, B, panel_advance<W>(B, bstride), panel_advance<W>(B, 2 * bstride),
                       panel_advance<W>(B, 3 * bstride), C);
    } else if constexpr (MR == 2 && NP == 2) {
      micro_two_rows<W>(A, lda, K, B, panel_advance<W>(B, bstride), C, ldc);
    } else {
      static_assert(NP == 1, "the AVX2 row tiles are one panel wide");
      micro_tile<W, MR>(A, lda, K, B, C, ldc, accumulate, pf, pf_every);
    }
  }
};

}  // namespace

void gemm_panels_avx2(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                      int64_t p0, int64_t p1, float* C, int64_t ldc) {
  with_float_type(type, [&](auto w) {
    panel_gemm<Avx2Gemm<decltype(w)::value>>(A, lda, M, K, B_packed, p0, p1, C, ldc);
  });
}

}  // namespace detail
}  // namespace moe_onnx
