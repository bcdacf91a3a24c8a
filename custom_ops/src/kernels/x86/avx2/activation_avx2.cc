// The activations (activation.h) on AVX2 + FMA: activation_simd.h on 8 lanes, one gate/up panel at a
// time (its 8 gate columns in one ymm, its 8 up columns in another). This file alone is compiled with
// -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
#include "x86/activation_simd.h"
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
  gated_activation_simd<Avx2>(act, C, ldc, bias, rows, panels, dst, ldd);
}

}  // namespace detail
}  // namespace moe_onnx
