// The portable kernels of packing's tile copies (transpose_tile.h): the ISA table's transpose_tile and
// quant_code_groups slots at the portable level (their SIMD kernels: x86/avx2/transpose_tile_avx2.cc,
// x86/avx512/transpose_tile_avx512.cc).
#include "transpose_tile.h"

#include <cstring>

#include "gemm.h"

namespace moe_onnx {
namespace detail {

void quant_code_groups_portable(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                                bool nibbles, uint8_t* out) {
  GroupPlaces places(out, per_block, block_bytes);
  for (int64_t j = 0; j < groups; ++j) {
    uint8_t* group = places.next();
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      uint32_t word;
      std::memcpy(&word, lanes[lane] + 4 * j, 4);
      if (nibbles) word = interleave_nibbles(word);
      std::memcpy(group + 4 * lane, &word, 4);
    }
  }
}

void transpose_tile_portable(const void* const* columns, int bytes, void* rows) {
  for (int r = 0; r < kPanel; ++r)
    for (int c = 0; c < kPanel; ++c)
      std::memcpy(static_cast<char*>(rows) + (r * kPanel + c) * bytes, static_cast<const char*>(columns[c]) + r * bytes,
                  static_cast<size_t>(bytes));
}

}  // namespace detail
}  // namespace moe_onnx
