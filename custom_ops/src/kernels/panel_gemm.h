// The driver every SIMD GEMM on 16-column panels shares (gemm.h's fp32/fp16/bf16 panels, bf16_gemm.h's
// pair panels), around an ISA's micro-kernel: a call of one or two rows streams several panels at once
// over the whole K (each weight read once); any other call takes the panels a group at a time, K in equal
// blocks and C's rows in tiles of equal height (row_dispatch.h), the next block prefetched into L2 while
// the tiles compute on this one (without it the weights stream in only while the first tile runs and the
// memory sits idle during the others). Included only by the ISA units (x86/avx2, x86/avx512, arm64/neon,
// arm64/bf16): each instantiates it with its own Kernel, compiled with its own flags.
//
// A Kernel (a struct of constants and one static member template):
//   AElement, kStepA, kStepB, kStepBytes   its layout's steps (FloatPanelSteps, PairPanelSteps below)
//   kBlockSteps, kBlockMultiple    the most steps of a K block, and a multiple a block keeps (the unroll)
//   kMaxRows, kPanels              a tile's rows at most and its panels
//   kOneRowPanels, kTwoRowPanels   panels per tile of a one-row (two-row) call, 0: tiles as any call
//   kPrefetch                      whether the tiles prefetch the next block
//   micro<MR, NP>(A, lda, steps, B, bstride, C, ldc, accumulate, pf, pf_stride, pf_every): C[r, 16 j + c]
//       (+)= the sum over `steps` steps of A's rows r < MR (lda elements apart) times panel j < NP (at B +
//       j * bstride elements); where pf is not null, one 64-byte line of each of the NP next blocks (at
//       pf + j * pf_stride bytes) every pf_every steps. One chain per result element, steps in increasing
//       order: the tiling never changes a result's bits.
#pragma once

#include <cstdint>

#include "gemm.h"
#include "row_dispatch.h"

namespace moe_onnx::detail {

// A panel layout's k step for the driver: A's element type, and per step A's elements, B's elements and
// B's bytes. gemm.h's panels step one k (a panel row of 16 elements of W) ...
template <FloatType W>
struct FloatPanelSteps {
  using AElement = float;
  static constexpr int64_t kStepA = 1, kStepB = kPanel, kStepBytes = kPanel * panel_element_bytes<W>();
};
// ... bf16_gemm.h's pair panels two k (a pair row: 16 columns x 2 bf16) of A's bf16 rows.
struct PairPanelSteps {
  using AElement = uint16_t;
  static constexpr int64_t kStepA = 2, kStepB = 2 * kPanel, kStepBytes = 4 * kPanel;
};

// A micro-kernel's accumulators of C's rows r < MR, NV vectors of a SIMD mapping V (x86/avx2/simd_avx2.h,
// x86/avx512/simd_avx512.h) per row from its start: C's values where `accumulate`, else zeros; and back.
template <class V, int MR, int NV>
inline void load_accumulators(typename V::F (&acc)[MR][NV], const float* C, int64_t ldc, bool accumulate) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[r][j] = accumulate ? V::load(C + r * ldc + j * V::kLanes) : V::zero();
}
template <class V, int MR, int NV>
inline void store_accumulators(const typename V::F (&acc)[MR][NV], float* C, int64_t ldc) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) V::store(C + r * ldc + j * V::kLanes, acc[r][j]);
}

// Kernel::micro as a function of its own, where inlining it into the driver's loops makes its k loop worse:
// a decode tile (one or two rows over several panels, whole K) always; a row tile on x86-64 only
// (kRowTileCall). x86-64 has 16 general registers: inlined, a 6-row tile's loop ran out of them under
// GCC 12 and reloaded a loop-invariant pointer from the stack at every k step (bf16 weights on AVX2, most
// tiles on AVX-512); aarch64 has 31, and its inlined row tiles are as tight as its kernels' own
// (benchmarks/arm64_loops.py).
#if defined(__x86_64__)
constexpr bool kRowTileCall = true;
#else
constexpr bool kRowTileCall = false;
#endif

