// Advanced SIMD micro-kernels of gemm_panels (gemm.h); this folder's files need nothing beyond the
// AArch64 base (every AArch64 CPU has Advanced SIMD, the fused multiply-add and the fp16 conversions).
//
// A 16-wide panel row is four q registers. A tile is up to kMaxRows rows x one panel: 20 accumulators,
// the panel row (4) and one q register of each row's A (4 k), read by FMLA's lane index, 29 of the 32
// registers. Each result element is one FMA chain over k in increasing order (FMLA is fused), as in the
// x86 kernels: any tiling gives the same bits, and the x86 SIMD kernels' bits on the same data.
#include <arm_neon.h>

#include "gemm.h"
#include "row_dispatch.h"

namespace moe_onnx {
namespace detail {
namespace {

// K is split into equal blocks of at most kKBlock so the panel's block (16 KB in fp32) stays in L1 while
// every row tile of the task passes over it; partial sums go through C between blocks (a float stored
// and loaded back is exact: the sum keeps its order and its bits).
constexpr int64_t kKBlock = 256;
constexpr int64_t kMaxRows = 5;

// Panel row k of B (16 elements from element offset i) widened to fp32 (exact for fp16 and bf16):
// b[j] holds columns 4j..4j+3. bf16 rows are interleaved (bf16_lane: columns 0, 8, 1, 9, ...): each
// 32-bit lane of the row holds column c in its low half and c + 8 in its high half.
template <FloatType W>
inline void load16(const void* B, int64_t i, float32x4_t (&b)[4]) {
  if constexpr (W == FloatType::kF16) {
    const auto* p = reinterpret_cast<const float16_t*>(static_cast<const uint16_t*>(B) + i);
    const float16x8_t lo = vld1q_f16(p), hi = vld1q_f16(p + 8);
    b[0] = vcvt_f32_f16(vget_low_f16(lo));
    b[1] = vcvt_high_f32_f16(lo);
    b[2] = vcvt_f32_f16(vget_low_f16(hi));
    b[3] = vcvt_high_f32_f16(hi);
  } else if constexpr (W == FloatType::kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(B) + i;
    const uint32x4_t lo = vreinterpretq_u32_u16(vld1q_u16(p)), hi = vreinterpretq_u32_u16(vld1q_u16(p + 8));
    const uint32x4_t high_half = vdupq_n_u32(0xffff0000u);
    b[0] = vreinterpretq_f32_u32(vshlq_n_u32(lo, 16));
    b[1] = vreinterpretq_f32_u32(vshlq_n_u32(hi, 16));
    b[2] = vreinterpretq_f32_u32(vandq_u32(lo, high_half));
    b[3] = vreinterpretq_f32_u32(vandq_u32(hi, high_half));
  } else {
    const float* p = static_cast<const float*>(B) + i;
    b[0] = vld1q_f32(p);
    b[1] = vld1q_f32(p + 4);
    b[2] = vld1q_f32(p + 8);
    b[3] = vld1q_f32(p + 12);
  }
}

// The accumulators of MR rows x NP panels and the step that adds one k to them.
template <FloatType W, int MR, int NP>
struct Tile {
  float32x4_t acc[MR][NP][4];

