// SDOT dots of quant_gemm_panels at accuracy level 4 (qgemm.h); this folder's files alone are compiled
// with +dotprod and called only after the ISA table's check of the CPU.
//
// A 64-byte group of codes is four q registers, each 4 columns x a column's 4 consecutive k (8-bit
// codes: one group; 4-bit codes: a group's low nibbles are its k 0-3, its high nibbles k 4-7). SDOT by
// element multiplies one of them by 4 int8 activations of a row (a lane of a register holding 16 k)
// and adds the sums into the columns' int32 lanes: at most 4 * 128 * 255 per step, exact. SDOT is
// signed x signed, so 8-bit codes q (0..255) enter as q - 128 (the top bit flipped), and
// sum (q - 128) qa + 128 sum qa is sum q qa: the zero point's term is then (zp - 128) sum qa. The int32
// dots wrap as vpdpbusd's do, so dot = sum q qa - zp sum qa is the portable loops' integer, and
// C += (sa * scale) * float(dot) over the blocks in order is their float arithmetic (this file is
// compiled without FMA contraction).
#include <arm_neon.h>

#include <cstring>

#include "qgemm.h"

namespace moe_onnx {
namespace detail {
namespace {

constexpr int kMaxRows = 4;

// The 4 activation bytes of quad `quad` of a row, in every lane (a block's last quads: no read past them).
inline int8x16_t quad_in_every_lane(const int8_t* a, int64_t quad) {
  int32_t bytes;
  std::memcpy(&bytes, a + 4 * quad, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(bytes));
}

// acc[r][j] += codes[j] (4 columns x 4 k) . quad L of a[r], for the MR rows.
template <int MR, int L>
inline void dot_lane(int32x4_t (&acc)[MR][4], const int8x16_t (&codes)[4], const int8x16_t (&a)[MR]) {
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = vdotq_laneq_s32(acc[r][j], codes[j], a[r], L);
}

// The group's codes as signed bytes: 8-bit codes flipped (q - 128); 4-bit: the low (high) nibbles.
template <QuantCode Q>
inline void group_codes(const uint8_t* group, int8x16_t (&low)[4], int8x16_t (&high)[4]) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const uint8x16_t bytes = vld1q_u8(group + 16 * j);
    if constexpr (Q == QuantCode::kInt8) {
      low[j] = vreinterpretq_s8_u8(veorq_u8(bytes, vdupq_n_u8(0x80)));
    } else {
      low[j] = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0f)));
      high[j] = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
    }
  }
}

