// AVX-512 kernels of quant_gemm_panels (qgemm.h) at accuracy level 0; this file alone is compiled
// with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma and is only called after a run-time check.
//
// A 64-byte group of codes is one zmm: its 32-bit lane c holds column c's codes of G rows, so row i
// is (lane >> shift_i) & mask, then float(code - zp) * scale (int) or e2m1[code] * scale (one
// vpermps over the 16 values) gives the dequantized row exactly, and one FMA per row of A uses it.
#include <immintrin.h>

#include <utility>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// Row I of a group, as 16 int32 codes.
template <QuantCode Q, int I>
inline __m512i row_codes(__m512i group) {
  if (Q == QuantCode::kInt8) return _mm512_and_si512(_mm512_srli_epi32(group, 8 * I), _mm512_set1_epi32(0xff));
  constexpr int shift = I < 4 ? 8 * I : 8 * (I - 4) + 4;
  return _mm512_and_si512(_mm512_srli_epi32(group, shift), _mm512_set1_epi32(0xf));
}

// The row of a partial group (a per-column block's last), its index at run time.
template <QuantCode Q>
inline __m512i row_codes(__m512i group, int i) {
  if (Q == QuantCode::kInt8) return _mm512_and_si512(_mm512_srlv_epi32(group, _mm512_set1_epi32(8 * i)), _mm512_set1_epi32(0xff));
  const int shift = i < 4 ? 8 * i : 8 * (i - 4) + 4;
  return _mm512_and_si512(_mm512_srlv_epi32(group, _mm512_set1_epi32(shift)), _mm512_set1_epi32(0xf));
}

// A block's dequantization: the column scales and zero points (or the E2M1 table).
struct BlockScale {
  __m512 scale;
  __m512i zero_point;
};

template <QuantCode Q>
inline BlockScale block_scale(const QuantPanels& layout, const uint8_t* block) {
  BlockScale s;
  s.scale = _mm512_loadu_ps(block);
  if (Q == QuantCode::kE2M1)
    s.zero_point = _mm512_setzero_si512();
  else if (layout.zero_points)
    s.zero_point = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64)));
  else
    s.zero_point = _mm512_set1_epi32(layout.default_zero_point());
  return s;
}

template <QuantCode Q>
inline __m512 dequantize(__m512i codes, const BlockScale& s) {
  if (Q == QuantCode::kE2M1) return _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_loadu_ps(kE2M1Values)), s.scale);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(codes, s.zero_point)), s.scale);
}

// MR rows x NP panels, accumulators in registers (indexed by constants only after unrolling).
template <QuantCode Q, int MR, int NP>
struct Tile {
  __m512 acc[MR][NP];
  const float* A;
  int64_t lda;

  // One row k of the panels (w[j]) times A[., k] into the accumulators.
  inline void step(const __m512 (&w)[NP], int64_t k) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(a, w[j], acc[r][j]);
    }
  }
  template <int... I>
  inline void full_group(const __m512i (&g)[NP], const BlockScale (&s)[NP], int64_t k0, std::integer_sequence<int, I...>) {
    (row<I>(g, s, k0), ...);
  }
  template <int I>
  inline void row(const __m512i (&g)[NP], const BlockScale (&s)[NP], int64_t k0) {
    __m512 w[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) w[j] = dequantize<Q>(row_codes<Q, I>(g[j]), s[j]);
    step(w, k0 + I);
  }
};

template <QuantCode Q, int MR, int NP>
void fused_tile(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* B, float* C, int64_t ldc) {
  constexpr int G = Q == QuantCode::kInt8 ? 4 : 8;
  Tile<Q, MR, NP> t;
  t.A = A;
  t.lda = lda;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) t.acc[r][j] = _mm512_setzero_ps();
  const int64_t panel_bytes = layout.panel_bytes(), block_bytes = layout.block_bytes();
  const int64_t groups = layout.groups_per_block();
  for (int64_t b = 0; b < layout.blocks(); ++b) {
    const uint8_t* block = B + b * block_bytes;
    BlockScale s[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) s[j] = block_scale<Q>(layout, block + j * panel_bytes);
    const uint8_t* codes = block + layout.header_bytes();
    const int64_t full = layout.block / G;
    for (int64_t g = 0; g < full; ++g) {
      __m512i group[NP];
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) group[j] = _mm512_loadu_si512(codes + j * panel_bytes + g * kQuantGroupBytes);
      t.full_group(group, s, b * layout.block + g * G, std::make_integer_sequence<int, G>{});
    }
    if (full < groups) {  // the partial last group of a per-column block
      __m512i group[NP];
      for (int j = 0; j < NP; ++j) group[j] = _mm512_loadu_si512(codes + j * panel_bytes + full * kQuantGroupBytes);
      for (int i = 0; i < layout.block - full * G; ++i) {
        __m512 w[NP];
        for (int j = 0; j < NP; ++j) w[j] = dequantize<Q>(row_codes<Q>(group[j], i), s[j]);
        t.step(w, b * layout.block + full * G + i);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(C + r * ldc + j * kPanel, t.acc[r][j]);
}

// Panels [p0, p1) for MR rows: four panels at a time for one or two rows (four weight streams),
// two for three or four (the accumulators fit the 32 registers), then one.
template <QuantCode Q, int MR>
void fused_rows(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* B, int64_t p0, int64_t p1,
                float* C, int64_t ldc) {
  const int64_t panel_bytes = layout.panel_bytes();
  int64_t p = p0;
  if (MR <= 2)
    for (; p + 4 <= p1; p += 4) fused_tile<Q, MR, 4>(layout, A, lda, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
  for (; p + 2 <= p1; p += 2) fused_tile<Q, MR, 2>(layout, A, lda, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
  if (p < p1) fused_tile<Q, MR, 1>(layout, A, lda, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
}

template <QuantCode Q>
void fused(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0, int64_t p1,
           float* C, int64_t ldc) {
  switch (M) {
    case 1: return fused_rows<Q, 1>(layout, A, lda, B, p0, p1, C, ldc);
    case 2: return fused_rows<Q, 2>(layout, A, lda, B, p0, p1, C, ldc);
    case 3: return fused_rows<Q, 3>(layout, A, lda, B, p0, p1, C, ldc);
    default: return fused_rows<Q, 4>(layout, A, lda, B, p0, p1, C, ldc);
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
      const __m512i group = _mm512_loadu_si512(codes + (kk / G) * kQuantGroupBytes);
      _mm512_storeu_ps(rows + kk * kPanel, dequantize<Q>(row_codes<Q>(group, static_cast<int>(kk % G)), s));
    }
  }
}

}  // namespace

void quant_fused_avx512(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0,
                        int64_t p1, float* C, int64_t ldc) {
  switch (layout.code) {
    case QuantCode::kInt4: return fused<QuantCode::kInt4>(layout, A, lda, M, B, p0, p1, C, ldc);
    case QuantCode::kInt8: return fused<QuantCode::kInt8>(layout, A, lda, M, B, p0, p1, C, ldc);
    case QuantCode::kE2M1: return fused<QuantCode::kE2M1>(layout, A, lda, M, B, p0, p1, C, ldc);
  }
}

void quant_decode_avx512(const QuantPanels& layout, const uint8_t* panel, float* out) {
  switch (layout.code) {
    case QuantCode::kInt4: return decode<QuantCode::kInt4>(layout, panel, out);
    case QuantCode::kInt8: return decode<QuantCode::kInt8>(layout, panel, out);
    case QuantCode::kE2M1: return decode<QuantCode::kE2M1>(layout, panel, out);
  }
}

}  // namespace detail
}  // namespace moe_onnx
