// Advanced SIMD activations (activation.h): the x86 SIMD kernels' operations in the same order on 4
// lanes, so the same bits on the same data (their min and max too: x86's return the second operand
// when the first is not less, or greater, which NEON's FMIN/FMAX do not for NaN and signed zeros).
#include <arm_neon.h>

#include "activation.h"
#include "gemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// x86's minps / maxps: a where a < b (a > b), else b (NaN in either, or equal zeros: b).
inline float32x4_t min_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
inline float32x4_t max_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
inline float32x4_t zero() { return vdupq_n_f32(0.0f); }

// exp(x), the x86 kernels' exp8/exp16 (Cephes' expf; +inf above 88.72, a tiny normal value below -87.3,
// NaN stays NaN). FCVTZS gives 0 for a NaN lane where cvttps gives INT_MIN: y is NaN there either way.
inline float32x4_t exp4(float32x4_t x) {
  const float32x4_t hi = vdupq_n_f32(88.7228394f), lo = vdupq_n_f32(-87.3365447f);
  const uint32x4_t over = vcgtq_f32(x, hi);
  float32x4_t xc = max_x86(lo, min_x86(hi, x));
  float32x4_t fx = vfmaq_f32(vdupq_n_f32(0.5f), xc, vdupq_n_f32(1.44269504088896341f));
  fx = vrndmq_f32(fx);
  xc = vfmsq_f32(xc, fx, vdupq_n_f32(0.693359375f));
  xc = vfmsq_f32(xc, fx, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t y = vdupq_n_f32(1.9875691500E-4f);
  y = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), y, xc);
  y = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), y, xc);
  y = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), y, xc);
  y = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), y, xc);
  y = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), y, xc);
  const float32x4_t x2 = vmulq_f32(xc, xc);
  y = vfmaq_f32(vaddq_f32(xc, vdupq_n_f32(1.0f)), y, x2);
  const int32x4_t n = vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127));
  const int32x4_t n_hi = vminq_s32(vmaxq_s32(n, vdupq_n_s32(1)), vdupq_n_s32(254));
  y = vmulq_f32(y, vreinterpretq_f32_s32(vshlq_n_s32(n_hi, 23)));
  return vbslq_f32(over, vdupq_n_f32(__builtin_inff()), y);
}

inline float32x4_t sigmoid4(float32x4_t z) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  return vdivq_f32(one, vaddq_f32(one, exp4(vsubq_f32(zero(), z))));
}

// Phi(z) as the x86 kernels' normal_cdf8/16.
inline float32x4_t normal_cdf4(float32x4_t z) {
  const float32x4_t x = vmulq_f32(vabsq_f32(z), vdupq_n_f32(kInvSqrt2));
  const float32x4_t one = vdupq_n_f32(1.0f);
  const float32x4_t t = vdivq_f32(one, vfmaq_f32(one, vdupq_n_f32(kErfP), x));
  float32x4_t poly = vdupq_n_f32(kErfA[4]);
  for (int i = 3; i >= 0; --i) poly = vfmaq_f32(vdupq_n_f32(kErfA[i]), poly, t);
  const float32x4_t e = exp4(vsubq_f32(zero(), vmulq_f32(x, x)));
  const float32x4_t tail = vmulq_f32(vmulq_f32(vdupq_n_f32(0.5f), vmulq_f32(poly, t)), e);
  return vbslq_f32(vcgeq_f32(z, zero()), vsubq_f32(one, tail), tail);
}

// f(z) of one pointwise form on 4 lanes (activation.h); NaN stays NaN.
template <PointwiseActivation::Form F>
inline float32x4_t pointwise4(float32x4_t z) {
  using Form = PointwiseActivation::Form;
  if constexpr (F == Form::kRelu) return max_x86(zero(), z);
  if constexpr (F == Form::kRelu2) {
    const float32x4_t r = max_x86(zero(), z);
    return vmulq_f32(r, r);
  }
  if constexpr (F == Form::kGelu) return vmulq_f32(z, normal_cdf4(z));
  if constexpr (F == Form::kGeluTanh) {
    const float32x4_t s = vfmaq_f32(vdupq_n_f32(kGeluTanhC1), vdupq_n_f32(kGeluTanhC3), vmulq_f32(z, z));
    return vmulq_f32(z, sigmoid4(vmulq_f32(z, s)));
  }
  if constexpr (F == Form::kSilu) return vmulq_f32(z, sigmoid4(z));
  return z;
}

template <PointwiseActivation::Form F>
void pointwise_rows(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
                    int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < panels * kPanel; c += 4) {
      float32x4_t z = vld1q_f32(C + r * ldc + c);
      if (bias) z = vaddq_f32(z, vld1q_f32(bias + c));
      vst1q_f32(dst + r * ldd + c, pointwise4<F>(z));
    }
}

}  // namespace

void pointwise_activation_neon(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  with_pointwise_form(act.form, [&](auto form) {
    pointwise_rows<decltype(form)::value>(C, ldc, bias, rows, panels, dst, ldd);
  });
}

void gated_activation_neon(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                           int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  const bool clamp = act.form == GatedActivation::Form::kClampedSwiglu;
  const float32x4_t va = vdupq_n_f32(act.alpha), vb = vdupq_n_f32(act.limit), vnb = vdupq_n_f32(-act.limit);
  const float32x4_t one = vdupq_n_f32(1.0f);
  constexpr int64_t kHalf = kPanel / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t l = 0; l < kHalf; l += 4) {  // lanes l..l+3 of the gate half and of the up half
        const float* gu = C + r * ldc + p * kPanel + l;
        float32x4_t gate = vld1q_f32(gu), up = vld1q_f32(gu + kHalf);
        if (bias) {
          gate = vaddq_f32(gate, vld1q_f32(bias + p * kPanel + l));
          up = vaddq_f32(up, vld1q_f32(bias + p * kPanel + kHalf + l));
        }
        float32x4_t out;
        if (clamp) {
          gate = min_x86(vb, gate);               // min(gate, limit); NaN gate stays NaN
          up = min_x86(vb, max_x86(vnb, up));     // clamp(up, -limit, limit); NaN stays NaN
          out = vmulq_f32(vmulq_f32(vaddq_f32(up, one), gate), sigmoid4(vmulq_f32(va, gate)));
        } else {
          out = vmulq_f32(vmulq_f32(gate, sigmoid4(vmulq_f32(va, gate))), up);
        }
        vst1q_f32(dst + r * ldd + p * kHalf + l, out);
      }
}

}  // namespace detail
}  // namespace moe_onnx
