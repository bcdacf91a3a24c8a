// The activations (activation.h) on AVX-512: activation_simd.h on 16 lanes, two gate/up panels at a
// time (their 8 gate columns side by side in one zmm, their 8 up columns in another). The same
// operations as the AVX2 kernels in the same order, so the same results. This file alone is compiled
// with the AVX-512 flags and is only called after a run-time check of the CPU.
#include "activation_simd.h"
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
  const bool clamp = act.form == GatedActivation::Form::kClampedSwiglu;
  const __m512 va = _mm512_set1_ps(act.alpha), vb = _mm512_set1_ps(act.limit), vnb = _mm512_set1_ps(-act.limit);
  const __m512 one = _mm512_set1_ps(1.0f);
  // Lanes 0-7 of the first panel and of the second (gate), lanes 8-15 of each (up).
  const __m512i gate_lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i up_lanes = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < panels; p += 2) {
      // A last odd panel is paired with itself and only its 8 results are stored.
      const int64_t q = p + 1 < panels ? p + 1 : p;
      const __mmask16 store = q > p ? 0xffff : 0x00ff;
      const float* gu = C + r * ldc;
      const __m512 first = _mm512_loadu_ps(gu + p * kPanel), second = _mm512_loadu_ps(gu + q * kPanel);
      __m512 gate = _mm512_permutex2var_ps(first, gate_lanes, second);
      __m512 up = _mm512_permutex2var_ps(first, up_lanes, second);
      if (bias) {
        const __m512 b0 = _mm512_loadu_ps(bias + p * kPanel), b1 = _mm512_loadu_ps(bias + q * kPanel);
        gate = _mm512_add_ps(gate, _mm512_permutex2var_ps(b0, gate_lanes, b1));
        up = _mm512_add_ps(up, _mm512_permutex2var_ps(b0, up_lanes, b1));
      }
      _mm512_mask_storeu_ps(dst + r * ldd + p * (kPanel / 2), store,
                            gated_lanes<Avx512>(gate, up, clamp, va, vb, vnb, one));
    }
}

}  // namespace detail
}  // namespace moe_onnx
