// AVX2 + FMA kernels of quant_gemm_panels (qgemm.h) at accuracy level 0; this file alone is compiled
// with -mavx2 -mfma -mf16c and is only called after a run-time check of the CPU.
//
// A 64-byte group of codes is two ymm (columns 0-7, 8-15); row i of the group is a shift and a mask
// per 32-bit lane, dequantized exactly as the AVX-512 kernel does (E2M1: vpermps over the 8
// magnitudes, the sign bit moved in from the code's bit 3). One panel at a time: 2 x MR accumulators.
#include <immintrin.h>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

template <QuantCode Q>
inline __m256i row_codes(__m256i group, int i) {
  if (Q == QuantCode::kInt8) return _mm256_and_si256(_mm256_srli_epi32(group, 8 * i), _mm256_set1_epi32(0xff));
  const int shift = i < 4 ? 8 * i : 8 * (i - 4) + 4;
  return _mm256_and_si256(_mm256_srli_epi32(group, shift), _mm256_set1_epi32(0xf));
}

struct BlockScale {
  __m256 scale[2];
  __m256i zero_point[2];
};

template <QuantCode Q>
inline BlockScale block_scale(const QuantPanels& layout, const uint8_t* block) {
  BlockScale s;
  for (int h = 0; h < 2; ++h) {
    s.scale[h] = _mm256_loadu_ps(reinterpret_cast<const float*>(block) + 8 * h);
    if (Q != QuantCode::kE2M1 && layout.zero_points)
      s.zero_point[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 64 + 8 * h)));
    else
      s.zero_point[h] = _mm256_set1_epi32(Q == QuantCode::kE2M1 ? 0 : layout.default_zero_point());
  }
  return s;
}

template <QuantCode Q>
inline __m256 dequantize(__m256i codes, __m256 scale, __m256i zero_point) {
  if (Q == QuantCode::kE2M1) {
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1Values), codes);  // uses codes & 7
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign)), scale);
  }
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(codes, zero_point)), scale);
}

// MR rows x one panel; the k loop in groups, each row dequantized once for the MR rows.
template <QuantCode Q, int MR>
void fused_panel(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* panel, float* C, int64_t ldc) {
  constexpr int G = Q == QuantCode::kInt8 ? 4 : 8;
  __m256 acc[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < layout.blocks(); ++b) {
    const uint8_t* block = panel + b * layout.block_bytes();
    const BlockScale s = block_scale<Q>(layout, block);
    const uint8_t* codes = block + layout.header_bytes();
    for (int64_t g = 0; g < layout.groups_per_block(); ++g) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kQuantGroupBytes));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kQuantGroupBytes + 32));
      const int64_t k0 = b * layout.block + g * G;
      const int rows = layout.block - g * G < G ? static_cast<int>(layout.block - g * G) : G;
#pragma GCC unroll 8
      for (int i = 0; i < rows; ++i) {
        const __m256 w0 = dequantize<Q>(row_codes<Q>(lo, i), s.scale[0], s.zero_point[0]);
        const __m256 w1 = dequantize<Q>(row_codes<Q>(hi, i), s.scale[1], s.zero_point[1]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256 a = _mm256_broadcast_ss(A + r * lda + k0 + i);
          acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(C + r * ldc, acc[r][0]);
    _mm256_storeu_ps(C + r * ldc + 8, acc[r][1]);
  }
}

template <QuantCode Q>
void fused(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0, int64_t p1,
           float* C, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = B + p * layout.panel_bytes();
    float* Cp = C + (p - p0) * kPanel;
    switch (M) {
      case 1: fused_panel<Q, 1>(layout, A, lda, panel, Cp, ldc); break;
      case 2: fused_panel<Q, 2>(layout, A, lda, panel, Cp, ldc); break;
      case 3: fused_panel<Q, 3>(layout, A, lda, panel, Cp, ldc); break;
      default: fused_panel<Q, 4>(layout, A, lda, panel, Cp, ldc); break;
    }
  }
}

template <QuantCode Q>
void decode(const QuantPanels& layout, const uint8_t* panel, float* out) {
  constexpr int G = Q == QuantCode::kInt8 ? 4 : 8;
  for (int64_t b = 0; b < layout.blocks(); ++b) {
    const uint8_t* block = panel + b * layout.block_bytes();
    const BlockScale s = block_scale<Q>(layout, block);
    const uint8_t* codes = block + layout.header_bytes();
    float* rows = out + b * layout.block * kPanel;
    for (int64_t kk = 0; kk < layout.block; ++kk) {
      const uint8_t* group = codes + (kk / G) * kQuantGroupBytes;
      for (int h = 0; h < 2; ++h) {
        const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * h));
        _mm256_storeu_ps(rows + kk * kPanel + 8 * h,
                         dequantize<Q>(row_codes<Q>(lanes, static_cast<int>(kk % G)), s.scale[h], s.zero_point[h]));
      }
    }
  }
}

}  // namespace

void quant_fused_avx2(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  switch (layout.code) {
    case QuantCode::kInt4: return fused<QuantCode::kInt4>(layout, A, lda, M, B, p0, p1, C, ldc);
    case QuantCode::kInt8: return fused<QuantCode::kInt8>(layout, A, lda, M, B, p0, p1, C, ldc);
    case QuantCode::kE2M1: return fused<QuantCode::kE2M1>(layout, A, lda, M, B, p0, p1, C, ldc);
  }
}

void quant_decode_avx2(const QuantPanels& layout, const uint8_t* panel, float* out) {
  switch (layout.code) {
    case QuantCode::kInt4: return decode<QuantCode::kInt4>(layout, panel, out);
    case QuantCode::kInt8: return decode<QuantCode::kInt8>(layout, panel, out);
    case QuantCode::kE2M1: return decode<QuantCode::kE2M1>(layout, panel, out);
  }
}

}  // namespace detail
}  // namespace moe_onnx
