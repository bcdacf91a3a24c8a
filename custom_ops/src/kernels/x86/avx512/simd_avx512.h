// The AVX-512 side of what the x86 kernels write once for both vector widths (../*_simd.h): a mapping
// of fp32 and int32 vectors of 16 lanes onto AVX-512 F/BW/DQ/VL (+ FMA, F16C), and the widening of
// fp16/bf16 elements to fp32 (the vector forms of core/float_convert.h's, with their bits). The AVX2
// side, ../avx2/simd_avx2.h, has the same names. Included only by this folder's files: they are
// compiled with the AVX-512 flags and called only after a run-time check of the CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moe_onnx::detail {

struct Avx512 {
  static constexpr int kLanes = 16;
  using F = __m512;     // kLanes fp32
  using I = __m512i;    // kLanes int32
  using Mask = __mmask16;  // a comparison's result: one bit per lane

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  // min and max return b where either is NaN
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, rounded once
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static Mask greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask greater_equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  // where m: if_true, else if_false
  static F select(Mask m, F if_false, F if_true) { return _mm512_mask_blend_ps(m, if_false, if_true); }

  static I truncate(F a) { return _mm512_cvttps_epi32(a); }
  static I set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
  static I add_i32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I min_i32(I a, I b) { return _mm512_min_epi32(a, b); }
  static I max_i32(I a, I b) { return _mm512_max_epi32(a, b); }
  static I bits_and(I a, I b) { return _mm512_and_si512(a, b); }
  static I bits_xor(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int kBits>
  static I shift_left(I a) { return _mm512_slli_epi32(a, kBits); }
  template <int kBits>
  static I shift_right(I a) { return _mm512_srli_epi32(a, kBits); }
  static F as_float(I a) { return _mm512_castsi512_ps(a); }

  // Integer data in 128-bit parts (kLanes / 4 of them): the first n (<= 4) 32-bit words at p, zero
  // past them; a vector of parts[0] (lowest) to parts[kLanes / 4 - 1]; the unpacks within each part;
  // the vector's bytes stored at p.
  static __m128i load_words(const uint8_t* p, int64_t n) {
    if (n == 4) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm_maskz_loadu_epi32(static_cast<__mmask8>((1u << n) - 1), p);
  }
  static I join_parts(const __m128i* parts) {
    I v = _mm512_castsi128_si512(parts[0]);
    v = _mm512_inserti32x4(v, parts[1], 1);
    v = _mm512_inserti32x4(v, parts[2], 2);
    return _mm512_inserti32x4(v, parts[3], 3);
  }
  static I unpack_lo32(I a, I b) { return _mm512_unpacklo_epi32(a, b); }
  static I unpack_hi32(I a, I b) { return _mm512_unpackhi_epi32(a, b); }
  static I unpack_lo64(I a, I b) { return _mm512_unpacklo_epi64(a, b); }
  static I unpack_hi64(I a, I b) { return _mm512_unpackhi_epi64(a, b); }
  static void store_bytes(uint8_t* p, I v) { _mm512_storeu_si512(p, v); }

  // kLanes fp16 (bits) from p, as fp32
  static F widen_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // kLanes bf16 (bits) from p, as fp32
  static F widen_bf16(const uint16_t* p) {
    return as_float(shift_left<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))));
  }
  // kLanes bf16 from p in gemm.h's bf16_lane order (columns 0, 8, 1, 9, ..., 7, 15), as fp32 in column
  // order: the row loaded into both 256-bit halves, and one byte shuffle moves each column's two bytes
  // to the high half of its lane (the low half zeroed), the even elements into lanes 0-7, the odd into
  // lanes 8-15.
  static F widen_bf16_interleaved(const uint16_t* p) {
    const I row = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    // Per 128-bit lane (each a copy of 8 elements): lanes 0-1 take the even elements, lanes 2-3 the odd
    // ones; -1 zeroes a byte.
    const I order = _mm512_set_epi8(15, 14, -1, -1, 11, 10, -1, -1, 7, 6, -1, -1, 3, 2, -1, -1,  //
                                    15, 14, -1, -1, 11, 10, -1, -1, 7, 6, -1, -1, 3, 2, -1, -1,  //
                                    13, 12, -1, -1, 9, 8, -1, -1, 5, 4, -1, -1, 1, 0, -1, -1,    //
                                    13, 12, -1, -1, 9, 8, -1, -1, 5, 4, -1, -1, 1, 0, -1, -1);
    return as_float(_mm512_shuffle_epi8(row, order));
  }
};

}  // namespace moe_onnx::detail
