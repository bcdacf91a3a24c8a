// Packing's tile copies (packed_weights.cc), the steps that make a panel's rows (lanes side by side)
// from weights stored column by column (nn.Linear's [N, K]): transpose_tile, 16 columns of 16
// consecutive elements into 16 rows of 16, for the float and int8 panels; quant_code_groups, the
// 16 lanes' code groups of a quantized panel (qgemm.h) for QMOE's. Kernels per ISA level in the
// table's slots of the same names (isa.h); every kernel writes the same bytes.
#pragma once

#include <cstdint>

namespace moe_onnx {
namespace detail {

// rows[16 * r + c] = columns[c][r] for r, c < 16, elements of `bytes` bytes (1, 2 or 4).
using TransposeTileFn = void (*)(const void* const* columns, int bytes, void* rows);
void transpose_tile_portable(const void* const* columns, int bytes, void* rows);
#if defined(MOE_ONNX_HAVE_AVX512)
void transpose_tile_avx512(const void* const* columns, int bytes, void* rows);
#endif

// A quantized panel's code groups (qgemm.h) from its 16 lanes' codes: lane l's `groups` 4-byte
// groups are consecutive at lanes[l] (its codes from a byte on, the blocks one after the other), and
// group j of every lane goes to the 64 bytes at out + (j / per_block) * block_bytes +
// (j % per_block) * 64, lane l's at 4 l: 8-bit codes as they are, 4-bit ones (nibbles) from the
// source's pairs (byte i: rows 2i low, 2i + 1 high) to the group's order (byte i: rows i low, 4 + i
// high), interleave_nibbles.
using QuantCodeGroupsFn = void (*)(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                                   bool nibbles, uint8_t* out);
void quant_code_groups_portable(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                                bool nibbles, uint8_t* out);
#if defined(MOE_ONNX_HAVE_AVX2)
void quant_code_groups_avx2(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                            bool nibbles, uint8_t* out);
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
void quant_code_groups_avx512(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                              bool nibbles, uint8_t* out);
#endif

// One group of 4-bit codes, 8 nibbles in a 32-bit word (little endian), from the source's order (nibble
// n: row n) to the group's (nibble 2i: row i, 2i + 1: row 4 + i): two exchanges of nibble pairs, the
// form the SIMD kernels take per 32-bit lane.
inline uint32_t interleave_nibbles(uint32_t x) {
  uint32_t t = (x ^ (x >> 8)) & 0x0000FF00u;  // rows 2, 3 <-> rows 4, 5
  x ^= t ^ (t << 8);
  t = (x ^ (x >> 4)) & 0x00F000F0u;  // row 1 <-> row 4, row 3 <-> row 6
  return x ^ t ^ (t << 4);
}

// Where quant_code_groups puts consecutive groups: next() is group 0's place, then group 1's, ...
class GroupPlaces {
 public:
  GroupPlaces(uint8_t* out, int64_t per_block, int64_t block_bytes)
      : block_(out), per_block_(per_block), block_bytes_(block_bytes) {}
  uint8_t* next() {
    uint8_t* at = block_ + 64 * in_block_;
    if (++in_block_ == per_block_) {
      in_block_ = 0;
      block_ += block_bytes_;
    }
    return at;
  }

 private:
  uint8_t* block_;
  int64_t per_block_, block_bytes_, in_block_ = 0;
};

}  // namespace detail
}  // namespace moe_onnx
