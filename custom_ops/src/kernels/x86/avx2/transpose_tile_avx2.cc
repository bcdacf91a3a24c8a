// quant_code_groups with AVX2 (transpose_tile_simd.h on 8 lanes); this file alone is compiled with -mavx2 and
// is only called after a run-time check of the CPU.
#include "x86/avx2/simd_avx2.h"
#include "x86/transpose_tile_simd.h"

namespace moe_onnx {
namespace detail {

void quant_code_groups_avx2(const uint8_t* const* lanes, int64_t groups, int64_t per_block, int64_t block_bytes,
                            bool nibbles, uint8_t* out) {
  quant_code_groups_simd<Avx2>(lanes, groups, per_block, block_bytes, nibbles, out);
}

}  // namespace detail
}  // namespace moe_onnx
