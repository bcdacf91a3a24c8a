// The Advanced SIMD side of what the kernels write once over a vector mapping (../../activation_simd.h,
// ../../float_rows_simd.h): fp32 and int32 vectors of 4 lanes with the names of the x86 mappings
// (x86/avx2/simd_avx2.h, x86/avx512/simd_avx512.h) and their results, so that the same operations in the
// same order give the AVX2 and AVX-512 kernels' bits. Where NEON's instruction differs from x86's, the
// mapping takes x86's result: min and max return b unless a is less (greater), as minps/maxps do for NaN
// and equal zeros (FMIN/FMAX do not); fp16 NaNs widen to float_convert.h's bits (FCVTL quiets them).
// truncate's FCVTZS gives 0 for a NaN lane where cvttps gives INT_MIN: the activations' results are NaN
// there either way. Included only by this folder's files (Advanced SIMD is in every AArch64 CPU).
#pragma once

#include <arm_neon.h>

#include <cstdint>

namespace moe_onnx::detail {

struct Neon {
  static constexpr int kLanes = 4;
  using F = float32x4_t;  // kLanes fp32
  using I = int32x4_t;    // kLanes int32
  using Mask = uint32x4_t;  // a comparison's result: every bit of a lane set where true

  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F v) { vst1q_f32(p, v); }
  static F set1(float x) { return vdupq_n_f32(x); }
  static F zero() { return vdupq_n_f32(0.0f); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  // min and max return b where either is NaN (x86's)
  static F min(F a, F b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
  static F max(F a, F b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }   // a * b + c, rounded once
  static F fnmadd(F a, F b, F c) { return vfmsq_f32(c, a, b); }  // c - a * b, rounded once
  static F floor(F a) { return vrndmq_f32(a); }
  static F abs(F a) { return vabsq_f32(a); }
  static Mask greater(F a, F b) { return vcgtq_f32(a, b); }
  static Mask greater_equal(F a, F b) { return vcgeq_f32(a, b); }
  // where m: if_true, else if_false
  static F select(Mask m, F if_false, F if_true) { return vbslq_f32(m, if_true, if_false); }

  static I truncate(F a) { return vcvtq_s32_f32(a); }
  static I set1_i32(int32_t x) { return vdupq_n_s32(x); }
  static I add_i32(I a, I b) { return vaddq_s32(a, b); }
  static I min_i32(I a, I b) { return vminq_s32(a, b); }
  static I max_i32(I a, I b) { return vmaxq_s32(a, b); }
  template <int kBits>
  static I shift_left(I a) { return vshlq_n_s32(a, kBits); }
  static F as_float(I a) { return vreinterpretq_f32_s32(a); }

  // kLanes fp16 (bits) from p, as fp32: FCVTL, but a NaN keeps its payload (half_to_float's bits: sign,
  // 0x7f800000, the mantissa shifted up 13)
  static F widen_f16(const uint16_t* p) {
    const uint16x4_t h = vld1_u16(p);
    const float32x4_t value = vcvt_f32_f16(vreinterpret_f16_u16(h));
    const uint32x4_t bits = vshll_n_u16(h, 16);  // the half's bits in the top 16
    const uint32x4_t nan = vcgtq_u32(vandq_u32(bits, vdupq_n_u32(0x7fff0000u)), vdupq_n_u32(0x7c000000u));
    const uint32x4_t nan_bits = vorrq_u32(vandq_u32(bits, vdupq_n_u32(0x80000000u)),
                                          vorrq_u32(vdupq_n_u32(0x7f800000u),
                                                    vshrq_n_u32(vandq_u32(bits, vdupq_n_u32(0x03ff0000u)), 3)));
    return vbslq_f32(nan, vreinterpretq_f32_u32(nan_bits), value);
  }
  // kLanes bf16 (bits) from p, as fp32
  static F widen_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
};

}  // namespace moe_onnx::detail