// MR rows x one panel over all blocks: each block's int32 dots, then C = sum over blocks of
// (sa * scale) * float(dot).
template <QuantCode Q, int MR>
void panel_rows(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* sums, const float* sa,
                const uint8_t* panel, float* C, int64_t ldc) {
  const int64_t blocks = layout.blocks(), padded = layout.activation_block(), groups = layout.groups_per_block(),
                block_bytes = layout.block_bytes(), header_bytes = layout.header_bytes();
  // Groups per 16 activation bytes: 4 of 8-bit codes (4 k each), 2 of 4-bit ones (8 k each).
  constexpr int64_t kPerVector = Q == QuantCode::kInt8 ? 4 : 2;
  float32x4_t out[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) out[r][j] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    const uint8_t* codes = block + header_bytes;
    int32x4_t acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = vdupq_n_s32(0);
    int8x16_t low[4], high[4];
    int64_t g = 0;
    for (; g + kPerVector <= groups; g += kPerVector) {
      int8x16_t a[MR];
      for (int r = 0; r < MR; ++r) a[r] = vld1q_s8(qa + r * ldq + b * padded + 16 * (g / kPerVector));
      if constexpr (Q == QuantCode::kInt8) {
        group_codes<Q>(codes + g * kQuantGroupBytes, low, high);
        dot_lane<MR, 0>(acc, low, a);
        group_codes<Q>(codes + (g + 1) * kQuantGroupBytes, low, high);
        dot_lane<MR, 1>(acc, low, a);
        group_codes<Q>(codes + (g + 2) * kQuantGroupBytes, low, high);
        dot_lane<MR, 2>(acc, low, a);
        group_codes<Q>(codes + (g + 3) * kQuantGroupBytes, low, high);
        dot_lane<MR, 3>(acc, low, a);
      } else {
        group_codes<Q>(codes + g * kQuantGroupBytes, low, high);
        dot_lane<MR, 0>(acc, low, a);
        dot_lane<MR, 1>(acc, high, a);
        group_codes<Q>(codes + (g + 1) * kQuantGroupBytes, low, high);
        dot_lane<MR, 2>(acc, low, a);
        dot_lane<MR, 3>(acc, high, a);
      }
    }
    for (; g < groups; ++g) {  // the block's last groups, their activations a quad at a time
      const int64_t quad = g * (Q == QuantCode::kInt8 ? 1 : 2);
      group_codes<Q>(codes + g * kQuantGroupBytes, low, high);
      int8x16_t a[MR];
      for (int r = 0; r < MR; ++r) a[r] = quad_in_every_lane(qa + r * ldq + b * padded, quad);
      dot_lane<MR, 0>(acc, low, a);
      if constexpr (Q == QuantCode::kInt4) {
        for (int r = 0; r < MR; ++r) a[r] = quad_in_every_lane(qa + r * ldq + b * padded, quad + 1);
        dot_lane<MR, 0>(acc, high, a);
      }
    }
    // The zero points (8-bit codes: minus the 128 their flip took) and the scales of the 16 columns.
    int32x4_t zero_point[4];
    const int32_t flip = Q == QuantCode::kInt8 ? 128 : 0;
    if (layout.zero_points) {
      const uint16x8_t zp = vmovl_u8(vld1_u8(block + 64)), zp_high = vmovl_u8(vld1_u8(block + 72));
      zero_point[0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(zp)));
      zero_point[1] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(zp)));
      zero_point[2] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(zp_high)));
      zero_point[3] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(zp_high)));
      for (int j = 0; j < 4; ++j) zero_point[j] = vsubq_s32(zero_point[j], vdupq_n_s32(flip));
    } else {
      for (int j = 0; j < 4; ++j) zero_point[j] = vdupq_n_s32(layout.default_zero_point() - flip);
    }
    for (int r = 0; r < MR; ++r) {
      const int32x4_t sum = vdupq_n_s32(sums[r * blocks + b]);
      const float32x4_t sa_r = vdupq_n_f32(sa[r * blocks + b]);
      for (int j = 0; j < 4; ++j) {
        const int32x4_t dot = vmlsq_s32(acc[r][j], zero_point[j], sum);  // wrapping
        const float32x4_t factor = vmulq_f32(sa_r, vld1q_f32(reinterpret_cast<const float*>(block) + 4 * j));
        out[r][j] = vaddq_f32(out[r][j], vmulq_f32(factor, vcvtq_f32_s32(dot)));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) vst1q_f32(C + r * ldc + 4 * j, out[r][j]);
}

}  // namespace

void quant_dots_dotprod(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* qa_sums,
                        const float* sa, int64_t M, const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc) {
  auto dots = [&](auto code) {
    for_dot_tiles<kMaxRows>(layout, qa, ldq, qa_sums, sa, M, B, p0, p1, C, ldc,
                            [&](auto rows, const int8_t* a, const int32_t* sums, const float* scales,
                                const uint8_t* panel, float* out) {
                              panel_rows<code(), rows()>(layout, a, ldq, sums, scales, panel, out, ldc);
                            });
  };
  if (layout.code == QuantCode::kInt8) return dots(std::integral_constant<QuantCode, QuantCode::kInt8>{});
  dots(std::integral_constant<QuantCode, QuantCode::kInt4>{});
}

}  // namespace detail
}  // namespace moe_onnx
