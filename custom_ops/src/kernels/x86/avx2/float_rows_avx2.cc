// widen_row with AVX2 + F16C; this file alone is compiled with -mavx2 -mfma -mf16c and is only called
// after a run-time check of the CPU.
#include <immintrin.h>

#include "float_rows.h"

namespace moe_onnx {
namespace detail {

void widen_row_avx2(FloatType type, const void* src, float* dst, int64_t n) {
  const auto* s16 = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (type == FloatType::kF16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + i))));
  } else if (type == FloatType::kBF16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + i))),
                                    16)));
  }
  widen_row_from(type, src, i, dst, n);
}

}  // namespace detail
}  // namespace moe_onnx
