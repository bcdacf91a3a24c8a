// AVX-512 kernels of quant_gemm_panels (qgemm.h) at accuracy level 0; this file alone is compiled
// with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma and is only called after a run-time check.
//
// A 64-byte group of codes is one zmm: its 32-bit lane c holds column c's codes of G rows. Row i of a
// 4-bit group is one shift and one vpermps (which reads only the low 4 bits of each lane's index)
// over the 16 code values; row i of an 8-bit group two shifts and a conversion (Decoder). One FMA
// per row of A adds it into the block's dots; at the block's end the scale applies once.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <limits>
#include <type_traits>
#include <utility>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// How a block's rows become fp32 values v(q): the 4-bit codes' table (q, q - 8 or E2M1) and the zero
// points subtracted after it (ZP: explicit zero points), or for 8-bit codes without them the flip
// of each byte (q ^ 0x80 read as a signed byte is q - 128).
template <QuantCode Q, bool ZP>
struct Decoder {
  __m512 values;      // 4-bit codes
  __m512 zero_point;  // ZP

  explicit Decoder(const uint8_t* block) {
    values = _mm512_loadu_ps(Q == QuantCode::kE2M1 ? kE2M1Values : ZP ? kInt4Values : kInt4CentredValues);
    if (ZP)
      zero_point = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64))));
  }
  // A group as loaded, ready for row(): 8-bit codes without zero points flipped.
  static inline __m512i prepare(__m512i group) {
    return Q == QuantCode::kInt8 && !ZP ? _mm512_xor_si512(group, _mm512_set1_epi32(static_cast<int>(0x80808080u)))
                                        : group;
  }
  template <int I>
  inline __m512 row(__m512i group) const {
    __m512 v;
    if (Q == QuantCode::kInt8 && !ZP) {  // the signed byte I of each lane
      const __m512i high = I == 3 ? group : _mm512_slli_epi32(group, 24 - 8 * I);
      v = _mm512_cvtepi32_ps(_mm512_srai_epi32(high, 24));
    } else if (Q == QuantCode::kInt8) {
      const __m512i shifted = I == 0 ? group : _mm512_srli_epi32(group, 8 * I);
      v = _mm512_cvtepi32_ps(I == 3 ? shifted : _mm512_and_si512(shifted, _mm512_set1_epi32(0xff)));
    } else {  // vpermps reads the low 4 bits of each lane's index
      constexpr int shift = I < 4 ? 8 * I : 8 * (I - 4) + 4;
      v = _mm512_permutexvar_ps(shift == 0 ? group : _mm512_srli_epi32(group, shift), values);
    }
    return ZP ? _mm512_sub_ps(v, zero_point) : v;
  }
  // Row i of a group, i known at run time (a per-column block's partial last group, the decode path).
  inline __m512 row(__m512i group, int i) const {
    switch (i) {
      case 0: return row<0>(group);
      case 1: return row<1>(group);
      case 2: return row<2>(group);
      case 3: return row<3>(group);
      case 4: return row<4>(group);
      case 5: return row<5>(group);
      case 6: return row<6>(group);
      default: return row<7>(group);
    }
  }
};

// A block's 16 scales as fp32: its header's (E2M1: the E8M0 bytes widened, e8m0_scale_bits).
template <QuantCode Q>
inline __m512 block_scales(const uint8_t* block) {
  if (Q != QuantCode::kE2M1) return _mm512_loadu_ps(reinterpret_cast<const float*>(block));
  const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
  __m512i bits = _mm512_slli_epi32(s, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()),
                               _mm512_set1_epi32(static_cast<int>(kE8M0Zero)));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                               _mm512_set1_epi32(static_cast<int>(kE8M0NaN)));
  return _mm512_castsi512_ps(bits);
}

// The decoders of NP panels' blocks (panel j's block at block + j * panel_bytes).
template <QuantCode Q, bool ZP, int NP>
using Decoders = std::array<Decoder<Q, ZP>, NP>;
template <QuantCode Q, bool ZP, size_t... J>
inline Decoders<Q, ZP, sizeof...(J)> decoders(const uint8_t* block, int64_t panel_bytes, std::index_sequence<J...>) {
  return {Decoder<Q, ZP>(block + static_cast<int64_t>(J) * panel_bytes)...};
}

