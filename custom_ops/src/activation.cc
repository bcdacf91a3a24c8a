#include "activation.h"

#include <cmath>

#include "common.h"
#include "isa.h"
#include "gemm.h"

namespace moe_onnx {
namespace detail {

static inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

void gated_activation_portable(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  constexpr int64_t half = kPanel / 2;
  const bool clamp = act.form == GatedActivation::Form::kClampedSwiglu;
  const float alpha = act.alpha, limit = act.limit;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < panels; ++p) {
      const float* gu = C + r * ldc + p * kPanel;
      float* out = dst + r * ldd + p * half;
      for (int64_t l = 0; l < half; ++l) {
        float gate = gu[l], up = gu[half + l];
        if (bias) {
          gate += bias[p * kPanel + l];
          up += bias[p * kPanel + half + l];
        }
        if (clamp) {
          gate = gate > limit ? limit : gate;  // min(gate, limit), NaN stays NaN
          up = up < -limit ? -limit : (up > limit ? limit : up);
          out[l] = (up + 1.0f) * gate * sigmoid(alpha * gate);
        } else {
          out[l] = gate * sigmoid(alpha * gate) * up;
        }
      }
    }
}

}  // namespace detail

namespace {
using ActivationFn = void (*)(const GatedActivation&, const float*, int64_t, const float*, int64_t, int64_t, float*,
                              int64_t);

ActivationFn chosen() {
#if defined(MOE_ONNX_HAVE_AVX512)
  if (isa_at_least(IsaLevel::kAvx512)) return detail::gated_activation_avx512;
#endif
#if defined(MOE_ONNX_HAVE_AVX2)
  if (isa_at_least(IsaLevel::kAvx2)) return detail::gated_activation_avx2;
#endif
  return detail::gated_activation_portable;
}
}  // namespace

void GatedActivation::apply(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
                            int64_t ldd) const {
  static const ActivationFn fn = chosen();
  if (rows > 0 && panels > 0) fn(*this, C, ldc, bias, rows, panels, dst, ldd);
}

}  // namespace moe_onnx
