// AVX2 + FMA kernels of quant_gemm_panels (qgemm.h) at accuracy level 0; this file alone is compiled
// with -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
//
// A 64-byte group of codes is two ymm (columns 0-7, 8-15); row i of the group is a shift, a mask and
// a conversion per 32-bit lane (E2M1: vpermps over the 8 magnitudes, the sign bit moved in from the
// code's bit 3), the same code values as the AVX-512 kernel. One panel at a time: MR x 2 dots and
// MR x 2 results in registers; the block's scale and zero point apply at its end.
#include <immintrin.h>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// Row i of a group's 8 lanes as fp32 code values.
template <QuantCode Q>
inline __m256 row_values(__m256i group, int i) {
  const int shift = Q == QuantCode::kInt8 ? 8 * i : i < 4 ? 8 * i : 8 * (i - 4) + 4;
  const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(group, shift), _mm256_set1_epi32(Q == QuantCode::kInt8 ? 0xff : 0xf));
  if (Q != QuantCode::kE2M1) return _mm256_cvtepi32_ps(codes);
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1Values), codes);  // reads codes & 7
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}

// The header's scales and zero points (as floats) of 8 columns from `half` * 8.
struct HalfHeader {
  __m256 scale, zero_point;
};
inline HalfHeader half_header(const QuantPanels& layout, const uint8_t* header, int half) {
  HalfHeader h;
  h.scale = _mm256_loadu_ps(reinterpret_cast<const float*>(header) + 8 * half);
  h.zero_point = layout.zero_points ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                          reinterpret_cast<const __m128i*>(header + 64 + 8 * half))))
                                    : _mm256_set1_ps(static_cast<float>(layout.default_zero_point()));
  return h;
}

// acc = fma(scale, dot - zp * sum, acc) (mxfp4: fma(scale, dot, acc)), as quant_combine_portable.
template <QuantCode Q>
inline __m256 combine(__m256 acc, __m256 dot, const HalfHeader& h, float sum) {
  const __m256 centred = Q == QuantCode::kE2M1 ? dot : _mm256_fnmadd_ps(h.zero_point, _mm256_set1_ps(sum), dot);
  return _mm256_fmadd_ps(h.scale, centred, acc);
}

// MR rows x one panel; each row of the panel decoded once for the MR rows.
template <QuantCode Q, int MR>
void fused_panel(const QuantPanels& layout, const float* A, int64_t lda, const float* sums, const uint8_t* panel,
                 float* C, int64_t ldc) {
  constexpr int G = Q == QuantCode::kInt8 ? 4 : 8;
  __m256 acc[MR][2], dot[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t blocks = layout.blocks();
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
    const uint8_t* block = panel + b * layout.block_bytes();
    const uint8_t* codes = block + layout.header_bytes();
    for (int64_t g = 0; g < layout.groups_per_block(); ++g) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kQuantGroupBytes));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kQuantGroupBytes + 32));
      const int64_t k0 = b * layout.block + g * G;
      const int rows = layout.block - g * G < G ? static_cast<int>(layout.block - g * G) : G;
#pragma GCC unroll 8
      for (int i = 0; i < rows; ++i) {
        const __m256 w0 = row_values<Q>(lo, i), w1 = row_values<Q>(hi, i);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256 a = _mm256_broadcast_ss(A + r * lda + k0 + i);
          dot[r][0] = _mm256_fmadd_ps(a, w0, dot[r][0]);
          dot[r][1] = _mm256_fmadd_ps(a, w1, dot[r][1]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const HalfHeader header = half_header(layout, block, h);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][h] = combine<Q>(acc[r][h], dot[r][h], header, sums[r * blocks + b]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(C + r * ldc, acc[r][0]);
    _mm256_storeu_ps(C + r * ldc + 8, acc[r][1]);
  }
}

template <QuantCode Q>
void fused(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const float* sums, const uint8_t* B,
           int64_t p0, int64_t p1, float* C, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = B + p * layout.panel_bytes();
    float* Cp = C + (p - p0) * kPanel;
    switch (M) {
      case 1: fused_panel<Q, 1>(layout, A, lda, sums, panel, Cp, ldc); break;
      case 2: fused_panel<Q, 2>(layout, A, lda, sums, panel, Cp, ldc); break;
      case 3: fused_panel<Q, 3>(layout, A, lda, sums, panel, Cp, ldc); break;
      default: fused_panel<Q, 4>(layout, A, lda, sums, panel, Cp, ldc); break;
    }
  }
}

template <QuantCode Q>
void decode(const QuantPanels& layout, const uint8_t* block, float* out) {
  constexpr int G = Q == QuantCode::kInt8 ? 4 : 8;
  const uint8_t* codes = block + layout.header_bytes();
  for (int64_t kk = 0; kk < layout.block; ++kk) {
    const uint8_t* group = codes + (kk / G) * kQuantGroupBytes;
    for (int h = 0; h < 2; ++h) {
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * h));
      _mm256_storeu_ps(out + kk * kPanel + 8 * h, row_values<Q>(lanes, static_cast<int>(kk % G)));
    }
  }
}

template <QuantCode Q>
void combine_block(const QuantPanels& layout, const uint8_t* block, int64_t panels, const float* dots, int64_t ld_dots,
                   const float* sums, int64_t M, float* C, int64_t ldc) {
  for (int64_t j = 0; j < panels; ++j)
    for (int h = 0; h < 2; ++h) {
      const HalfHeader header = half_header(layout, block + j * layout.panel_bytes(), h);
      for (int64_t m = 0; m < M; ++m) {
        float* out = C + m * ldc + j * kPanel + 8 * h;
        _mm256_storeu_ps(out, combine<Q>(_mm256_loadu_ps(out), _mm256_loadu_ps(dots + m * ld_dots + j * kPanel + 8 * h),
                                         header, sums[m * layout.blocks()]));
      }
    }
}

}  // namespace

void quant_fused_avx2(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const float* sums,
                      const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc) {
  switch (layout.code) {
    case QuantCode::kInt4: return fused<QuantCode::kInt4>(layout, A, lda, M, sums, B, p0, p1, C, ldc);
    case QuantCode::kInt8: return fused<QuantCode::kInt8>(layout, A, lda, M, sums, B, p0, p1, C, ldc);
    case QuantCode::kE2M1: return fused<QuantCode::kE2M1>(layout, A, lda, M, sums, B, p0, p1, C, ldc);
  }
}

void quant_decode_avx2(const QuantPanels& layout, const uint8_t* block, float* out) {
  switch (layout.code) {
    case QuantCode::kInt4: return decode<QuantCode::kInt4>(layout, block, out);
    case QuantCode::kInt8: return decode<QuantCode::kInt8>(layout, block, out);
    case QuantCode::kE2M1: return decode<QuantCode::kE2M1>(layout, block, out);
  }
}

void quant_combine_avx2(const QuantPanels& layout, const uint8_t* block, int64_t panels, const float* dots,
                        int64_t ld_dots, const float* sums, int64_t M, float* C, int64_t ldc) {
  switch (layout.code) {
    case QuantCode::kInt4: return combine_block<QuantCode::kInt4>(layout, block, panels, dots, ld_dots, sums, M, C, ldc);
    case QuantCode::kInt8: return combine_block<QuantCode::kInt8>(layout, block, panels, dots, ld_dots, sums, M, C, ldc);
    case QuantCode::kE2M1: return combine_block<QuantCode::kE2M1>(layout, block, panels, dots, ld_dots, sums, M, C, ldc);
  }
}

}  // namespace detail
}  // namespace moe_onnx
