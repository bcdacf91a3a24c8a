// Conversion between fp32 and the 16-bit float types (fp16, bf16), one element at a time: the one
// definition of each direction. Widening (fp16/bf16 -> fp32) is exact; narrowing (fp32 -> fp16/bf16)
// rounds to nearest even. The row routines (widen_row, narrow_row: kernels/float_rows.h) and the SIMD
// kernels' vector forms give the same bits.
//
// No onnxruntime header here: the SIMD kernels include it (gemm.h's panels hold FloatType elements).
// tensor.h maps an onnxruntime element type to its FloatType (float_type).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace moe_onnx {

// A floating-point element type the kernels compute from, in fp32.
enum class FloatType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
constexpr size_t float_size(FloatType type) { return type == FloatType::kF32 ? 4 : 2; }

// ---------------------------------------------------------------------------- one element

// The bits of an fp32 value, and the fp32 value of 32 bits (C++20's std::bit_cast).
inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

inline float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  return float_from_bits(bits);
}

inline uint16_t float_to_half(float f) {  // round to nearest even
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {                         // below the smallest normal half: subnormal or zero
    if (ax < 0x33000000u) return sign;            // < 2^-25: rounds to zero
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ax + 0xc8000fffu + ((ax >> 13) & 1u);  // rebias (-112 << 23) and round
  return sign | static_cast<uint16_t>(r >> 13);
}

inline float bf16_to_float(uint16_t b) { return float_from_bits(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// Element i of a buffer of T elements (uint16_t bits for fp16 and bf16), as fp32.
template <FloatType T>
inline float to_fp32(const void* p, int64_t i) {
  if constexpr (T == FloatType::kF16) return half_to_float(static_cast<const uint16_t*>(p)[i]);
  if constexpr (T == FloatType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// A run-time element type as a template argument: f(std::integral_constant<FloatType, type>{}), f's result.
template <class F>
inline decltype(auto) with_float_type(FloatType type, F&& f) {
  switch (type) {
    case FloatType::kF16: return f(std::integral_constant<FloatType, FloatType::kF16>{});
    case FloatType::kBF16: return f(std::integral_constant<FloatType, FloatType::kBF16>{});
    default: return f(std::integral_constant<FloatType, FloatType::kF32>{});
  }
}

// Element i of a buffer of `type` elements, as fp32.
inline float load_float(FloatType type, const void* p, int64_t i) {
  return with_float_type(type, [&](auto t) { return to_fp32<decltype(t)::value>(p, i); });
}

}  // namespace moe_onnx