// MR rows x NP panels: the block's dots and the result, both in registers.
template <QuantCode Q, bool ZP, int MR, int NP>
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
  inline void row(const Decoders<Q, ZP, NP>& d, const __m512i (&g)[NP], int64_t k0) {
    __m512 w[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) w[j] = d[j].template row<I>(g[j]);
    step(w, k0 + I);
  }
  template <int... I>
  inline void group(const Decoders<Q, ZP, NP>& d, const __m512i (&g)[NP], int64_t k0,
                    std::integer_sequence<int, I...>) {
    (row<I>(d, g, k0), ...);
  }
};

template <QuantCode Q, bool ZP, int MR, int NP>
void fused_tile(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* B, float* C, int64_t ldc) {
  constexpr int G = quant_group_rows(Q);
  Tile<Q, ZP, MR, NP> t;
  t.A = A;
  t.lda = lda;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) t.acc[r][j] = _mm512_setzero_ps();
  const int64_t panel_bytes = layout.panel_bytes(), block_bytes = layout.block_bytes(), blocks = layout.blocks();
  const int64_t full = layout.block / G, rest = layout.block % G;
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) t.dot[r][j] = _mm512_setzero_ps();
    const uint8_t* block = B + b * block_bytes;
    const uint8_t* codes = block + quant_header_bytes(Q, ZP);
    const Decoders<Q, ZP, NP> d = decoders<Q, ZP>(block, panel_bytes, std::make_index_sequence<NP>{});
    const int64_t k0 = b * layout.block;
    for (int64_t g = 0; g < full; ++g) {
      __m512i group[NP];
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j)
        group[j] = Decoder<Q, ZP>::prepare(_mm512_loadu_si512(codes + j * panel_bytes + g * kQuantGroupBytes));
      t.group(d, group, k0 + g * G, std::make_integer_sequence<int, G>{});
    }
    if (rest) {
      __m512i group[NP];
      for (int j = 0; j < NP; ++j)
        group[j] = Decoder<Q, ZP>::prepare(_mm512_loadu_si512(codes + j * panel_bytes + full * kQuantGroupBytes));
      for (int i = 0; i < rest; ++i) {
        __m512 w[NP];
        for (int j = 0; j < NP; ++j) w[j] = d[j].row(group[j], i);
        t.step(w, k0 + full * G + i);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const __m512 scale = block_scales<Q>(block + j * panel_bytes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) t.acc[r][j] = _mm512_fmadd_ps(scale, t.dot[r][j], t.acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(C + r * ldc + j * kPanel, t.acc[r][j]);
}

// Panels [p0, p1) for MR rows: four panels at a time for one row, two for two to four (the
// accumulators and dots fit the 32 registers), then one.
template <QuantCode Q, bool ZP, int MR>
void fused_rows(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* B, int64_t p0, int64_t p1,
                float* C, int64_t ldc) {
  const int64_t panel_bytes = layout.panel_bytes();
  int64_t p = p0;
  if (MR == 1)
    for (; p + 4 <= p1; p += 4) fused_tile<Q, ZP, MR, 4>(layout, A, lda, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
  for (; p + 2 <= p1; p += 2) fused_tile<Q, ZP, MR, 2>(layout, A, lda, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
  if (p < p1) fused_tile<Q, ZP, MR, 1>(layout, A, lda, B + p * panel_bytes, C + (p - p0) * kPanel, ldc);
}

template <QuantCode Q, bool ZP>
void fused(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0, int64_t p1,
           float* C, int64_t ldc) {
  switch (M) {
    case 1: return fused_rows<Q, ZP, 1>(layout, A, lda, B, p0, p1, C, ldc);
    case 2: return fused_rows<Q, ZP, 2>(layout, A, lda, B, p0, p1, C, ldc);
    case 3: return fused_rows<Q, ZP, 3>(layout, A, lda, B, p0, p1, C, ldc);
    default: return fused_rows<Q, ZP, 4>(layout, A, lda, B, p0, p1, C, ldc);
  }
}

template <QuantCode Q, bool ZP>
void decode(const QuantPanels& layout, const uint8_t* block, float* out) {
  constexpr int G = quant_group_rows(Q);
  const Decoder<Q, ZP> d(block);
  const __m512 scale = block_scales<Q>(block);
  const uint8_t* codes = block + layout.header_bytes();
  for (int64_t kk = 0; kk < layout.block; ++kk) {
    const __m512i group = Decoder<Q, ZP>::prepare(_mm512_loadu_si512(codes + (kk / G) * kQuantGroupBytes));
    _mm512_storeu_ps(out + kk * kPanel, _mm512_mul_ps(d.row(group, static_cast<int>(kk % G)), scale));
  }
}

// add_dots on kCount blocks (the first kCount of d's): their scales (and zero points) held in registers,
// then row after row, the row's 16 sums in one register over the blocks in order.
template <bool kZeroPoints, int kCount>
void add_block_dots(const QuantBlockDots& d, float* out, int64_t ldc) {
  __m512 scale[kCount];
  __m512i zero_point[kCount];
  for (int i = 0; i < kCount; ++i) {
    const uint8_t* header = d.headers + i * d.header_stride;
    scale[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
    if (kZeroPoints)
      zero_point[i] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 64)));
  }
  for (int64_t m = 0; m < d.rows; ++m) {
    __m512 acc = _mm512_loadu_ps(out + m * ldc);
    const int32_t* sums = d.sums + m * d.stride;
    const float* sa = d.sa + m * d.stride;
#pragma GCC unroll 4
    for (int i = 0; i < kCount; ++i) {
      const __m512i correction =  // zp * sum per column, wrapping
          kZeroPoints ? _mm512_mullo_epi32(zero_point[i], _mm512_set1_epi32(sums[i]))
                      : _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(d.default_zero_point) *
                                                               static_cast<uint32_t>(sums[i])));
      const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(d.dots + i * d.block_stride + m * kPanel), correction);
      const __m512 factor = _mm512_mul_ps(_mm512_set1_ps(sa[i]), scale[i]);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(factor, _mm512_cvtepi32_ps(dot)));
    }
    _mm512_storeu_ps(out + m * ldc, acc);
  }
}

