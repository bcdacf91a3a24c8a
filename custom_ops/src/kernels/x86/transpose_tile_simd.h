// quant_code_groups (transpose_tile.h) written once over a vector mapping V (avx2/simd_avx2.h,
// avx512/simd_avx512.h). Included by the ISA folders' transpose_tile files only, compiled with their
// flags.
#pragma once

#include <algorithm>
#include <cstdint>

#include "transpose_tile.h"

namespace moe_onnx::detail {

// interleave_nibbles (transpose_tile.h) on each 32-bit lane.
template <class V>
inline typename V::I interleave_nibbles_lanes(typename V::I x) {
  typename V::I t = V::bits_and(V::bits_xor(x, V::template shift_right<8>(x)), V::set1_i32(0x0000FF00));
  x = V::bits_xor(x, V::bits_xor(t, V::template shift_left<8>(t)));
  t = V::bits_and(V::bits_xor(x, V::template shift_right<4>(x)), V::set1_i32(0x00F000F0));
  return V::bits_xor(x, V::bits_xor(t, V::template shift_left<4>(t)));
}

// Four groups of every lane at a time (fewer at the end: masked loads), V::kLanes / 4 lanes per 128-bit
// part: y[i] holds lanes h + i, h + i + 4, ... in its parts, so a 4x4 transpose of 32-bit elements within
// the parts leaves group m of lanes h.. h + V::kLanes - 1 in order in g[m] (AVX2: two passes of 8 lanes,
// AVX-512: one of 16).
template <class V>
void quant_code_groups_simd(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                            bool nibbles, uint8_t* out) {
  using I = typename V::I;
  constexpr int kParts = V::kLanes / 4;
  GroupPlaces places(out, per_block, block_bytes);
  for (int64_t j = 0; j < groups; j += 4) {
    const int64_t n = std::min<int64_t>(4, groups - j);
    uint8_t* at[4];
    for (int64_t m = 0; m < n; ++m) at[m] = places.next();
    for (int h = 0; h < 16; h += V::kLanes) {
      I y[4];
      for (int i = 0; i < 4; ++i) {
        __m128i parts[kParts];
        for (int k = 0; k < kParts; ++k) parts[k] = V::load_words(lanes[h + i + 4 * k] + 4 * j, n);
        const I v = V::join_parts(parts);
        y[i] = nibbles ? interleave_nibbles_lanes<V>(v) : v;
      }
      const I t0 = V::unpack_lo32(y[0], y[1]), t1 = V::unpack_hi32(y[0], y[1]);
      const I t2 = V::unpack_lo32(y[2], y[3]), t3 = V::unpack_hi32(y[2], y[3]);
      const I g[4] = {V::unpack_lo64(t0, t2), V::unpack_hi64(t0, t2), V::unpack_lo64(t1, t3), V::unpack_hi64(t1, t3)};
      for (int64_t m = 0; m < n; ++m) V::store_bytes(at[m] + 4 * h, g[m]);
    }
  }
}

}  // namespace moe_onnx::detail
