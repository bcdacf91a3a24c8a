// The activations (activation.h) on Advanced SIMD: activation_simd.h on 4 lanes (simd_neon.h), the same
// operations in the same order as the AVX2 and AVX-512 kernels, so the same bits; a gate/up panel's 8
// gate and 8 up columns in two steps of 4.
#include "activation_simd.h"
#include "arm64/neon/simd_neon.h"

namespace moe_onnx {
namespace detail {

void pointwise_activation_neon(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  with_pointwise_form(act.form, [&](auto form) {
    pointwise_rows<Neon, decltype(form)::value>(C, ldc, bias, rows, panels, dst, ldd);
  });
}

void gated_activation_neon(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                           int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  const bool clamp = act.form == GatedActivation::Form::kClampedSwiglu;
  const Neon::F va = Neon::set1(act.alpha), vb = Neon::set1(act.limit), vnb = Neon::set1(-act.limit);
  const Neon::F one = Neon::set1(1.0f);
  constexpr int64_t kHalf = kPanel / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t l = 0; l < kHalf; l += Neon::kLanes) {  // lanes l.. of the gate half and of the up half
        const float* gu = C + r * ldc + p * kPanel + l;
        Neon::F gate = Neon::load(gu), up = Neon::load(gu + kHalf);
        if (bias) {
          gate = Neon::add(gate, Neon::load(bias + p * kPanel + l));
          up = Neon::add(up, Neon::load(bias + p * kPanel + kHalf + l));
        }
        Neon::store(dst + r * ldd + p * kHalf + l, gated_lanes<Neon>(gate, up, clamp, va, vb, vnb, one));
      }
}

}  // namespace detail
}  // namespace moe_onnx
