// Packing's tile copy (packed_weights.cc): 16 columns of 16 consecutive elements into 16 rows of 16,
// the step that makes a panel's rows (lanes side by side) from weights stored column by column
// (nn.Linear's [N, K]). Kernels per ISA level in the table's slot transpose_tile (isa.h); every
// kernel writes the same bytes.
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

}  // namespace detail
}  // namespace moe_onnx