// QuantAddDotsFn with (kZeroPoints) or without zero points in the headers: four blocks at a time (each
// element still takes the blocks in order).
template <bool kZeroPoints>
void add_dots(const QuantBlockDots& d, float* out, int64_t ldc) {
  constexpr int64_t kHeld = 4;
  for (int64_t i = 0; i < d.count; i += kHeld) {
    QuantBlockDots part = d;
    part.count = std::min(kHeld, d.count - i);
    part.dots += i * d.block_stride;
    part.sums += i;
    part.sa += i;
    part.headers += i * d.header_stride;
    switch (part.count) {
      case 1: add_block_dots<kZeroPoints, 1>(part, out, ldc); break;
      case 2: add_block_dots<kZeroPoints, 2>(part, out, ldc); break;
      case 3: add_block_dots<kZeroPoints, 3>(part, out, ldc); break;
      default: add_block_dots<kZeroPoints, 4>(part, out, ldc);
    }
  }
}

}  // namespace

void quant_activations_avx512(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, int8_t* qa,
                              int64_t ldq, float* sa, int32_t* sums) {
  const int64_t blocks = layout.blocks(), block = layout.block;
  const int64_t padded = layout.activation_block();
  auto mask_of = [](int64_t n) {  // the first n of 16 lanes
    return static_cast<__mmask16>(n >= 16 ? 0xffff : n <= 0 ? 0 : (1u << n) - 1);
  };
  const __m512 limit = _mm512_set1_ps(127.0f), abs_bits = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* a = A + m * lda + b * block;
      int8_t* q = qa + m * ldq + b * padded;
      __m512 amax = _mm512_setzero_ps();
      __mmask16 nan = 0;
      for (int64_t k = 0; k < block; k += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(mask_of(block - k), a + k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_and_ps(v, abs_bits));
      }
      if (nan) {  // the portable loop: which NaN the scale gets is its rule
        quantize_activation_block(a, block, padded, q, sa + m * blocks + b, sums + m * blocks + b);
        continue;
      }
      const float s = _mm512_reduce_max_ps(amax) / 127.0f;
      const __m512 scale = _mm512_set1_ps(s);
      // a / s rounded to an integer from the product a * (1 / s) where that gives the same integer (s
      // normal and finite): with |a / s| < 128 the product is within 2^-16 of a / s, and a / s
      // rounded to fp32 within 2^-18 of it, so both round to one integer unless the product lies
      // within 2^-14 of a half: those 16 values take the division.
      const bool by_product = s >= std::numeric_limits<float>::min() && s <= std::numeric_limits<float>::max();
      const __m512 reciprocal = _mm512_set1_ps(1.0f / s), near_half = _mm512_set1_ps(0.5f - 0x1p-14f);
      __m512i total = _mm512_setzero_si512();
      for (int64_t k = 0; k < padded; k += 16) {
        const __mmask16 valid = s != 0.0f ? mask_of(block - k) : 0;
        // a / s rounded half to even (nearbyint); NaN (inf / inf) to 0, the rest clipped to +-127
        const __m512 x = _mm512_maskz_loadu_ps(valid, a + k), y = _mm512_mul_ps(x, reciprocal);
        __m512 v = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (!by_product || _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_sub_ps(y, v), abs_bits), near_half, _CMP_GT_OQ))
          v = _mm512_roundscale_ps(_mm512_div_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __mmask16 number = valid & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
        const __m512i values = _mm512_maskz_cvtps_epi32(number, v);
        total = _mm512_add_epi32(total, values);
        _mm_mask_storeu_epi8(q + k, mask_of(padded - k), _mm512_cvtepi32_epi8(values));
      }
      sa[m * blocks + b] = s;
      sums[m * blocks + b] = _mm512_reduce_add_epi32(total);
    }
}

