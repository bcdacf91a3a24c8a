// widen_row (float_rows_simd.h on 16 lanes) and narrow_row with AVX-512; this file alone is compiled with
// -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c and is only called after a run-time check of the CPU.
#include <immintrin.h>

#include "float_rows.h"
#include "x86/avx512/simd_avx512.h"
#include "float_rows_simd.h"

namespace moe_onnx {
namespace detail {

void widen_row_avx512(FloatType type, const void* src, float* dst, int64_t n) {
  widen_row_simd<Avx512>(type, src, dst, n);
}

void narrow_row_avx512(FloatType type, const float* src, void* dst, int64_t n) {
  int64_t i = 0;
  if (type == FloatType::kBF16) {  // float_to_bf16 on 16 lanes: NaN keeps its top bits, quieted; else nearest even
    auto* d16 = static_cast<uint16_t*>(dst);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    for (; i + 16 <= n; i += 16) {
      const __m512i x = _mm512_loadu_si512(src + i);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, magnitude), infinity);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(half, odd)), 16);
      const __m512i bits = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(x, 16), quiet);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d16 + i), _mm512_cvtepi32_epi16(bits));
    }
  }
  narrow_row_from(type, src, i, dst, n);
}

}  // namespace detail
}  // namespace moe_onnx
