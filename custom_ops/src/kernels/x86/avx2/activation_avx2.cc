// The activations (activation.h) on AVX2 + FMA: activation_simd.h on 8 lanes, one gate/up panel at a
// time (its 8 gate columns in one ymm, its 8 up columns in another). This file alone is compiled with
// -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
#include "activation_simd.h"
#include "x86/avx2/simd_avx2.h"

namespace moe_onnx {
namespace detail {

void pointwise_activation_avx2(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  with_pointwise_form(act.form, [&](auto form) {
    pointwise_rows<Avx2, decltype(form)::value>(C, ldc, bias, rows, panels, dst, ldd);
  });
}

void gated_activation_avx2(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                           int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  const bool clamp = act.form == GatedActivation::Form::kClampedSwiglu;
  const __m256 va = _mm256_set1_ps(act.alpha), vb = _mm256_set1_ps(act.limit), vnb = _mm256_set1_ps(-act.limit);
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < panels; ++p) {
      const float* gu = C + r * ldc + p * kPanel;
      __m256 gate = _mm256_loadu_ps(gu), up = _mm256_loadu_ps(gu + 8);
      if (bias) {
        gate = _mm256_add_ps(gate, _mm256_loadu_ps(bias + p * kPanel));
        up = _mm256_add_ps(up, _mm256_loadu_ps(bias + p * kPanel + 8));
      }
      _mm256_storeu_ps(dst + r * ldd + p * (kPanel / 2), gated_lanes<Avx2>(gate, up, clamp, va, vb, vnb, one));
    }
}

}  // namespace detail
}  // namespace moe_onnx
