// fp32 <-> fp16/bf16 rows: the element forms of core/float_convert.h on whole rows, vectorized where the
// CPU allows (the ISA table's widen_row and narrow_row slots, isa.h; their SIMD kernels in
// x86/avx2/float_rows_avx2.cc and x86/avx512/float_rows_avx512.cc), with the bits of the element forms.
#pragma once

#include <cstdint>

#include "float_convert.h"

namespace moe_onnx {

// dst[i] = fp32(src[i]) for n elements of `type`: vectorized where the CPU allows, the bits of to_fp32.
void widen_row(FloatType type, const void* src, float* dst, int64_t n);
// dst[i] = src[i] rounded to `type` (float_to_half, float_to_bf16; fp32 copied) for n elements:
// vectorized where the CPU allows, the bits of the element forms.
void narrow_row(FloatType type, const float* src, void* dst, int64_t n);

namespace detail {
// The kernels of widen_row (the table's slot), arguments as there (n > 0).
using WidenRowFn = void (*)(FloatType, const void*, float*, int64_t);
void widen_row_portable(FloatType type, const void* src, float* dst, int64_t n);
// widen_row's portable form on elements [done, n): all of a row, or the tail a SIMD form leaves.
void widen_row_from(FloatType type, const void* src, int64_t done, float* dst, int64_t n);
// The kernels of narrow_row (the table's slot), arguments as there (n > 0).
using NarrowRowFn = void (*)(FloatType, const float*, void*, int64_t);
void narrow_row_portable(FloatType type, const float* src, void* dst, int64_t n);
// narrow_row's portable form on elements [done, n): all of a row, or the tail a SIMD form leaves.
void narrow_row_from(FloatType type, const float* src, int64_t done, void* dst, int64_t n);
#if defined(MOE_ONNX_HAVE_AVX2)
void widen_row_avx2(FloatType type, const void* src, float* dst, int64_t n);
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
void widen_row_avx512(FloatType type, const void* src, float* dst, int64_t n);
void narrow_row_avx512(FloatType type, const float* src, void* dst, int64_t n);
#endif
#if defined(MOE_ONNX_HAVE_NEON)
void widen_row_neon(FloatType type, const void* src, float* dst, int64_t n);
void narrow_row_neon(FloatType type, const float* src, void* dst, int64_t n);
#endif
}  // namespace detail

}  // namespace moe_onnx
