// The micro-kernel the aarch64 panel GEMMs share (panel_gemm.h's `micro`): arm64/neon/gemm_neon.cc (FMLA by
// element on fp32 panel rows) and arm64/bf16/bf16_gemm_bfdot.cc (BFDOT by element on pair rows). A tile is
// MR rows x NP panels of 16 columns, four q registers of fp32 accumulators per row and panel; A is read one
// q register per row (4 k steps), each step multiplying the panels' rows by one lane of it. Included only by
// those files: each instantiates it with its own Lanes, compiled with its own flags.
//
// Lanes (a struct of static members):
//   AElement, ARegister      A's element type and the q register of 4 of its steps
//   BRegister                the q register of a quarter of a panel's step row
//   kStepA, kStepB           A's and B's elements per step
//   kWholeGroups             true where a call's steps are always a multiple of 4 (no tail)
//   load_a(p), load_a_one(p) the 4 steps at p; the one step at p in lane 0 (the tail)
//   load_b(B, i, b)          the step row from element i of B (B's element type) in its four quarters
//   multiply_add<L>(acc, b, a)  acc plus b times lane L of a, per the instruction's own rounding
#pragma once

#include <arm_neon.h>

#include <cstdint>

#include "gemm.h"

namespace moe_onnx::detail::arm64 {

template <class Lanes, int MR, int NP>
struct LaneTile {
  float32x4_t acc[MR][NP][4];

  // Step s of the NP panels (panel j at B + j * bstride elements) times lane L of a[r].
  template <int L>
  inline void step(const typename Lanes::ARegister (&a)[MR], const void* B, int64_t bstride, int64_t s) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      typename Lanes::BRegister b[4];
      Lanes::load_b(B, j * bstride + s * Lanes::kStepB, b);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[r][j][q] = Lanes::template multiply_add<L>(acc[r][j][q], b[q], a[r]);
    }
  }
};

// C[r, 16 j + c] (+)= the sum over `steps` steps of A's rows r < MR (lda elements apart) times panel j < NP
// (at B + j * bstride elements). Where pf is not null, one 64-byte line of each of the NP next blocks (at pf +
// j * pf_stride bytes) every pf_every steps, counted per group of 4 steps.
template <class Lanes, int MR, int NP>
inline void lane_tile(const typename Lanes::AElement* A, int64_t lda, int64_t steps, const void* B, int64_t bstride,
                      float* C, int64_t ldc, bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
  LaneTile<Lanes, MR, NP> t;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
        t.acc[r][j][q] = accumulate ? vld1q_f32(C + r * ldc + j * kPanel + 4 * q) : vdupq_n_f32(0.0f);
  int64_t countdown = pf ? pf_every : steps + 1;
  auto prefetch = [&](int64_t done) {
    countdown -= done;
    while (countdown <= 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) __builtin_prefetch(pf + j * pf_stride, 0, 2);
      pf += 64;
      countdown += pf_every;
    }
  };
  int64_t s = 0;
  for (; s + 4 <= steps; s += 4) {
    if (pf) prefetch(4);
    typename Lanes::ARegister a[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) a[r] = Lanes::load_a(A + r * lda + s * Lanes::kStepA);
    t.template step<0>(a, B, bstride, s);
    t.template step<1>(a, B, bstride, s + 1);
    t.template step<2>(a, B, bstride, s + 2);
    t.template step<3>(a, B, bstride, s + 3);
  }
  if constexpr (!Lanes::kWholeGroups) {
    for (; s < steps; ++s) {
      typename Lanes::ARegister a[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) a[r] = Lanes::load_a_one(A + r * lda + s * Lanes::kStepA);
      t.template step<0>(a, B, bstride, s);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) vst1q_f32(C + r * ldc + j * kPanel + 4 * q, t.acc[r][j][q]);
}

}  // namespace moe_onnx::detail::arm64
