// Advanced SIMD micro-kernels of gemm_panels (gemm.h); this folder's files need nothing beyond the
// AArch64 base (every AArch64 CPU has Advanced SIMD, the fused multiply-add and the fp16 conversions).
//
// A 16-wide panel row is four q registers. A tile is up to kMaxRows rows x one panel: 20 accumulators,
// the panel row (4) and one q register of each row's A (4 k), read by FMLA's lane index, 29 of the 32
// registers. Each result element is one FMA chain over k in increasing order (FMLA is fused), as in the
// x86 kernels: any tiling gives the same bits, and the x86 SIMD kernels' bits on the same data.
#include <arm_neon.h>

#include "arm64/lane_tile.h"
#include "gemm.h"
#include "panel_gemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// The driver's kernel (panel_gemm.h) and its lanes (arm64/lane_tile.h): FMLA by element on fp32 panel rows.
// K blocks of at most 256 steps (a panel's block, 16 KB in fp32, stays in L1); row tiles of up to 5 rows x
// one panel (20 accumulators, the panel row, one q register of A per row: 29 of the 32 registers); one row
// streams four panels at once (16 FMA chains, four weight streams in flight), two rows two.
template <FloatType W>
struct NeonGemm : FloatPanelSteps<W> {
  using ARegister = float32x4_t;
  using BRegister = float32x4_t;
  static constexpr int64_t kBlockSteps = 256, kBlockMultiple = 1;
  static constexpr int kMaxRows = 5, kPanels = 1, kOneRowPanels = 4, kTwoRowPanels = 2;
  static constexpr bool kPrefetch = true, kWholeGroups = false;

  // Panel row k of B (16 elements from element offset i) widened to fp32 (exact for fp16 and bf16):
  // b[j] holds columns 4j..4j+3. bf16 rows are interleaved (bf16_lane: columns 0, 8, 1, 9, ...): each
  // 32-bit lane of the row holds column c in its low half and c + 8 in its high half.
  static inline void load_b(const void* B, int64_t i, float32x4_t (&b)[4]) {
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

  static inline float32x4_t load_a(const float* p) { return vld1q_f32(p); }
  static inline float32x4_t load_a_one(const float* p) { return vdupq_n_f32(*p); }

  template <int L>
  static inline float32x4_t multiply_add(float32x4_t acc, float32x4_t b, float32x4_t a) {
    return vfmaq_laneq_f32(acc, b, a, L);
  }

  template <int MR, int NP>
  static void micro(const float* A, int64_t lda, int64_t K, const void* B, int64_t bstride, float* C, int64_t ldc,
                    bool accumulate, const char* pf, int64_t pf_stride, int64_t pf_every) {
    arm64::lane_tile<NeonGemm, MR, NP>(A, lda, K, B, bstride, C, ldc, accumulate, pf, pf_stride, pf_every);
  }
};

}  // namespace

void gemm_panels_neon(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                      int64_t p0, int64_t p1, float* C, int64_t ldc) {
  with_float_type(type, [&](auto w) {
    panel_gemm<NeonGemm<decltype(w)::value>>(A, lda, M, K, B_packed, p0, p1, C, ldc);
  });
}

}  // namespace detail
}  // namespace moe_onnx
