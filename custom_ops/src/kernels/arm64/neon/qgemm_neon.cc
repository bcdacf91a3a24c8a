// Advanced SIMD kernels of quant_gemm_panels (qgemm.h) at accuracy level 0: the fused kernel of decode-size
// rows and the block decoder of the others, the x86 kernels' arithmetic (the same bits).
//
// A 64-byte group of codes is four q registers (columns 0-3, 4-7, 8-11, 12-15), each 32-bit lane a
// column's codes of the group's rows; row i of the group is a shift and a mask (or a sign-extending
// shift pair) per lane and a conversion, as in the x86 kernels (Decoder). E2M1 codes look their
// magnitude up in a table of 8 floats (TBL over 32 bytes) and take the code's bit 3 as the sign. Fused:
// per block the dot of each row with the block's values, one FMA chain in increasing k, then
// C = fma(scale, dot, C) over the blocks in order; up to 4 rows x one panel (16 dots, 16 sums).
#include <arm_neon.h>

#include <cstring>
#include <utility>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

// How a block's rows become fp32 values v(q), four columns (part j of the panel) at a time.
template <QuantCode Q, bool ZP>
struct Decoder {
  float32x4_t zero_point[4];  // ZP: the columns' zero points
  uint8x16x2_t magnitudes;    // E2M1: the bytes of the 8 magnitudes' floats

  explicit Decoder(const uint8_t* block) {
    if constexpr (ZP) {
      const uint16x8_t zp = vmovl_u8(vld1_u8(block + 64)), zp_high = vmovl_u8(vld1_u8(block + 72));
      zero_point[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(zp)));
      zero_point[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(zp)));
      zero_point[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(zp_high)));
      zero_point[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(zp_high)));
    }
    if constexpr (Q == QuantCode::kE2M1) {
      uint8_t table[32];
      std::memcpy(table, kE2M1Values, sizeof table);  // the positive half: codes 0-7
      magnitudes = {vld1q_u8(table), vld1q_u8(table + 16)};
    }
  }
  // Row i (0 <= i < G) of part j of a group.
  template <int I>
  inline float32x4_t row(uint32x4_t part, int j) const {
    if constexpr (Q == QuantCode::kE2M1) {
      constexpr int shift = I < 4 ? 8 * I : 8 * (I - 4) + 4;
      const uint32x4_t code = vandq_u32(vshrq_n_u32(part, shift), vdupq_n_u32(15));
      // byte b of lane: 4 * (code & 7) + b, the code's float in the table
      const uint32x4_t index = vmlaq_u32(vdupq_n_u32(0x03020100u), vandq_u32(code, vdupq_n_u32(7)), vdupq_n_u32(0x04040404u));
      const uint32x4_t magnitude = vreinterpretq_u32_u8(vqtbl2q_u8(magnitudes, vreinterpretq_u8_u32(index)));
      return vreinterpretq_f32_u32(vorrq_u32(magnitude, vshlq_n_u32(vandq_u32(code, vdupq_n_u32(8)), 28)));
    } else {
      constexpr int bits = Q == QuantCode::kInt8 ? 8 : 4;
      constexpr int low_bit = Q == QuantCode::kInt8 ? 8 * I : I < 4 ? 8 * I : 8 * (I - 4) + 4;
      if constexpr (!ZP) {  // the field as a signed one: q ^ (1 << (bits - 1)) is q - 2^(bits - 1)
        const uint32x4_t flipped = veorq_u32(part, vdupq_n_u32(Q == QuantCode::kInt8 ? 0x80808080u : 0x88888888u));
        const int32x4_t high = vreinterpretq_s32_u32(vshlq_n_u32(flipped, 32 - bits - low_bit));
        return vcvtq_f32_s32(vshrq_n_s32(high, 32 - bits));
      } else {
        const uint32x4_t code = vandq_u32(vshrq_n_u32(part, low_bit), vdupq_n_u32((1u << bits) - 1));
        return vsubq_f32(vcvtq_f32_u32(code), zero_point[j]);
      }
    }
  }
  inline float32x4_t row(uint32x4_t part, int j, int i) const {
    switch (i) {
      case 0: return row<0>(part, j);
      case 1: return row<1>(part, j);
      case 2: return row<2>(part, j);
      case 3: return row<3>(part, j);
      case 4: return row<4>(part, j);
      case 5: return row<5>(part, j);
      case 6: return row<6>(part, j);
      default: return row<7>(part, j);
    }
  }
};

// MR rows x one panel: the block's dots and the result, both in registers.
template <QuantCode Q, bool ZP, int MR>
struct Tile {
  float32x4_t acc[MR][4], dot[MR][4];
  const float* A;
  int64_t lda;