void quant_code_rows_avx512(const QuantPanels& layout, const uint8_t* panel, int64_t block_k, uint8_t* rows) {
  // The codes' padding (past the block, to whole groups) is zero; past the groups, to block_k, too.
  const int64_t groups = layout.groups_per_block(), header_bytes = layout.header_bytes();
  const int64_t block_bytes = layout.block_bytes(), blocks = layout.blocks();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = panel + b * block_bytes + header_bytes;
    uint8_t* out = rows + b * block_k * kPanel;
    int64_t r = 0;
    if (layout.code == QuantCode::kInt8) {
      for (; r < groups; ++r) _mm512_storeu_si512(out + 64 * r, _mm512_loadu_si512(codes + r * kQuantGroupBytes));
    } else {
      const __m512i nibble = _mm512_set1_epi8(0x0f);
      for (int64_t g = 0; g < groups; ++g, r += 2) {
        const __m512i group = _mm512_loadu_si512(codes + g * kQuantGroupBytes);
        _mm512_storeu_si512(out + 64 * r, _mm512_and_si512(group, nibble));                             // rows 0-3
        _mm512_storeu_si512(out + 64 * (r + 1), _mm512_and_si512(_mm512_srli_epi16(group, 4), nibble));  // 4-7
      }
    }
    for (; r < block_k / 4; ++r) _mm512_storeu_si512(out + 64 * r, _mm512_setzero_si512());
  }
}

void quant_add_dots_avx512(const QuantBlockDots& d, float* out, int64_t ldc) {
  d.zero_points ? add_dots<true>(d, out, ldc) : add_dots<false>(d, out, ldc);
}

void quant_fused_avx512(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0,
                        int64_t p1, float* C, int64_t ldc) {
  with_decoder(layout, [&](auto q, auto zp) { fused<q(), zp()>(layout, A, lda, M, B, p0, p1, C, ldc); });
}

void quant_decode_avx512(const QuantPanels& layout, const uint8_t* block, float* out) {
  with_decoder(layout, [&](auto q, auto zp) { decode<q(), zp()>(layout, block, out); });
}

}  // namespace detail
}  // namespace moe_onnx
