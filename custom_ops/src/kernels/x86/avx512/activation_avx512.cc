// The activations (activation.h) on AVX-512: activation_simd.h on 16 lanes, two gate/up panels at a
// time (their 8 gate columns side by side in one zmm, their 8 up columns in another). The same
// operations as the AVX2 kernels in the same order, so the same results. This file alone is compiled
// with the AVX-512 flags and is only called after a run-time check of the CPU.
#include "x86/activation_simd.h"
#include "x86/avx512/simd_avx512.h"

namespace moe_onnx {
namespace detail {

void pointwise_activation_avx512(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                                 int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  with_pointwise_form(act.form, [&](auto form) {
    pointwise_rows<Avx512, decltype(form)::value>(C, ldc, bias, rows, panels, dst, ldd);
  });
}

void gated_activation_avx512(const GatedActivation& act, const float* C, int64_t ldc, const float* bias,
                             int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  gated_activation_simd<Avx512>(act, C, ldc, bias, rows, panels, dst, ldd);
}

}  // namespace detail
}  // namespace moe_onnx
