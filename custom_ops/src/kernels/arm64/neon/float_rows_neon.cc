// widen_row (float_rows_simd.h on 4 lanes) and narrow_row with Advanced SIMD (float_rows.h), the bits of
// core/float_convert.h's element forms. The hardware conversions (FCVTL, FCVTN: round to nearest even,
// subnormals kept, as Linux leaves FPCR) give those bits but for NaN: they quiet a signalling NaN and
// narrowing keeps the payload's top bits, where the element forms keep a widened payload as it is and
// narrow every NaN to the sign and 0x7e00; NaN lanes take the element forms' bits.
#include <arm_neon.h>

#include "arm64/neon/simd_neon.h"
#include "float_rows_simd.h"

namespace moe_onnx {
namespace detail {
namespace {

// float_to_half of 4 elements.
inline uint16x4_t narrow_f16(float32x4_t x) {
  const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(x));
  const uint32x4_t bits = vreinterpretq_u32_f32(x);
  const uint16x4_t nan = vmovn_u32(vcgtq_u32(vandq_u32(bits, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u)));
  const uint16x4_t nan_bits = vorr_u16(vmovn_u32(vshrq_n_u32(vandq_u32(bits, vdupq_n_u32(0x80000000u)), 16)),
                                       vdup_n_u16(0x7e00));
  return vbsl_u16(nan, nan_bits, h);
}

// float_to_bf16 of 4 elements: NaN keeps its top bits, quieted; the rest rounds to nearest even.
inline uint16x4_t narrow_bf16(float32x4_t f) {
  const uint32x4_t x = vreinterpretq_u32_f32(f);
  const uint32x4_t nan = vcgtq_u32(vandq_u32(x, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(x, 16), vdupq_n_u32(1));
  const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(x, vaddq_u32(vdupq_n_u32(0x7fffu), odd)), 16);
  const uint32x4_t quiet = vorrq_u32(vshrq_n_u32(x, 16), vdupq_n_u32(0x40u));
  return vmovn_u32(vbslq_u32(nan, quiet, rounded));
}

}  // namespace

void widen_row_neon(FloatType type, const void* src, float* dst, int64_t n) { widen_row_simd<Neon>(type, src, dst, n); }

void narrow_row_neon(FloatType type, const float* src, void* dst, int64_t n) {
  auto* d16 = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  if (type == FloatType::kF16) {
    for (; i + 4 <= n; i += 4) vst1_u16(d16 + i, narrow_f16(vld1q_f32(src + i)));
  } else if (type == FloatType::kBF16) {
    for (; i + 4 <= n; i += 4) vst1_u16(d16 + i, narrow_bf16(vld1q_f32(src + i)));
  }
  narrow_row_from(type, src, i, dst, n);
}

}  // namespace detail
}  // namespace moe_onnx
