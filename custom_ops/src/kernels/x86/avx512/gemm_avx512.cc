// AVX-512 micro-kernels of gemm_panels; this file alone is compiled with -mavx512f
// -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c and is only called after a run-time check of the CPU.
//
// A 16-wide panel row is one zmm register, so a tile is rows x panels accumulators with no A
// register at all (the A element is broadcast from memory inside the FMA). 32 registers allow 12
// rows x 2 panels (24 accumulators + 2 panel rows). Each result element is one FMA chain over k in
// increasing order, as in the AVX2 kernels: the tiling never changes a result's bits.
#include <immintrin.h>

#include "gemm.h"
#include "row_dispatch.h"
#include "x86/avx512/simd_avx512.h"

namespace moe_onnx {
namespace detail {
namespace {

// K is split into equal blocks of at most kKBlock so the block of the two panels a tile reads (32 KB
// in fp32) stays in L1 while every row tile of the task passes over it; partial sums go through C
// between blocks (a float stored and loaded back is exact: the sum keeps its order and its bits).
constexpr int64_t kKBlock = 256;
// Row tiles are at most this tall (12 x 2 panels = 24 accumulators).
constexpr int64_t kMaxRows = 12;

// Panel row k of B (16 elements from element offset i) widened to fp32 (exact for fp16 and bf16; bf16
// rows are stored in bf16_lane's order).
template <FloatType W>
inline __m512 load16(const void* B, int64_t i) {
  if (W == FloatType::kF16) return Avx512::widen_f16(static_cast<const uint16_t*>(B) + i);
  if (W == FloatType::kBF16) return Avx512::widen_bf16_interleaved(static_cast<const uint16_t*>(B) + i);
  return _mm512_loadu_ps(static_cast<const float*>(B) + i);
}

// C[r, 16j + c] (+)= sum_k A[r, k] * panel_j[k][c] for r < MR, j < NP; panel j at B + j * bstride
// elements. The accumulator array is indexed only by constants after the unrolled loops, so it
// stays in registers.
//
// Prefetch: while the row tiles of a task compute on one K block (from L1 after the first tile),
// the next NP blocks (at pf + j * pf_stride bytes) are fetched into L2, a line of each every
// `pf_every` k steps, each tile taking its share; pf == nullptr prefetches nothing.
template <FloatType W, int MR, int NP>
inline void micro(const float* A, int64_t lda, int64_t K, const void* B, int64_t bstride, float* C, int64_t ldc,
                  bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) acc[r][j] = accumulate ? _mm512_loadu_ps(C + r * ldc + j * kPanel) : _mm512_setzero_ps();
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
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(C + r * ldc + j * kPanel, acc[r][j]);
}

// Rows [0, M) x NP panels from panel B on: K in blocks, rows in tiles of equal height (16 rows:
// 8 + 8, not 12 + 4: a short tile has too few FMA chains to hide the FMA latency).
template <FloatType W, int NP>
void panels(const float* A, int64_t lda, int64_t M, int64_t K, const void* B, float* C, int64_t ldc) {
  const int64_t stride = K * kPanel;  // elements per panel
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t kblocks = (K + kKBlock - 1) / kKBlock, kblock = (K + kblocks - 1) / kblocks;  // equal blocks
  for (int64_t k0 = 0; k0 < K; k0 += kblock) {
    const int64_t kb = K - k0 < kblock ? K - k0 : kblock;
    const void* Bk = panel_advance<W>(B, k0 * kPanel);
    // The next block of each panel follows its block, and after the last block the next NP panels
    // follow the last of these.
    const char* next = static_cast<const char*>(panel_advance<W>(Bk, kb * kPanel + (k0 + kb < K ? 0 : (NP - 1) * stride)));
    const int64_t lines = (kb * kPanel * panel_element_bytes<W>() + 63) / 64;
    const int64_t share = (lines + tiles - 1) / tiles;
    const int64_t every = kb / share > 0 ? kb / share : 1;
    const int64_t base = M / tiles, extra = M % tiles;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      const float* At = A + m * lda + k0;
      float* Ct = C + m * ldc;
      const char* pf = next + t * share * 64;
      const int64_t pfs = stride * panel_element_bytes<W>();
      const bool acc = k0 > 0;
      with_rows<kMaxRows>(rows, [&](auto r) {
        micro<W, decltype(r)::value, NP>(At, lda, kb, Bk, stride, Ct, ldc, acc, pf, pfs, every);
      });
      m += rows;
    }
  }
}

template <FloatType W>
void gemm(const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0, int64_t p1, float* C,
          int64_t ldc) {
  const int64_t stride = K * kPanel;  // elements per panel
  int64_t p = p0;
  // Decode: one or two rows stream four panels at once (four weight streams in flight, as in the
  // AVX2 kernels: eight measured 3-6% slower on Zen 4), whole K (each weight is read once).
  if (M == 1) {
    for (; p + 4 <= p1; p += 4)
      micro<W, 1, 4>(A, lda, K, panel_advance<W>(B_packed, p * stride), stride, C + (p - p0) * kPanel, ldc, false, nullptr, 0, 0);
  } else if (M == 2) {
    for (; p + 4 <= p1; p += 4)
      micro<W, 2, 4>(A, lda, K, panel_advance<W>(B_packed, p * stride), stride, C + (p - p0) * kPanel, ldc, false, nullptr, 0, 0);
  }
  for (; p + 2 <= p1; p += 2) panels<W, 2>(A, lda, M, K, panel_advance<W>(B_packed, p * stride), C + (p - p0) * kPanel, ldc);
  if (p < p1) panels<W, 1>(A, lda, M, K, panel_advance<W>(B_packed, p * stride), C + (p - p0) * kPanel, ldc);
}

}  // namespace

void gemm_panels_avx512(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                        int64_t p0, int64_t p1, float* C, int64_t ldc) {
  switch (type) {
    case FloatType::kF16: return gemm<FloatType::kF16>(A, lda, M, K, B_packed, p0, p1, C, ldc);
    case FloatType::kBF16: return gemm<FloatType::kBF16>(A, lda, M, K, B_packed, p0, p1, C, ldc);
    default: return gemm<FloatType::kF32>(A, lda, M, K, B_packed, p0, p1, C, ldc);
  }
}

}  // namespace detail
}  // namespace moe_onnx
