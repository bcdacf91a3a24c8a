// AVX2 + FMA kernels of quant_gemm_panels (qgemm.h) at accuracy level 0; this file alone is compiled
// with -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
//
// A 64-byte group of codes is two ymm (columns 0-7, 8-15); row i of the group is two shifts and a
// conversion per 32-bit lane (Decoder), the same code values as the AVX-512 kernel. One panel at a
// time: MR x 2 dots and MR x 2 results in registers; the block's scale applies at its end.
#include <immintrin.h>

#include <type_traits>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// How a block's rows (8 columns: half h of the panel) become fp32 values v(q). Without zero points
// the codes are flipped (q ^ 8 per nibble, q ^ 0x80 per byte) and read as signed: q - 8, q - 128;
// with them, the unsigned code minus the column's zero point; E2M1: vpermps over the 8 magnitudes,
// the sign moved in from the code's bit 3.
template <QuantCode Q, bool ZP>
struct Decoder {
  __m256 zero_point;  // ZP

  Decoder(const uint8_t* block, int half) {
    if (ZP)
      zero_point = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 64 + 8 * half))));
  }
  static inline __m256i prepare(__m256i group) {
    if (ZP || Q == QuantCode::kE2M1) return group;
    return _mm256_xor_si256(group, _mm256_set1_epi32(static_cast<int>(Q == QuantCode::kInt8 ? 0x80808080u : 0x88888888u)));
  }
  inline __m256 row(__m256i group, int i) const {
    const int low_bit = Q == QuantCode::kInt8 ? 8 * i : i < 4 ? 8 * i : 8 * (i - 4) + 4;
    const int bits = Q == QuantCode::kInt8 ? 8 : 4;
    if (Q == QuantCode::kE2M1) {
      const __m256i codes = _mm256_srli_epi32(group, low_bit);
      const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1Values), codes);  // reads codes & 7
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
      return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
    }
    if (!ZP)  // the signed field at low_bit
      return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(group, 32 - bits - low_bit), 32 - bits));
    const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(group, low_bit), _mm256_set1_epi32((1 << bits) - 1));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(codes), zero_point);
  }
};

// Half h (columns 8h to 8h + 7) of a block's scales as fp32: its header's (E2M1: the E8M0 bytes widened,
// e8m0_scale_bits).
template <QuantCode Q>
inline __m256 block_scales(const uint8_t* block, int h) {
  if (Q != QuantCode::kE2M1) return _mm256_loadu_ps(reinterpret_cast<const float*>(block) + 8 * h);
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * h)));
  __m256i bits = _mm256_slli_epi32(s, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(static_cast<int>(kE8M0Zero)),
                            _mm256_cmpeq_epi32(s, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(static_cast<int>(kE8M0NaN)),
                            _mm256_cmpeq_epi32(s, _mm256_set1_epi32(255)));
  return _mm256_castsi256_ps(bits);
}

// MR rows x one panel; each row of the panel decoded once for the MR rows.
template <QuantCode Q, bool ZP, int MR>
void fused_panel(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* panel, float* C, int64_t ldc) {
  constexpr int G = quant_group_rows(Q);
  __m256 acc[MR][2], dot[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t block_bytes = layout.block_bytes(), blocks = layout.blocks(), groups = layout.groups_per_block();
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
    const uint8_t* block = panel + b * block_bytes;
    const uint8_t* codes = block + quant_header_bytes(Q, ZP);
    const Decoder<Q, ZP> d0(block, 0), d1(block, 1);
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i* group = reinterpret_cast<const __m256i*>(codes + g * kQuantGroupBytes);
      const __m256i lo = Decoder<Q, ZP>::prepare(_mm256_loadu_si256(group));
      const __m256i hi = Decoder<Q, ZP>::prepare(_mm256_loadu_si256(group + 1));
      const int64_t k0 = b * layout.block + g * G;
      const int rows = layout.block - g * G < G ? static_cast<int>(layout.block - g * G) : G;
#pragma GCC unroll 8
      for (int i = 0; i < rows; ++i) {
        const __m256 w0 = d0.row(lo, i), w1 = d1.row(hi, i);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256 a = _mm256_broadcast_ss(A + r * lda + k0 + i);
          dot[r][0] = _mm256_fmadd_ps(a, w0, dot[r][0]);
          dot[r][1] = _mm256_fmadd_ps(a, w1, dot[r][1]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = block_scales<Q>(block, h);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][h] = _mm256_fmadd_ps(scale, dot[r][h], acc[r][h]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(C + r * ldc, acc[r][0]);
    _mm256_storeu_ps(C + r * ldc + 8, acc[r][1]);
  }
}

template <QuantCode Q, bool ZP>
void decode(const QuantPanels& layout, const uint8_t* block, float* out) {
  constexpr int G = quant_group_rows(Q);
  const Decoder<Q, ZP> d[2] = {Decoder<Q, ZP>(block, 0), Decoder<Q, ZP>(block, 1)};
  const __m256 scales[2] = {block_scales<Q>(block, 0), block_scales<Q>(block, 1)};
  const uint8_t* codes = block + layout.header_bytes();
  for (int64_t kk = 0; kk < layout.block; ++kk) {
    const __m256i* group = reinterpret_cast<const __m256i*>(codes + (kk / G) * kQuantGroupBytes);
    for (int h = 0; h < 2; ++h) {
      const __m256 value = d[h].row(Decoder<Q, ZP>::prepare(_mm256_loadu_si256(group + h)), static_cast<int>(kk % G));
      _mm256_storeu_ps(out + kk * kPanel + 8 * h, _mm256_mul_ps(value, scales[h]));
    }
  }
}

}  // namespace

void quant_fused_avx2(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  with_decoder(layout, [&](auto q, auto zp) {
    for_fused_panels(layout, M, B, p0, p1, C, [&](auto rows, const uint8_t* panel, float* Cp) {
      fused_panel<q(), zp(), rows()>(layout, A, lda, panel, Cp, ldc);
    });
  });
}

void quant_decode_avx2(const QuantPanels& layout, const uint8_t* block, float* out) {
  with_decoder(layout, [&](auto q, auto zp) { decode<q(), zp()>(layout, block, out); });
}

}  // namespace detail
}  // namespace moe_onnx
