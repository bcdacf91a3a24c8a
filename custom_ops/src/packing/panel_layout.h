// Where each weight element lands in the kernels' panels: the weight formats, where an expert's columns
// come from in an op's weight tensors (ColumnSource, QuantizedColumns), and the placement that writes
// one expert's panels (float_panels.cc; quantized_panels.cc for QMOE's). A new format, or a panel layout
// for another ISA, is a WeightFormat here with its placement; PackedWeights (packed_weights.h) holds
// the panels and multiplies with them.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "float_convert.h"
#include "gemm.h"
#include "qgemm.h"
#include "tensor.h"

namespace moe_onnx {

// How one expert's weight matrix B [K, N] (y = x @ B) is stored, all as ceil(N / 16) panels of 16
// columns, zero padded:
//   kF32, kF16, kBF16  the float GEMM's panels (gemm.h): [K][16] in the weights' own type (16-bit
//                      weights stay 16-bit); bf16 rows in the interleaved lane order (bf16_lane).
//   kInt8              the int8 GEMM's pair panels (int8_gemm.h): [pairs][16][2] int16, the two k
//                      of a pair side by side, K padded to even with a zero.
//   kInt8Quads         the int8 GEMM's quad panels (int8_gemm.h, AVX512-VNNI): 16 int32
//                      corrections -128 * (column sum), then [quads][16][4] int8, K padded to a
//                      multiple of 4 with zeros.
//   kQuantized         QMOE's int4/int8/E2M1 codes with per-block scales (and zero points), blocks
//                      of 64-byte code groups (qgemm.h: QuantPanels), decoded in the GEMM.
//   kBF16Pairs         the bf16 GEMM's pair panels (bf16_gemm.h, accuracy_level 3): [pairs][16][2]
//                      bf16, the weights rounded to bf16 (nearest even), K padded with zeros to a
//                      multiple of 32; the activation rows are bf16 too (bf16_row).
//   kInt8Octets        the int8 GEMM's octet panels (int8_gemm.h, aarch64): [octets][16][8] int8, K
//                      padded to a multiple of 8 with zeros.
enum class WeightFormat { kF32, kF16, kBF16, kInt8, kInt8Quads, kQuantized, kBF16Pairs, kInt8Octets };

// Where one expert's columns come from in a weight tensor of the format's element type, and where
// they go: column c (c < columns) of B has element (k, c) at data[first + k * k_stride + c * c_stride]
// and becomes lane lane0 + c % width of panel c / width. Plain panels: width 16, lane0 0; MOE's
// gate/up panels: the gate columns at width 8, lane0 0, the up columns at width 8, lane0 8.
struct ColumnSource {
  const void* data;
  int64_t first;
  int64_t k_stride, c_stride;
  int64_t columns;
  int64_t width = kPanel, lane0 = 0;
};
// Expert e of a [E, N, K] tensor used as x @ W[e]^T (nn.Linear layout): B [K, N] = W[e]^T.
inline ColumnSource transposed_columns(const void* data, int64_t e, int64_t N, int64_t K) {
  return {data, e * N * K, 1, K, N};
}
// Expert e of a [E, K, N] tensor used as x @ W[e].
inline ColumnSource plain_columns(const void* data, int64_t e, int64_t K, int64_t N) {
  return {data, e * K * N, N, 1, N};
}

// Where one expert's quantized columns come from (QMOE: [E, N, K] codes, [E, N, blocks] scales,
// zero points packed along their last dim), and where they go (lane0 + c % width of panel c / width).
// Column c has code k at element codes_first + c * codes_stride + k of `codes` (an element is a
// nibble for 4-bit codes: the low one of a byte first), the scale of block b at element
// scales_first + c * scales_stride + b of `scales` (float32/float16/bfloat16, or uint8 E8M0 for
// E2M1 codes), and, when zero_points is not null, the zero point of block b at element
// zero_points_first + c * zero_points_stride + b * zero_points_block_stride (same bits as the codes).
struct QuantizedColumns {
  const uint8_t* codes;
  int64_t codes_first, codes_stride;
  const void* scales;
  ElemType scale_type;
  int64_t scales_first, scales_stride;
  const uint8_t* zero_points;
  int64_t zero_points_first, zero_points_stride, zero_points_block_stride;
  int64_t columns;
  int64_t width = kPanel, lane0 = 0;
};

// Bytes of one expert's panels of B [K, N] (y = x @ B) in `format` (not kQuantized: QuantPanels::panel_bytes).
int64_t panel_slot_bytes(WeightFormat format, int64_t N, int64_t K);

// Writes one expert's panels of B [K, N] in `format` (not kQuantized) at dst, from the columns of
// `sources` (elements of the format's type; kBF16Pairs: of `source` type, rounded to bf16; kInt8 and
// kInt8Quads: int8), panel by panel, each panel whole while it is in cache: lanes no source fills and
// padding rows are zero.
void place_panels(WeightFormat format, FloatType source, std::initializer_list<ColumnSource> sources, int64_t N,
                  int64_t K, void* dst);

// As place_panels, from quantized columns, into `panels` quantized panels of `layout` (qgemm.h).
void place_quantized_panels(const QuantPanels& layout, std::initializer_list<QuantizedColumns> sources, int64_t panels,
                            uint8_t* dst);

}  // namespace moe_onnx