  // k-th panel rows of the NP panels (panel j at B + j * bstride elements) times lane L of a[r].
  template <int L>
  inline void step(const float32x4_t (&a)[MR], const void* B, int64_t bstride, int64_t k) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      float32x4_t b[4];
      load16<W>(B, j * bstride + k * kPanel, b);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[r][j][q] = vfmaq_laneq_f32(acc[r][j][q], b[q], a[r], L);
    }
  }
};

// C[r, 16j + c] (+)= sum_k A[r, k] * panel_j[k][c] for r < MR, j < NP; panel j at B + j * bstride
// elements. A is read 4 k per row at a time (the tail k one by one, in lane 0).
//
// Prefetch: while the row tiles of a task compute on one K block (from L1 after the first tile), the
// next NP blocks (at pf + j * pf_stride bytes) are fetched into L2, a line of each every `pf_every` k
// steps, each tile taking its share; pf == nullptr prefetches nothing.
template <FloatType W, int MR, int NP>
inline void micro(const float* A, int64_t lda, int64_t K, const void* B, int64_t bstride, float* C, int64_t ldc,
                  bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
  Tile<W, MR, NP> t;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
        t.acc[r][j][q] = accumulate ? vld1q_f32(C + r * ldc + j * kPanel + 4 * q) : vdupq_n_f32(0.0f);
  int64_t countdown = pf ? pf_every : K + 1;
  auto prefetch = [&](int64_t steps) {
    countdown -= steps;
    while (countdown <= 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) __builtin_prefetch(pf + j * pf_stride, 0, 2);
      pf += 64;
      countdown += pf_every;
    }
  };
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    if (pf) prefetch(4);
    float32x4_t a[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) a[r] = vld1q_f32(A + r * lda + k);
    t.template step<0>(a, B, bstride, k);
    t.template step<1>(a, B, bstride, k + 1);
    t.template step<2>(a, B, bstride, k + 2);
    t.template step<3>(a, B, bstride, k + 3);
  }
  for (; k < K; ++k) {
    float32x4_t a[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) a[r] = vdupq_n_f32(A[r * lda + k]);
    t.template step<0>(a, B, bstride, k);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) vst1q_f32(C + r * ldc + j * kPanel + 4 * q, t.acc[r][j][q]);
}

// Rows [0, M) x one panel: K in blocks, rows in tiles of equal height (11 rows: 4 + 4 + 3, not
// 5 + 5 + 1: a short tile has too few FMA chains to hide the FMA latency).
template <FloatType W>
void panel(const float* A, int64_t lda, int64_t M, int64_t K, const void* B, float* C, int64_t ldc) {
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t kblocks = (K + kKBlock - 1) / kKBlock, kblock = (K + kblocks - 1) / kblocks;  // equal blocks
  const int64_t base = M / tiles, extra = M % tiles;
  for (int64_t k0 = 0; k0 < K; k0 += kblock) {
    const int64_t kb = K - k0 < kblock ? K - k0 : kblock;
    const void* Bk = panel_advance<W>(B, k0 * kPanel);
    // The next block follows this one (the next K block, or the next panel's first).
    const char* next = static_cast<const char*>(panel_advance<W>(Bk, kb * kPanel));
    const int64_t lines = (kb * kPanel * panel_element_bytes<W>() + 63) / 64;
    const int64_t share = (lines + tiles - 1) / tiles;
    const int64_t every = kb / share > 0 ? kb / share : 1;
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      const float* At = A + m * lda + k0;
      float* Ct = C + m * ldc;
      const char* pf = next + t * share * 64;
      const bool acc = k0 > 0;
      with_rows<kMaxRows>(rows, [&](auto r) {
        micro<W, decltype(r)::value, 1>(At, lda, kb, Bk, 0, Ct, ldc, acc, pf, 0, every);
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
  // Decode: one row streams four panels at once (16 FMA chains, four weight streams in flight), two
  // rows two panels, whole K (each weight is read once).
  if (M == 1) {
    for (; p + 4 <= p1; p += 4)
      micro<W, 1, 4>(A, lda, K, panel_advance<W>(B_packed, p * stride), stride, C + (p - p0) * kPanel, ldc, false, nullptr, 0,
                     0);
  } else if (M == 2) {
    for (; p + 2 <= p1; p += 2)
      micro<W, 2, 2>(A, lda, K, panel_advance<W>(B_packed, p * stride), stride, C + (p - p0) * kPanel, ldc, false, nullptr, 0,
                     0);
  }
  for (; p < p1; ++p) panel<W>(A, lda, M, K, panel_advance<W>(B_packed, p * stride), C + (p - p0) * kPanel, ldc);
}

}  // namespace

void gemm_panels_neon(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                      int64_t p0, int64_t p1, float* C, int64_t ldc) {
  switch (type) {
    case FloatType::kF16: return gemm<FloatType::kF16>(A, lda, M, K, B_packed, p0, p1, C, ldc);
    case FloatType::kBF16: return gemm<FloatType::kBF16>(A, lda, M, K, B_packed, p0, p1, C, ldc);
    default: return gemm<FloatType::kF32>(A, lda, M, K, B_packed, p0, p1, C, ldc);
  }
}

}  // namespace detail
}  // namespace moe_onnx
