// The AVX2 side of what the x86 kernels write once for both vector widths (../*_simd.h): a mapping of
// fp32 and int32 vectors of 8 lanes onto AVX2 + FMA + F16C, and the widening of fp16/bf16 elements to
// fp32 (the vector forms of core/float_convert.h's, with their bits). The AVX-512 side,
// ../avx512/simd_avx512.h, has the same names. Included only by this folder's files: they are compiled
// with -mavx2 -mfma -mf16c and called only after a run-time check of the CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moe_onnx::detail {

struct Avx2 {
  static constexpr int kLanes = 8;
  using F = __m256;   // kLanes fp32
  using I = __m256i;  // kLanes int32
  using Mask = __m256;  // a comparison's result: every bit of a lane set where true

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  // min and max return b where either is NaN
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }    // a * b + c, rounded once
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
  static F floor(F a) { return _mm256_floor_ps(a); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static Mask greater(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static Mask greater_equal(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  // where m: if_true, else if_false
  static F select(Mask m, F if_false, F if_true) { return _mm256_blendv_ps(if_false, if_true, m); }

  static I truncate(F a) { return _mm256_cvttps_epi32(a); }
  static I set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
  static I add_i32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I min_i32(I a, I b) { return _mm256_min_epi32(a, b); }
  static I max_i32(I a, I b) { return _mm256_max_epi32(a, b); }
  static I bits_and(I a, I b) { return _mm256_and_si256(a, b); }
  static I bits_xor(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int kBits>
  static I shift_left(I a) { return _mm256_slli_epi32(a, kBits); }
  template <int kBits>
  static I shift_right(I a) { return _mm256_srli_epi32(a, kBits); }
  static F as_float(I a) { return _mm256_castsi256_ps(a); }

  // Integer data in 128-bit parts (kLanes / 4 of them): the first n (<= 4) 32-bit words at p, zero
  // past them; a vector of parts[0] (lowest) to parts[kLanes / 4 - 1]; the unpacks within each part;
  // the vector's bytes stored at p.
  static __m128i load_words(const uint8_t* p, int64_t n) {
    if (n == 4) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(n)), _mm_setr_epi32(0, 1, 2, 3));
    return _mm_maskload_epi32(reinterpret_cast<const int*>(p), mask);
  }
  static I join_parts(const __m128i* parts) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(parts[0]), parts[1], 1);
  }
  static I unpack_lo32(I a, I b) { return _mm256_unpacklo_epi32(a, b); }
  static I unpack_hi32(I a, I b) { return _mm256_unpackhi_epi32(a, b); }
  static I unpack_lo64(I a, I b) { return _mm256_unpacklo_epi64(a, b); }
  static I unpack_hi64(I a, I b) { return _mm256_unpackhi_epi64(a, b); }
  static void store_bytes(uint8_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

  // kLanes fp16 (bits) from p, as fp32
  static F widen_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // kLanes bf16 (bits) from p, as fp32
  static F widen_bf16(const uint16_t* p) {
    return as_float(shift_left<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
  }
  // 2 * kLanes bf16 from p, as fp32: the even elements in `even`, the odd ones in `odd` (a bf16 panel
  // row, gemm.h's bf16_lane order: columns 0-7 and 8-15)
  static void widen_bf16_pairs(const uint16_t* p, F& even, F& odd) {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = as_float(shift_left<16>(v));
    odd = as_float(bits_and(v, set1_i32(static_cast<int32_t>(0xffff0000u))));
  }
};

}  // namespace moe_onnx::detail
