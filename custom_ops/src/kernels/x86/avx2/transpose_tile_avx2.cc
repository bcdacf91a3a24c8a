// quant_code_groups with AVX2; this file alone is compiled with -mavx2 and is only called after a run-time
// check of the CPU.
#include <immintrin.h>

#include <algorithm>

#include "transpose_tile.h"

namespace moe_onnx {
namespace detail {
namespace {

// interleave_nibbles (transpose_tile.h) on each 32-bit element.
__m256i interleave_nibbles(__m256i x) {
  __m256i t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi32(x, 8)), _mm256_set1_epi32(0x0000FF00));
  x = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi32(t, 8)));
  t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi32(x, 4)), _mm256_set1_epi32(0x00F000F0));
  return _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi32(t, 4)));
}

}  // namespace

// Four groups of every lane at a time (fewer at the end: masked loads), each half of the lanes on its own:
// y[i] holds lanes h + i and h + i + 4 in its 128-bit parts, so a 4x4 transpose of 32-bit elements within
// the parts leaves group m of lanes h..h + 7 in order in g[m].
void quant_code_groups_avx2(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                            bool nibbles, uint8_t* out) {
  GroupPlaces places(out, per_block, block_bytes);
  for (int64_t j = 0; j < groups; j += 4) {
    const int64_t n = std::min<int64_t>(4, groups - j);
    const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(n)), _mm_setr_epi32(0, 1, 2, 3));
    uint8_t* at[4];
    for (int64_t m = 0; m < n; ++m) at[m] = places.next();
    for (int h = 0; h < 16; h += 8) {
      const auto load = [&](int lane) {
        const uint8_t* p = lanes[lane] + 4 * j;
        return n == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                      : _mm_maskload_epi32(reinterpret_cast<const int*>(p), mask);
      };
      __m256i y[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(load(h + i)), load(h + i + 4), 1);
        y[i] = nibbles ? interleave_nibbles(v) : v;
      }
      const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
      const __m256i g[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
      for (int64_t m = 0; m < n; ++m) _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[m] + 4 * h), g[m]);
    }
  }
}

}  // namespace detail
}  // namespace moe_onnx