template <class Kernel, int MR, int NP>
[[gnu::noinline]] void tile_call(const typename Kernel::AElement* A, int64_t lda, int64_t steps, const void* B,
                                 int64_t bstride, float* C, int64_t ldc, bool accumulate, const char* pf,
                                 int64_t pf_stride, int64_t pf_every) {
  Kernel::template micro<MR, NP>(A, lda, steps, B, bstride, C, ldc, accumulate, pf, pf_stride, pf_every);
}

// Rows [0, M) x NP panels from B on, each `steps` steps long.
template <class Kernel, int NP>
inline void panel_tiles(const typename Kernel::AElement* A, int64_t lda, int64_t M, int64_t steps, const void* B,
                        float* C, int64_t ldc) {
  const int64_t bstride = steps * Kernel::kStepB, panel_bytes = steps * Kernel::kStepBytes;
  equal_blocks(steps, Kernel::kBlockSteps, Kernel::kBlockMultiple, [&](int64_t s0, int64_t sb) {
    const char* Bs = static_cast<const char*>(B) + s0 * Kernel::kStepBytes;
    // The next block of each panel follows its block; after the last block, the next NP panels follow
    // the last of these. Each tile prefetches its share of the lines.
    const char* next = Bs + sb * Kernel::kStepBytes + (s0 + sb < steps ? 0 : (NP - 1) * panel_bytes);
    const int64_t lines = (sb * Kernel::kStepBytes + 63) / 64;
    row_tiles<Kernel::kMaxRows>(M, [&](auto rows, int64_t m, int64_t t, int64_t tiles) {
      const int64_t share = (lines + tiles - 1) / tiles, every = sb / share > 0 ? sb / share : 1;
      constexpr int MR = decltype(rows)::value;
      const char* pf = Kernel::kPrefetch ? next + t * share * 64 : nullptr;
      if constexpr (kRowTileCall)
        tile_call<Kernel, MR, NP>(A + m * lda + s0 * Kernel::kStepA, lda, sb, Bs, bstride, C + m * ldc, ldc, s0 > 0, pf,
                                  panel_bytes, every);
      else
        Kernel::template micro<MR, NP>(A + m * lda + s0 * Kernel::kStepA, lda, sb, Bs, bstride, C + m * ldc, ldc,
                                       s0 > 0, pf, panel_bytes, every);
    });
  });
}

// C[m, 16 (p - p0) + c] = the sum over `steps` steps of A's row m times panel p, for m < M, p in [p0, p1),
// c < 16 (M > 0, steps > 0, p1 > p0).
template <class Kernel>
void panel_gemm(const typename Kernel::AElement* A, int64_t lda, int64_t M, int64_t steps, const void* B_packed,
                int64_t p0, int64_t p1, float* C, int64_t ldc) {
  constexpr int kOne = Kernel::kOneRowPanels, kTwo = Kernel::kTwoRowPanels, kNP = Kernel::kPanels;
  const int64_t bstride = steps * Kernel::kStepB, panel_bytes = steps * Kernel::kStepBytes;
  const auto panel = [&](int64_t p) { return static_cast<const char*>(B_packed) + p * panel_bytes; };
  int64_t p = p0;
  if constexpr (kOne > 0) {
    if (M == 1)
      for (; p + kOne <= p1; p += kOne)
        tile_call<Kernel, 1, kOne>(A, lda, steps, panel(p), bstride, C + (p - p0) * kPanel, ldc, false, nullptr, 0, 0);
  }
  if constexpr (kTwo > 0) {
    if (M == 2)
      for (; p + kTwo <= p1; p += kTwo)
        tile_call<Kernel, 2, kTwo>(A, lda, steps, panel(p), bstride, C + (p - p0) * kPanel, ldc, false, nullptr, 0, 0);
  }
  for (; p + kNP <= p1; p += kNP) panel_tiles<Kernel, kNP>(A, lda, M, steps, panel(p), C + (p - p0) * kPanel, ldc);
  if constexpr (kNP > 1) {
    for (; p < p1; ++p) panel_tiles<Kernel, 1>(A, lda, M, steps, panel(p), C + (p - p0) * kPanel, ldc);
  }
}

}  // namespace moe_onnx::detail
