// AVX-512 kernels of quant_gemm_panels (qgemm.h) at accuracy level 0; this file alone is compiled
// with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma and is only called after a run-time check.
//
// A 64-byte group of codes is one zmm: its 32-bit lane c holds column c's codes of G rows. Row i of a
// 4-bit group is one shift and one vpermps (which reads only the low 4 bits of each lane's index)
// over the 16 code values; row i of an 8-bit group a shift, a mask and a conversion. One FMA per row
// of A then adds it into the block's dots; at the block's end the scale and zero point apply once.
#include <immintrin.h>

#include <utility>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

constexpr int group_rows(QuantCode Q) { return Q == QuantCode::kInt8 ? 4 : 8; }

// Row I of a group as fp32 code values (`values`: the 4-bit codes' table).
template <QuantCode Q, int I>
inline __m512 row_values(__m512i group, __m512 values) {
  if (Q == QuantCode::kInt8) {
    const __m512i shifted = I == 0 ? group : _mm512_srli_epi32(group, 8 * I);
    return _mm512_cvtepi32_ps(I == 3 ? shifted : _mm512_and_si512(shifted, _mm512_set1_epi32(0xff)));
  }
  constexpr int shift = I < 4 ? 8 * I : 8 * (I - 4) + 4;
  return _mm512_permutexvar_ps(shift == 0 ? group : _mm512_srli_epi32(group, shift), values);
}

// The row of a partial group (a per-column block's last), its index known at run time.
template <QuantCode Q>
inline __m512 row_values(__m512i group, int i, __m512 values) {
  const int shift = Q == QuantCode::kInt8 ? 8 * i : i < 4 ? 8 * i : 8 * (i - 4) + 4;
  const __m512i shifted = _mm512_srlv_epi32(group, _mm512_set1_epi32(shift));
  if (Q == QuantCode::kInt8) return _mm512_cvtepi32_ps(_mm512_and_si512(shifted, _mm512_set1_epi32(0xff)));
  return _mm512_permutexvar_ps(shifted, values);
}

template <QuantCode Q>
inline __m512 code_values() {
  return _mm512_loadu_ps(Q == QuantCode::kE2M1 ? kE2M1Values : kInt4Values);
}

// The header's zero points as floats (int codes).
inline __m512 zero_points(const QuantPanels& layout, const uint8_t* header) {
  if (!layout.zero_points) return _mm512_set1_ps(static_cast<float>(layout.default_zero_point()));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 64))));
}

// acc = fma(scale, dot - zp * sum, acc) (mxfp4: fma(scale, dot, acc)), as quant_combine_portable.
template <QuantCode Q>
inline __m512 combine(__m512 acc, __m512 dot, __m512 scale, __m512 zero_point, float sum) {
  const __m512 centred = Q == QuantCode::kE2M1 ? dot : _mm512_fnmadd_ps(zero_point, _mm512_set1_ps(sum), dot);
  return _mm512_fmadd_ps(scale, centred, acc);
}

// MR rows x NP panels: the block's dots and the result, both in registers.
template <QuantCode Q, int MR, int NP>
struct Tile {
  __m512 acc[MR][NP], dot[MR][NP];
  const float* A;
  int64_t lda;

  inline void step(const __m512 (&w)[NP], int64_t k) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) dot[r][j] = _mm512_fmadd_ps(a, w[j], dot[r][j]);
    }
  }
  template <int I>
  inline void row(const __m512i (&g)[NP], __m512 values, int64_t k0) {
    __m512 w[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) w[j] = row_values<Q, I>(g[j], values);
    step(w, k0 + I);
  }
  template <int... I>
  inline void group(const __m512i (&g)[NP], __m512 values, int64_t k0, std::integer_sequence<int, I...>) {
    (row<I>(g, values, k0), ...);
  }
};

