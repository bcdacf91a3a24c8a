// AVX2 + FMA gated activation (activation.h); this file alone is compiled with -mavx2 -mfma and is
// only called after a run-time check of the CPU.
#include <immintrin.h>

#include "activation.h"
#include "gemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// exp(x) for 8 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp).
// Overflows to +inf above 88.72, goes to 0 below -87.3 (as a denormal-free tiny value), NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228394f), lo = _mm256_set1_ps(-87.3365447f);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  __m256 xc = _mm256_max_ps(lo, _mm256_min_ps(hi, x));  // operand order keeps NaN (min/max return the 2nd)
  __m256 fx = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  xc = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
  xc = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), xc);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, xc, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 x2 = _mm256_mul_ps(xc, xc);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(xc, _mm256_set1_ps(1.0f)));
  // 2^fx: fx is in [-126, 128] after the clamp (NaN lanes give garbage here, but y is NaN there).
  const __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  const __m256i n_lo = _mm256_max_epi32(n, _mm256_set1_epi32(1));
  const __m256i n_hi = _mm256_min_epi32(n_lo, _mm256_set1_epi32(254));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n_hi, 23)));
  return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), over);
}

inline __m256 sigmoid8(__m256 z) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}

// Phi(z) as activation.cc's normal_cdf, 8 lanes.
inline __m256 normal_cdf8(__m256 z) {
  const __m256 x = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), z), _mm256_set1_ps(kInvSqrt2));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(kErfP), x, one));
  __m256 poly = _mm256_set1_ps(kErfA[4]);
  for (int i = 3; i >= 0; --i) poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kErfA[i]));
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(x, x)));
  const __m256 tail = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(poly, t)), e);
  return _mm256_blendv_ps(tail, _mm256_sub_ps(one, tail), _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
}

// f(z) of one pointwise form on 8 lanes (activation.h); NaN stays NaN (max returns its 2nd operand).
template <PointwiseActivation::Form F>
inline __m256 pointwise8(__m256 z) {
  using Form = PointwiseActivation::Form;
  if constexpr (F == Form::kRelu) return _mm256_max_ps(_mm256_setzero_ps(), z);
  if constexpr (F == Form::kRelu2) {
    const __m256 r = _mm256_max_ps(_mm256_setzero_ps(), z);
    return _mm256_mul_ps(r, r);
  }
  if constexpr (F == Form::kGelu) return _mm256_mul_ps(z, normal_cdf8(z));
  if constexpr (F == Form::kGeluTanh) {
    const __m256 s = _mm256_fmadd_ps(_mm256_set1_ps(kGeluTanhC3), _mm256_mul_ps(z, z), _mm256_set1_ps(kGeluTanhC1));
    return _mm256_mul_ps(z, sigmoid8(_mm256_mul_ps(z, s)));
  }
  if constexpr (F == Form::kSilu) return _mm256_mul_ps(z, sigmoid8(z));
  return z;
}

template <PointwiseActivation::Form F>
void pointwise_rows(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
                    int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < panels * kPanel; c += 8) {
      __m256 z = _mm256_loadu_ps(C + r * ldc + c);
      if (bias) z = _mm256_add_ps(z, _mm256_loadu_ps(bias + c));
      _mm256_storeu_ps(dst + r * ldd + c, pointwise8<F>(z));
    }
}

}  // namespace

void pointwise_activation_avx2(const PointwiseActivation& act, const float* C, int64_t ldc, const float* bias,
                               int64_t rows, int64_t panels, float* dst, int64_t ldd) {
  with_pointwise_form(act.form, [&](auto form) {
    pointwise_rows<decltype(form)::value>(C, ldc, bias, rows, panels, dst, ldd);
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
      __m256 out;
      if (clamp) {
        gate = _mm256_min_ps(vb, gate);                     // min(gate, limit); NaN gate stays NaN
        up = _mm256_min_ps(vb, _mm256_max_ps(vnb, up));     // clamp(up, -limit, limit); NaN stays NaN
        out = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(up, one), gate), sigmoid8(_mm256_mul_ps(va, gate)));
      } else {
        out = _mm256_mul_ps(_mm256_mul_ps(gate, sigmoid8(_mm256_mul_ps(va, gate))), up);
      }
      _mm256_storeu_ps(dst + r * ldd + p * (kPanel / 2), out);
    }
}

}  // namespace detail
}  // namespace moe_onnx
