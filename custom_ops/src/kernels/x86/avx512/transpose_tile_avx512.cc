// transpose_tile and quant_code_groups (transpose_tile_simd.h on 16 lanes) with AVX-512; this file alone is
// compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c and is only called after a run-time
// check of the CPU. transpose_tile widens elements of 1 or 2 bytes to 32 bits, transposes them as 32-bit ones
// and narrows them again.
#include <immintrin.h>

#include "transpose_tile.h"
#include "x86/avx512/simd_avx512.h"
#include "x86/transpose_tile_simd.h"

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

void quant_code_groups_avx512(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                              bool nibbles, uint8_t* out) {
  quant_code_groups_simd<Avx512>(lanes, groups, per_block, block_bytes, nibbles, out);
}

}  // namespace detail
}  // namespace moe_onnx
