// AVX-512 micro-kernels of gemm_panels; this file alone is compiled with -mavx512f
// -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c and is only called after a run-time check of the CPU.
//
// A 16-wide panel row is one zmm register, so a tile is rows x panels accumulators with no A
// register at all (the A element is broadcast from memory inside the FMA). 32 registers allow 12
// rows x 2 panels (24 accumulators + 2 panel rows). Each result element is one FMA chain over k in
// increasing order, as in the AVX2 kernels: the tiling never changes a result's bits.
#include <immintrin.h>

#include "gemm.h"
#include "panel_gemm.h"
#include "x86/avx512/simd_avx512.h"

namespace moe_onnx {
namespace detail {
namespace {

// Panel row k of B (16 elements from element offset i) widened to fp32 (exact for fp16 and bf16; bf16
// rows are stored in bf16_lane's order).
template <FloatType W>
inline __m512 load16(const void* B, int64_t i) {
  if (W == FloatType::kF16) return Avx512::widen_f16(static_cast<const uint16_t*>(B) + i);
  if (W == FloatType::kBF16) return Avx512::widen_bf16_interleaved(static_cast<const uint16_t*>(B) + i);
  return _mm512_loadu_ps(static_cast<const float*>(B) + i);
}

// The driver's kernel (panel_gemm.h). K blocks of at most 256 steps: the block of the two panels a tile
// reads (32 KB in fp32) stays in L1. Row tiles of up to 12 rows x two panels (24 accumulators); one or two
// rows stream four panels at once (four weight streams in flight, as in the AVX2 kernels: eight measured
// 3-6% slower on Zen 4).
template <FloatType W>
struct Avx512Gemm : FloatPanelSteps<W> {
  static constexpr int64_t kBlockSteps = 256, kBlockMultiple = 1;
  static constexpr int kMaxRows = 12, kPanels = 2, kOneRowPanels = 4, kTwoRowPanels = 4;
  static constexpr bool kPrefetch = true;

  // As panel_gemm.h says. The accumulator array is indexed only by constants after the unrolled loops, so
  // it stays in registers.
  template <int MR, int NP>
  static void micro(const float* A, int64_t lda, int64_t K, const void* B, int64_t bstride, float* C, int64_t ldc,
                    bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
    __m512 acc[MR][NP];
    load_accumulators<Avx512>(acc, C, ldc, accumulate);
    int64_t countdown = pf ? pf_every : K + 1;
    for (int64_t k = 0; k < K; ++k) {
      if (--countdown == 0) {
#pragma GCC unroll 16
        for (int j = 0; j < NP; ++j) _mm_prefetch(pf + j * pf_stride, _MM_HINT_T1);
        pf += 64;
        countdown = pf_every;
      }
      __m512 b[NP];
#pragma GCC unroll 16
      for (int j = 0; j < NP; ++j) b[j] = load16<W>(B, j * bstride + k * kPanel);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(A[r * lda + k]);
#pragma GCC unroll 16
        for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
      }
    }
    store_accumulators<Avx512>(acc, C, ldc);
  }
};

}  // namespace

void gemm_panels_avx512(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                        int64_t p0, int64_t p1, float* C, int64_t ldc) {
  with_float_type(type, [&](auto w) {
    panel_gemm<Avx512Gemm<decltype(w)::value>>(A, lda, M, K, B_packed, p0, p1, C, ldc);
  });
}

}  // namespace detail
}  // namespace moe_onnx
