// The activations of MOE's expert types (moe_onnx/ops/moe.py), applied as the epilogue of the first
// GEMM: the gated ones (SwiGLU) on results laid out as gate/up panels, 8 gate columns then the 8
// matching up columns (moe.cc packs the weights so); GEMM2_ACT's pointwise ones on plain panels.
// AVX-512, AVX2/FMA, NEON and portable kernels: the ISA table's gated_activation and pointwise_activation
// slots (isa.h); the SIMD ones share one algorithm (the same operations in the same order: the same bits).
#pragma once

#include <cstdint>
#include <type_traits>

#include "op_choices.h"

namespace moe_onnx {

// One expert type's activation and its parameters.
struct GatedActivation {
  enum class Form {
    kClampedSwiglu,  // GEMM2_BIAS_SWIGLU_CLAMP (GPT-OSS)
    kSwiglu,         // GEMM3_SWIGLU
  };
  Form form = Form::kSwiglu;
  float alpha = 1.0f;  // the sigmoid's slope: sigmoid(alpha * gate)
  float limit = 0.0f;  // kClampedSwiglu: gate <= limit, -limit <= up <= limit

  // For r < rows, p < panels, l < 8, with g = C[r, 16p + l] + bias[16p + l] and
  // u = C[r, 16p + 8 + l] + bias[16p + 8 + l] (bias may be null: 0),
  //   kClampedSwiglu: g = min(g, limit); u = clamp(u, -limit, limit); out = (u + 1) * g * sigmoid(alpha * g)
  //   kSwiglu:        out = g * sigmoid(alpha * g) * u
  // written to dst[r * ldd + 8p + l]. NaN propagates.
  void apply(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
             int64_t ldd) const;
};

// GEMM2_ACT's activation (MOE's `activation` attribute, whose values are the forms):
//   kRelu      max(z, 0)
//   kRelu2     max(z, 0)^2 (Nemotron-H)
//   kGelu      z * Phi(z), Phi the normal CDF through erf (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7)
//   kGeluTanh  0.5 * z * (1 + tanh(sqrt(2 / pi) * (z + 0.044715 z^3))) = z * sigmoid(2 * that argument)
//   kSilu      z * sigmoid(z)
//   kIdentity  z
struct PointwiseActivation {
  using Form = Activation;
  Form form = Form::kIdentity;

  // For r < rows, c < 16 * panels, with z = C[r, c] + bias[c] (bias may be null: 0):
  // dst[r * ldd + c] = f(z). NaN propagates.
  void apply(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
             int64_t ldd) const;
};

namespace detail {
// One implementation of PointwiseActivation::apply / GatedActivation::apply per ISA level (the
// table's slots), arguments as there (rows > 0, panels > 0).
using PointwiseKernel = void(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                             int64_t rows, int64_t panels, float* dst, int64_t ldd);
using GatedKernel = void(const GatedActivation& act, const float* C, int64_t ldc, const float* bias, int64_t rows,
                         int64_t panels, float* dst, int64_t ldd);

PointwiseKernel pointwise_activation_portable;
#if defined(MOE_ONNX_HAVE_AVX2)
PointwiseKernel pointwise_activation_avx2;
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
PointwiseKernel pointwise_activation_avx512;
#endif
#if defined(MOE_ONNX_HAVE_NEON)
PointwiseKernel pointwise_activation_neon;
#endif
// Calls body(std::integral_constant<Form, form>{}): the SIMD files instantiate their row loop per form.
template <class Body>
void with_pointwise_form(PointwiseActivation::Form form, Body&& body) {
  using Form = PointwiseActivation::Form;
  switch (form) {
    case Form::kRelu: return body(std::integral_constant<Form, Form::kRelu>{});
    case Form::kRelu2: return body(std::integral_constant<Form, Form::kRelu2>{});
    case Form::kGelu: return body(std::integral_constant<Form, Form::kGelu>{});
    case Form::kGeluTanh: return body(std::integral_constant<Form, Form::kGeluTanh>{});
    case Form::kSilu: return body(std::integral_constant<Form, Form::kSilu>{});
    case Form::kIdentity: return body(std::integral_constant<Form, Form::kIdentity>{});
  }
}
// The constants of the pointwise forms, shared by the three implementations.
constexpr float kGeluTanhC1 = 1.5957691216057308f;            // 2 * sqrt(2 / pi)
constexpr float kGeluTanhC3 = 1.5957691216057308f * 0.044715f;  // 2 * sqrt(2 / pi) * 0.044715
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kErfP = 0.3275911f;  // Abramowitz-Stegun 7.1.26: erf(x) = 1 - t * poly(t) * exp(-x^2), t = 1/(1 + p x)
constexpr float kErfA[5] = {0.254829592f, -0.284496736f, 1.421413741f, -1.453152027f, 1.061405429f};

GatedKernel gated_activation_portable;
#if defined(MOE_ONNX_HAVE_AVX2)
GatedKernel gated_activation_avx2;
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
GatedKernel gated_activation_avx512;
#endif
#if defined(MOE_ONNX_HAVE_NEON)
GatedKernel gated_activation_neon;
#endif
}  // namespace detail

}  // namespace moe_onnx