template <QuantCode Q, int MR, int NP>
void fused_tile(const QuantPanels& layout, const float* A, int64_t lda, const float* sums, const uint8_t* B, float* C,
                int64_t ldc) {
  constexpr int G = group_rows(Q);
  Tile<Q, MR, NP> t;
  t.A = A;
  t.lda = lda;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) t.acc[r][j] = _mm512_setzero_ps();
  const __m512 values = code_values<Q>();
  const int64_t panel_bytes = layout.panel_bytes(), blocks = layout.blocks();
  const int64_t full = layout.block / G, rest = layout.block % G;
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) t.dot[r][j] = _mm512_setzero_ps();
    const uint8_t* block = B + b * layout.block_bytes();
    const uint8_t* codes = block + layout.header_bytes();
    const int64_t k0 = b * layout.block;
    for (int64_t g = 0; g < full; ++g) {
      __m512i group[NP];
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) group[j] = _mm512_loadu_si512(codes + j * panel_bytes + g * kQuantGroupBytes);
      t.group(group, values, k0 + g * G, std::make_integer_sequence<int, G>{});
    }
    if (rest) {
      __m512i group[NP];
      for (int j = 0; j < NP; ++j) group[j] = _mm512_loadu_si512(codes + j * panel_bytes + full * kQuantGroupBytes);
      for (int i = 0; i < rest; ++i) {
        __m512 w[NP];
        for (int j = 0; j < NP; ++j) w[j] = row_values<Q>(group[j], i, values);
        t.step(w, k0 + full * G + i);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const uint8_t* header = block + j * panel_bytes;
      const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
      const __m512 zero_point = Q == QuantCode::kE2M1 ? _mm512_setzero_ps() : zero_points(layout, header);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        t.acc[r][j] = combine<Q>(t.acc[r][j], t.dot[r][j], scale, zero_point, sums[r * blocks + b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(C + r * ldc + j * kPanel, t.acc[r][j]);
}

// Panels [p0, p1) for MR rows: four panels at a time for one row, two for two to four (the
// accumulators and dots fit the 32 registers), then one.
template <QuantCode Q, int MR>
void fused_rows(const QuantPanels& layout, const float* A, int64_t lda, const float* sums, const uint8_t* B, int64_t p0,
                int64_t p1, float* C, int64_t ldc) {
  const int64_t panel_bytes = layout.panel_bytes();
  int64_t p = p0;
  if (MR == 1)
    for (; p + 4 <= p1; p += 4)
      fused_tile<Q, MR, 4>(layout, A, lda, sums, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
  for (; p + 2 <= p1; p += 2) fused_tile<Q, MR, 2>(layout, A, lda, sums, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
  if (p < p1) fused_tile<Q, MR, 1>(layout, A, lda, sums, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
}

template <QuantCode Q>
void fused(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const float* sums, const uint8_t* B,
           int64_t p0, int64_t p1, float* C, int64_t ldc) {
  switch (M) {
    case 1: return fused_rows<Q, 1>(layout, A, lda, sums, B, p0, p1, C, ldc);
    case 2: return fused_rows<Q, 2>(layout, A, lda, sums, B, p0, p1, C, ldc);
    case 3: return fused_rows<Q, 3>(layout, A, lda, sums, B, p0, p1, C, ldc);
    default: return fused_rows<Q, 4>(layout, A, lda, sums, B, p0, p1, C, ldc);
  }
}

template <QuantCode Q>
void decode(const QuantPanels& layout, const uint8_t* block, float* out) {
  constexpr int G = group_rows(Q);
  const __m512 values = code_values<Q>();
  const uint8_t* codes = block + layout.header_bytes();
  for (int64_t kk = 0; kk < layout.block; ++kk) {
    const __m512i group = _mm512_loadu_si512(codes + (kk / G) * kQuantGroupBytes);
    _mm512_storeu_ps(out + kk * kPanel, row_values<Q>(group, static_cast<int>(kk % G), values));
  }
}

template <QuantCode Q>
void combine_block(const QuantPanels& layout, const uint8_t* block, int64_t panels, const float* dots, int64_t ld_dots,
                   const float* sums, int64_t M, float* C, int64_t ldc) {
  for (int64_t j = 0; j < panels; ++j) {
    const uint8_t* header = block + j * layout.panel_bytes();
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
    const __m512 zero_point = Q == QuantCode::kE2M1 ? _mm512_setzero_ps() : zero_points(layout, header);
    for (int64_t m = 0; m < M; ++m) {
      float* out = C + m * ldc + j * kPanel;
      _mm512_storeu_ps(out, combine<Q>(_mm512_loadu_ps(out), _mm512_loadu_ps(dots + m * ld_dots + j * kPanel), scale,
                                       zero_point, sums[m * layout.blocks()]));
    }
  }
}

}  // namespace

void quant_fused_avx512(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const float* sums,
                        const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc) {
  switch (layout.code) {
    case QuantCode::kInt4: return fused<QuantCode::kInt4>(layout, A, lda, M, sums, B, p0, p1, C, ldc);
    case QuantCode::kInt8: return fused<QuantCode::kInt8>(layout, A, lda, M, sums, B, p0, p1, C, ldc);
    case QuantCode::kE2M1: return fused<QuantCode::kE2M1>(layout, A, lda, M, sums, B, p0, p1, C, ldc);
  }
}

void quant_decode_avx512(const QuantPanels& layout, const uint8_t* block, float* out) {
  switch (layout.code) {
    case QuantCode::kInt4: return decode<QuantCode::kInt4>(layout, block, out);
    case QuantCode::kInt8: return decode<QuantCode::kInt8>(layout, block, out);
    case QuantCode::kE2M1: return decode<QuantCode::kE2M1>(layout, block, out);
  }
}

void quant_combine_avx512(const QuantPanels& layout, const uint8_t* block, int64_t panels, const float* dots,
                          int64_t ld_dots, const float* sums, int64_t M, float* C, int64_t ldc) {
  switch (layout.code) {
    case QuantCode::kInt4: return combine_block<QuantCode::kInt4>(layout, block, panels, dots, ld_dots, sums, M, C, ldc);
    case QuantCode::kInt8: return combine_block<QuantCode::kInt8>(layout, block, panels, dots, ld_dots, sums, M, C, ldc);
    case QuantCode::kE2M1: return combine_block<QuantCode::kE2M1>(layout, block, panels, dots, ld_dots, sums, M, C, ldc);
  }
}

}  // namespace detail
}  // namespace moe_onnx
