// transpose_tile with AVX-512; this file alone is compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma
// -mf16c and is only called after a run-time check of the CPU. Elements of 1 or 2 bytes are widened to 32 bits,
// transposed as 32-bit ones and narrowed again.
#include <immintrin.h>

#include <algorithm>

#include "transpose_tile.h"

namespace moe_onnx {
namespace detail {
namespace {

// out[j] = (a[0][j], a[1][j], ..., a[15][j]) for 32-bit elements: interleave pairs of 32-bit elements, then
// of 64-bit ones, within each 128-bit lane; then gather the lanes.
void transpose_32bit(__m512i a[16]) {
  __m512i b[16], c[16];
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);  // lane L: a[i][4L], a[i+1][4L], a[i][4L+1], a[i+1][4L+1]
    b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // c[g + m], lane L: rows g..g+3 at element 4L + m
    c[g] = _mm512_unpacklo_epi64(b[g], b[g + 2]);
    c[g + 1] = _mm512_unpackhi_epi64(b[g], b[g + 2]);
    c[g + 2] = _mm512_unpacklo_epi64(b[g + 1], b[g + 3]);
    c[g + 3] = _mm512_unpackhi_epi64(b[g + 1], b[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i even_lo = _mm512_shuffle_i32x4(c[m], c[4 + m], 0x88), odd_lo = _mm512_shuffle_i32x4(c[m], c[4 + m], 0xdd);
    const __m512i even_hi = _mm512_shuffle_i32x4(c[8 + m], c[12 + m], 0x88),
                  odd_hi = _mm512_shuffle_i32x4(c[8 + m], c[12 + m], 0xdd);
    a[m] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);       // element m of lane 0
    a[4 + m] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);     // lane 1
    a[8 + m] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);   // lane 2
    a[12 + m] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);    // lane 3
  }
}

// interleave_nibbles (transpose_tile.h) on each 32-bit element.
__m512i interleave_nibbles(__m512i x) {
  __m512i t = _mm512_and_si512(_mm512_xor_si512(x, _mm512_srli_epi32(x, 8)), _mm512_set1_epi32(0x0000FF00));
  x = _mm512_xor_si512(x, _mm512_xor_si512(t, _mm512_slli_epi32(t, 8)));
  t = _mm512_and_si512(_mm512_xor_si512(x, _mm512_srli_epi32(x, 4)), _mm512_set1_epi32(0x00F000F0));
  return _mm512_xor_si512(x, _mm512_xor_si512(t, _mm512_slli_epi32(t, 4)));
}

}  // namespace

void transpose_tile_avx512(const void* const* columns, int bytes, void* rows) {
  __m512i a[16];
  for (int c = 0; c < 16; ++c) {
    if (bytes == 4) a[c] = _mm512_loadu_si512(columns[c]);
    else if (bytes == 2) a[c] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(columns[c])));
    else a[c] = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(columns[c])));
  }
  transpose_32bit(a);
  for (int r = 0; r < 16; ++r) {
    char* row = static_cast<char*>(rows) + r * 16 * bytes;
    if (bytes == 4) _mm512_storeu_si512(row, a[r]);
    else if (bytes == 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm512_cvtepi32_epi16(a[r]));
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm512_cvtepi32_epi8(a[r]));
  }
}

// Four groups of every lane at a time (fewer at the end: masked loads): z[i] holds lanes i, i + 4, i + 8,
// i + 12 in its 128-bit parts, so a 4x4 transpose of 32-bit elements within the parts leaves group m of
// lanes 0..15 in order in g[m].
void quant_code_groups_avx512(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                              bool nibbles, uint8_t* out) {
  GroupPlaces places(out, per_block, block_bytes);
  for (int64_t j = 0; j < groups; j += 4) {
    const int64_t n = std::min<int64_t>(4, groups - j);
    const auto mask = static_cast<__mmask8>((1u << n) - 1);
    const auto load = [&](int lane) {
      const uint8_t* p = lanes[lane] + 4 * j;
      return n == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi32(mask, p);
    };
    __m512i z[4];
    for (int i = 0; i < 4; ++i) {
      __m512i v = _mm512_castsi128_si512(load(i));
      v = _mm512_inserti32x4(v, load(i + 4), 1);
      v = _mm512_inserti32x4(v, load(i + 8), 2);
      v = _mm512_inserti32x4(v, load(i + 12), 3);
      z[i] = nibbles ? interleave_nibbles(v) : v;
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i g[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                          _mm512_unpackhi_epi64(t1, t3)};
    for (int64_t m = 0; m < n; ++m) _mm512_storeu_si512(places.next(), g[m]);
  }
}

}  // namespace detail
}  // namespace moe_onnx