  template <int I>
  inline void row(const Decoder<Q, ZP>& d, const uint32x4_t (&g)[4], int64_t k) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const float32x4_t w = d.template row<I>(g[j], j);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) dot[r][j] = vfmaq_n_f32(dot[r][j], w, A[r * lda + k]);
    }
  }
  template <int... I>
  inline void group(const Decoder<Q, ZP>& d, const uint32x4_t (&g)[4], int64_t k0, std::integer_sequence<int, I...>) {
    (row<I>(d, g, k0 + I), ...);
  }
};

// Columns 4j to 4j + 3 of a block's scales as fp32: its header's (E2M1: the E8M0 bytes widened,
// e8m0_scale_bits).
template <QuantCode Q>
inline float32x4_t block_scales(const uint8_t* block, int j) {
  if (Q != QuantCode::kE2M1) return vld1q_f32(reinterpret_cast<const float*>(block) + 4 * j);
  const uint32x4_t s = {block[4 * j], block[4 * j + 1], block[4 * j + 2], block[4 * j + 3]};
  uint32x4_t bits = vshlq_n_u32(s, 23);
  bits = vbslq_u32(vceqq_u32(s, vdupq_n_u32(0)), vdupq_n_u32(kE8M0Zero), bits);
  bits = vbslq_u32(vceqq_u32(s, vdupq_n_u32(255)), vdupq_n_u32(kE8M0NaN), bits);
  return vreinterpretq_f32_u32(bits);
}

inline void load_group(const uint8_t* codes, uint32x4_t (&g)[4]) {
  for (int j = 0; j < 4; ++j) g[j] = vld1q_u32(reinterpret_cast<const uint32_t*>(codes + 16 * j));
}

template <QuantCode Q, bool ZP, int MR>
void fused_panel(const QuantPanels& layout, const float* A, int64_t lda, const uint8_t* panel, float* C, int64_t ldc) {
  constexpr int G = quant_group_rows(Q);
  Tile<Q, ZP, MR> t;
  t.A = A;
  t.lda = lda;
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) t.acc[r][j] = vdupq_n_f32(0.0f);
  const int64_t full = layout.block / G, rest = layout.block % G;
  const int64_t block_bytes = layout.block_bytes(), blocks = layout.blocks();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) t.dot[r][j] = vdupq_n_f32(0.0f);
    const uint8_t* block = panel + b * block_bytes;
    const uint8_t* codes = block + quant_header_bytes(Q, ZP);
    const Decoder<Q, ZP> d(block);
    const int64_t k0 = b * layout.block;
    uint32x4_t g[4];
    for (int64_t i = 0; i < full; ++i) {
      load_group(codes + i * kQuantGroupBytes, g);
      t.group(d, g, k0 + i * G, std::make_integer_sequence<int, G>{});
    }
    if (rest) {  // a per-column block's partial last group
      load_group(codes + full * kQuantGroupBytes, g);
      for (int i = 0; i < rest; ++i) {
        const int64_t k = k0 + full * G + i;
        for (int j = 0; j < 4; ++j) {
          const float32x4_t w = d.row(g[j], j, i);
          for (int r = 0; r < MR; ++r) t.dot[r][j] = vfmaq_n_f32(t.dot[r][j], w, A[r * lda + k]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      const float32x4_t scale = block_scales<Q>(block, j);
      for (int r = 0; r < MR; ++r) t.acc[r][j] = vfmaq_f32(t.acc[r][j], scale, t.dot[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) vst1q_f32(C + r * ldc + 4 * j, t.acc[r][j]);
}

template <QuantCode Q, bool ZP>
void decode(const QuantPanels& layout, const uint8_t* block, float* out) {
  constexpr int G = quant_group_rows(Q);
  const Decoder<Q, ZP> d(block);
  const uint8_t* codes = block + layout.header_bytes();
  float32x4_t scale[4];
  for (int j = 0; j < 4; ++j) scale[j] = block_scales<Q>(block, j);
  for (int64_t k0 = 0; k0 < layout.block; k0 += G) {
    uint32x4_t g[4];
    load_group(codes + (k0 / G) * kQuantGroupBytes, g);
    const int rows = layout.block - k0 < G ? static_cast<int>(layout.block - k0) : G;
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < 4; ++j) vst1q_f32(out + (k0 + i) * kPanel + 4 * j, vmulq_f32(d.row(g[j], j, i), scale[j]));
  }
}

}  // namespace

void quant_fused_neon(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  with_decoder(layout, [&](auto q, auto zp) {
    for_fused_panels(layout, M, B, p0, p1, C, [&](auto rows, const uint8_t* panel, float* Cp) {
      fused_panel<q(), zp(), rows()>(layout, A, lda, panel, Cp, ldc);
    });
  });
}

void quant_decode_neon(const QuantPanels& layout, const uint8_t* block, float* out) {
  with_decoder(layout, [&](auto q, auto zp) { decode<q(), zp()>(layout, block, out); });
}

}  // namespace detail
}  // namespace moe_onnx
