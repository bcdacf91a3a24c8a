// The gated activations of MOE's expert types (moe_onnx/ops/moe.py), applied as the epilogue of
// the gate/up GEMM on results laid out as gate/up panels: 8 gate columns, then the 8 matching up
// columns (moe.cc packs the weights so). AVX-512 or AVX2/FMA chosen at run time, portable fallback
// (isa.h's level, as for the GEMM).
#pragma once

#include <cstdint>

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

namespace detail {
void gated_activation_portable(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd);
#if defined(MOE_ONNX_HAVE_AVX2)
void gated_activation_avx2(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                           int64_t rows, int64_t panels, float* dst, int64_t ldd);
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
void gated_activation_avx512(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                             int64_t rows, int64_t panels, float* dst, int64_t ldd);
#endif
}  // namespace detail

}  // namespace moe_onnx
