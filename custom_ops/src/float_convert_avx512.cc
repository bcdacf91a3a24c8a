// widen_row with AVX-512; this file alone is compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl
// -mfma -mf16c and is only called after a run-time check of the CPU.
#include <immintrin.h>

#include "float_convert.h"

namespace moe_onnx {
namespace detail {

void widen_row_avx512(FloatType type, const void* src, float* dst, int64_t n) {
  const auto* s16 = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (type == FloatType::kF16) {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16 + i))));
  } else if (type == FloatType::kBF16) {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16 + i))),
                                    16)));
  }
  widen_row_from(type, src, i, dst, n);
}

}  // namespace detail
}  // namespace moe_onnx
