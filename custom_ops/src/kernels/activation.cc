#include "activation.h"

#include <cmath>

#include "gemm.h"
#include "isa.h"

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

namespace {
// Phi(z) = 0.5 * (1 + erf(z / sqrt 2)) through Abramowitz-Stegun 7.1.26 on |z|.
inline float normal_cdf(float z) {
  const float x = std::fabs(z) * kInvSqrt2;
  const float t = 1.0f / (1.0f + kErfP * x);
  float poly = kErfA[4];
  for (int i = 3; i >= 0; --i) poly = poly * t + kErfA[i];
  const float tail = 0.5f * (poly * t) * std::exp(-(x * x));  // Phi(-|z|)
  return z >= 0.0f ? 1.0f - tail : tail;
}

inline float pointwise(PointwiseActivation::Form form, float z) {
  using Form = PointwiseActivation::Form;
  switch (form) {
    case Form::kRelu: return z < 0.0f ? 0.0f : z;  // NaN stays NaN
    case Form::kRelu2: {
      const float r = z < 0.0f ? 0.0f : z;
      return r * r;
    }
    case Form::kGelu: return z * normal_cdf(z);
    case Form::kGeluTanh: return z * sigmoid(z * (kGeluTanhC3 * (z * z) + kGeluTanhC1));
    case Form::kSilu: return z * sigmoid(z);
    case Form::kIdentity: return z;
  }
  return z;
}
}  // namespace

void pointwise_activation_portable(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                                   int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  const int64_t columns = panels * kPanel;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c)
      dst[r * ldd + c] = pointwise(act.form, C[r * ldc + c] + (bias ? bias[c] : 0.0f));
}

}  // namespace detail

void GatedActivation::apply(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
                            int64_t ldd) const {
  if (rows > 0 && panels > 0) kernels().gated_activation(*this, C, ldc, bias, rows, panels, dst, ldd);
}

void PointwiseActivation::apply(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels,
                                float* dst, int64_t ldd) const {
  if (rows > 0 && panels > 0) kernels().pointwise_activation(*this, C, ldc, bias, rows, panels, dst, ldd);
}

}  // namespace moe_onnx
