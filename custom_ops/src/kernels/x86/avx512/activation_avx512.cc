// AVX-512 gated activation (activation.h); this file alone is compiled with the AVX-512 flags and is
// only called after a run-time check of the CPU. The same operations as the AVX2 version in the
// same order (so the same results), on two gate/up panels at once: their 8 gate columns side by
// side in one zmm, their 8 up columns in another.
#include <immintrin.h>

#include "activation.h"
#include "gemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// exp(x) for 16 lanes: activation_avx2.cc's exp8 (Cephes' expf, about 1 ulp; +inf above 88.72, a
// tiny normal value below -87.3, NaN stays NaN).
inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.7228394f), lo = _mm512_set1_ps(-87.3365447f);
  const __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  __m512 xc = _mm512_max_ps(lo, _mm512_min_ps(hi, x));  // operand order keeps NaN (min/max return the 2nd)
  __m512 fx = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  xc = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), xc);
  xc = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), xc);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, xc, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 x2 = _mm512_mul_ps(xc, xc);
  y = _mm512_fmadd_ps(y, x2, _mm512_add_ps(xc, _mm512_set1_ps(1.0f)));
  const __m512i n = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  const __m512i n_hi = _mm512_min_epi32(_mm512_max_epi32(n, _mm512_set1_epi32(1)), _mm512_set1_epi32(254));
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n_hi, 23)));
  return _mm512_mask_blend_ps(over, y, _mm512_set1_ps(__builtin_inff()));
}

inline __m512 sigmoid16(__m512 z) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

// Phi(z) as activation_avx2.cc's normal_cdf8, 16 lanes (the same operations in the same order).
inline __m512 normal_cdf16(__m512 z) {
  const __m512 x = _mm512_mul_ps(_mm512_abs_ps(z), _mm512_set1_ps(kInvSqrt2));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(kErfP), x, one));
  __m512 poly = _mm512_set1_ps(kErfA[4]);
  for (int i = 3; i >= 0; --i) poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kErfA[i]));
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(x, x)));
  const __m512 tail = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(poly, t)), e);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ), tail, _mm512_sub_ps(one, tail));
}

// f(z) of one pointwise form on 16 lanes (activation.h); NaN stays NaN (max returns its 2nd operand).
template <PointwiseActivation::Form F>
inline __m512 pointwise16(__m512 z) {
  using Form = PointwiseActivation::Form;
  if constexpr (F == Form::kRelu) return _mm512_max_ps(_mm512_setzero_ps(), z);
  if constexpr (F == Form::kRelu2) {
    const __m512 r = _mm512_max_ps(_mm512_setzero_ps(), z);
    return _mm512_mul_ps(r, r);
  }
  if constexpr (F == Form::kGelu) return _mm512_mul_ps(z, normal_cdf16(z));
  if constexpr (F == Form::kGeluTanh) {
    const __m512 s = _mm512_fmadd_ps(_mm512_set1_ps(kGeluTanhC3), _mm512_mul_ps(z, z), _mm512_set1_ps(kGeluTanhC1));
    return _mm512_mul_ps(z, sigmoid16(_mm512_mul_ps(z, s)));
  }
  if constexpr (F == Form::kSilu) return _mm512_mul_ps(z, sigmoid16(z));
  return z;
}

template <PointwiseActivation::Form F>
void pointwise_rows(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
                    int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < panels * kPanel; c += 16) {
      __m512 z = _mm512_loadu_ps(C + r * ldc + c);
      if (bias) z = _mm512_add_ps(z, _mm512_loadu_ps(bias + c));
      _mm512_storeu_ps(dst + r * ldd + c, pointwise16<F>(z));
    }
}

}  // namespace

void pointwise_activation_avx512(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  with_pointwise_form(act.form, [&](auto form) {
    pointwise_rows<decltype(form)::value>(C, ldc, bias, rows, panels, dst, ldd);
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
      __m512 out;
      if (clamp) {
        gate = _mm512_min_ps(vb, gate);                  // min(gate, limit); NaN gate stays NaN
        up = _mm512_min_ps(vb, _mm512_max_ps(vnb, up));  // clamp(up, -limit, limit); NaN stays NaN
        out = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(up, one), gate), sigmoid16(_mm512_mul_ps(va, gate)));
      } else {
        out = _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid16(_mm512_mul_ps(va, gate))), up);
      }
      _mm512_mask_storeu_ps(dst + r * ldd + p * (kPanel / 2), store, out);
    }
}

}  // namespace detail
}  // namespace moe_onnx
