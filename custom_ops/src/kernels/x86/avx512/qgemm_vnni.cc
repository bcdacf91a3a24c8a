// AVX512-VNNI dots of quant_gemm_panels at accuracy level 4 (qgemm.h); this file alone is compiled
// with -mavx512f -mavx512bw -mavx512vl -mavx512vnni and is only called after a run-time check.
//
// vpdpbusd multiplies the 4 unsigned bytes of each 32-bit lane of the codes (a column's 4
// consecutive k: 8-bit codes as stored, 4-bit codes after a nibble mask or a shift and a mask) by
// 4 signed bytes of the activation row (broadcast) and adds their sum into the lane: at most 4 *
// 255 * 127 per step, so the int32 sums are exact. dot = sum q * qa - zp * sum qa, as the portable
// loops compute it.
#include <immintrin.h>

#include <cstring>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

inline __m512i broadcast_quad(const int8_t* a) {
  int32_t quad;
  std::memcpy(&quad, a, 4);
  return _mm512_set1_epi32(quad);
}

// MR rows x one panel over all blocks: each block's int32 dots (exact), then
// out += (sa * scale) * float(dot), into C.
template <int MR>
void panel_rows(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* sums, const float* sa,
                const uint8_t* panel, float* C, int64_t ldc) {
  // the layout's sizes once, out of the blocks' loop (each divides or branches on the code)
  const int64_t blocks = layout.blocks(), padded = layout.activation_block(), block_bytes = layout.block_bytes(),
                header_bytes = layout.header_bytes(), groups = layout.groups_per_block();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 out[MR];
  for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    const uint8_t* codes = block + header_bytes;
    const int8_t* a = qa + b * padded;
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i group = _mm512_loadu_si512(codes + g * kQuantGroupBytes);
      if (layout.code == QuantCode::kInt8) {
        for (int r = 0; r < MR; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], group, broadcast_quad(a + r * ldq + 4 * g));
      } else {
        const __m512i low = _mm512_and_si512(group, nibble);                         // rows 0-3
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(group, 4), nibble);  // rows 4-7
        for (int r = 0; r < MR; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], low, broadcast_quad(a + r * ldq + 8 * g));
          acc[r] = _mm512_dpbusd_epi32(acc[r], high, broadcast_quad(a + r * ldq + 8 * g + 4));
        }
      }
    }
    const __m512i zero_point =
        layout.zero_points ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64)))
                           : _mm512_set1_epi32(layout.default_zero_point());
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(block));
    for (int r = 0; r < MR; ++r) {
      const __m512i dot = _mm512_sub_epi32(acc[r], _mm512_mullo_epi32(zero_point, _mm512_set1_epi32(sums[r * blocks + b])));
      const __m512 factor = _mm512_mul_ps(_mm512_set1_ps(sa[r * blocks + b]), scale);
      out[r] = _mm512_add_ps(out[r], _mm512_mul_ps(factor, _mm512_cvtepi32_ps(dot)));
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(C + r * ldc, out[r]);
}

}  // namespace

void quant_dots_vnni(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* qa_sums, const float* sa,
                     int64_t M, const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc) {
  for_dot_tiles<4>(layout, qa, ldq, qa_sums, sa, M, B, p0, p1, C, ldc,
                   [&](auto rows, const int8_t* a, const int32_t* sums, const float* scales, const uint8_t* panel,
                       float* out) { panel_rows<rows()>(layout, a, ldq, sums, scales, panel, out, ldc); });
}

}  // namespace detail
}  // namespace moe_onnx
