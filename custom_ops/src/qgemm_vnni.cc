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

// MR rows x one block of one panel: the int32 dots into dots[r * row_stride].
template <int MR>
void block_dots(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* sums, int64_t sums_stride,
                const uint8_t* block, int32_t* dots, int64_t row_stride) {
  __m512i acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
  const uint8_t* codes = block + layout.header_bytes();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < layout.groups_per_block(); ++g) {
    const __m512i group = _mm512_loadu_si512(codes + g * kQuantGroupBytes);
    if (layout.code == QuantCode::kInt8) {
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], group, broadcast_quad(qa + r * ldq + 4 * g));
    } else {
      const __m512i low = _mm512_and_si512(group, nibble);                         // rows 0-3
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(group, 4), nibble);  // rows 4-7
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], low, broadcast_quad(qa + r * ldq + 8 * g));
        acc[r] = _mm512_dpbusd_epi32(acc[r], high, broadcast_quad(qa + r * ldq + 8 * g + 4));
      }
    }
  }
  const __m512i zero_point =
      layout.zero_points ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64)))
                         : _mm512_set1_epi32(layout.default_zero_point());
  for (int r = 0; r < MR; ++r)
    _mm512_storeu_si512(dots + r * row_stride,
                        _mm512_sub_epi32(acc[r], _mm512_mullo_epi32(zero_point, _mm512_set1_epi32(sums[r * sums_stride]))));
}

}  // namespace

void quant_dots_vnni(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* qa_sums, int64_t M,
                     const uint8_t* B, int64_t p0, int64_t p1, int32_t* dots) {
  const int64_t blocks = layout.blocks(), padded = layout.groups_per_block() * layout.group_rows();
  const int64_t panels = p1 - p0, row_stride = panels * blocks * kPanel;
  constexpr int kRows = 4;
  for (int64_t m = 0; m < M; m += kRows) {
    const int rows = M - m < kRows ? static_cast<int>(M - m) : kRows;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = B + p * layout.panel_bytes() + b * layout.block_bytes();
        const int8_t* a = qa + m * ldq + b * padded;
        const int32_t* sums = qa_sums + m * blocks + b;
        int32_t* out = dots + m * row_stride + ((p - p0) * blocks + b) * kPanel;
        switch (rows) {
          case 4: block_dots<4>(layout, a, ldq, sums, blocks, block, out, row_stride); break;
          case 3: block_dots<3>(layout, a, ldq, sums, blocks, block, out, row_stride); break;
          case 2: block_dots<2>(layout, a, ldq, sums, blocks, block, out, row_stride); break;
          default: block_dots<1>(layout, a, ldq, sums, blocks, block, out, row_stride); break;
        }
      }
  }
}

}  // namespace detail
}  // namespace moe_onnx
