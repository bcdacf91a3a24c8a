// The experts' activations (activation.h) written once over a vector mapping V (avx2/simd_avx2.h,
// avx512/simd_avx512.h): exp, sigmoid and the normal CDF on V::kLanes lanes, the pointwise forms and
// their row loop, and the gated forms on a vector of gate lanes and one of up lanes (each ISA's file
// loads them from its gate/up panels). Both widths run the same operations in the same order, so the AVX2
// and AVX-512 kernels give the same bits. Included by the ISA
// folders' activation files only, compiled with their flags.
#pragma once

#include <cstdint>

#include "activation.h"
#include "gemm.h"

namespace moe_onnx::detail {

// exp(x) (Cephes' expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp). Overflows to +inf
// above 88.72, goes to 0 below -87.3 (as a denormal-free tiny value), NaN stays NaN.
template <class V>
inline typename V::F exp_lanes(typename V::F x) {
  using F = typename V::F;
  const F hi = V::set1(88.7228394f), lo = V::set1(-87.3365447f);
  const auto over = V::greater(x, hi);
  F xc = V::max(lo, V::min(hi, x));  // operand order keeps NaN (min/max return the 2nd)
  F fx = V::floor(V::fmadd(xc, V::set1(1.44269504088896341f), V::set1(0.5f)));
  xc = V::fnmadd(fx, V::set1(0.693359375f), xc);
  xc = V::fnmadd(fx, V::set1(-2.12194440e-4f), xc);
  F y = V::set1(1.9875691500E-4f);
  y = V::fmadd(y, xc, V::set1(1.3981999507E-3f));
  y = V::fmadd(y, xc, V::set1(8.3334519073E-3f));
  y = V::fmadd(y, xc, V::set1(4.1665795894E-2f));
  y = V::fmadd(y, xc, V::set1(1.6666665459E-1f));
  y = V::fmadd(y, xc, V::set1(5.0000001201E-1f));
  const F x2 = V::mul(xc, xc);
  y = V::fmadd(y, x2, V::add(xc, V::set1(1.0f)));
  // 2^fx: fx is in [-126, 128] after the clamp (NaN lanes give garbage here, but y is NaN there).
  const auto n = V::add_i32(V::truncate(fx), V::set1_i32(127));
  const auto n_bounded = V::min_i32(V::max_i32(n, V::set1_i32(1)), V::set1_i32(254));
  y = V::mul(y, V::as_float(V::template shift_left<23>(n_bounded)));
  return V::select(over, y, V::set1(__builtin_inff()));
}

template <class V>
inline typename V::F sigmoid_lanes(typename V::F z) {
  const typename V::F one = V::set1(1.0f);
  return V::div(one, V::add(one, exp_lanes<V>(V::sub(V::zero(), z))));
}

// Phi(z) as activation.cc's normal_cdf.
template <class V>
inline typename V::F normal_cdf_lanes(typename V::F z) {
  using F = typename V::F;
  const F x = V::mul(V::abs(z), V::set1(kInvSqrt2));
  const F one = V::set1(1.0f);
  const F t = V::div(one, V::fmadd(V::set1(kErfP), x, one));
  F poly = V::set1(kErfA[4]);
  for (int i = 3; i >= 0; --i) poly = V::fmadd(poly, t, V::set1(kErfA[i]));
  const F e = exp_lanes<V>(V::sub(V::zero(), V::mul(x, x)));
  const F tail = V::mul(V::mul(V::set1(0.5f), V::mul(poly, t)), e);
  return V::select(V::greater_equal(z, V::zero()), tail, V::sub(one, tail));
}

// f(z) of one pointwise form (activation.h); NaN stays NaN (max returns its 2nd operand).
template <class V, PointwiseActivation::Form kForm>
inline typename V::F pointwise_lanes(typename V::F z) {
  using Form = PointwiseActivation::Form;
  if constexpr (kForm == Form::kRelu) return V::max(V::zero(), z);
  if constexpr (kForm == Form::kRelu2) {
    const typename V::F r = V::max(V::zero(), z);
    return V::mul(r, r);
  }
  if constexpr (kForm == Form::kGelu) return V::mul(z, normal_cdf_lanes<V>(z));
  if constexpr (kForm == Form::kGeluTanh) {
    const typename V::F s = V::fmadd(V::set1(kGeluTanhC3), V::mul(z, z), V::set1(kGeluTanhC1));
    return V::mul(z, sigmoid_lanes<V>(V::mul(z, s)));
  }
  if constexpr (kForm == Form::kSilu) return V::mul(z, sigmoid_lanes<V>(z));
  return z;
}

// PointwiseActivation::apply of one form on V's lanes (a panel is a whole number of vectors).
template <class V, PointwiseActivation::Form kForm>
void pointwise_rows(const float* C, int64_t ldc, const float* bias, int64_t rows, int64_t panels, float* dst,
                    int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < panels * kPanel; c += V::kLanes) {
      typename V::F z = V::load(C + r * ldc + c);
      if (bias) z = V::add(z, V::load(bias + c));
      V::store(dst + r * ldd + c, pointwise_lanes<V, kForm>(z));
    }
}

// The gated forms (GatedActivation::apply's) on a vector of gate lanes and the matching up lanes: with
// `clamp` (kClampedSwiglu) gate <= limit and -limit <= up <= limit, then (up + 1) * gate * sigmoid(alpha *
// gate); else gate * sigmoid(alpha * gate) * up. NaN stays NaN.
template <class V>
inline typename V::F gated_lanes(typename V::F gate, typename V::F up, bool clamp, typename V::F alpha,
                                 typename V::F limit, typename V::F negative_limit, typename V::F one) {
  if (clamp) {
    gate = V::min(limit, gate);                      // NaN gate stays NaN
    up = V::min(limit, V::max(negative_limit, up));  // NaN stays NaN
    return V::mul(V::mul(V::add(up, one), gate), sigmoid_lanes<V>(V::mul(alpha, gate)));
  }
  return V::mul(V::mul(gate, sigmoid_lanes<V>(V::mul(alpha, gate))), up);
}

}  // namespace moe_onnx::detail
