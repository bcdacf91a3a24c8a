// int8 x int8 -> int32 GEMM for Y = X @ W^T (W in nn.Linear layout [N, K]), exact: every product
// and partial sum of an instruction fits int32 and the sum over k wraps modulo 2^32 like numpy's
// int32 matmul, so the result does not depend on the summation order. The kernel (the ISA table's
// int8_gemm slot, isa.h) fixes the layout of both operands:
//
//   pairs (AVX2 vpmaddwd, portable)  X rows widened to int16, K padded to an even 2 * pairs (zeros);
//          W in ceil(N / 16) panels, each [pairs][16 columns][2] int16: the two k of a pair side by
//          side, so one 32-bit broadcast of an X pair times one panel row gives 8 columns' pair sums.
//   quads (AVX512-VNNI vpdpbusd)     X rows as unsigned bytes u = x + 128 (x ^ 0x80), K padded to a
//          multiple of 4; W in panels, each 16 int32 corrections -128 * sum_k W[c, k] (one per
//          column) then [quads][16 columns][4] int8, K padded with zeros. vpdpbusd sums u * w over 4
//          k per column; starting each column's sum at its correction gives sum x * w exactly.
//          AMX's TDPBUSD reads the same operands: a quad row of a panel (64 bytes: 4 k x 16 columns)
//          is a row of its B tile, 16 quad rows (64 k) a whole tile; its C tiles start from the
//          corrections (int8_gemm_amx.h). The int8 slot then has two kernels: calls of fewer than
//          kInt8TileRows rows (decode) run on VNNI, the others on AMX; both give the exact int32, so the
//          choice changes no bit of the result.
//   octets (aarch64: SMULL/SADALP, SDOT, SMMLA)  X rows as they are (signed), K padded with zeros to a
//          multiple of 8; W in panels, each [octets][16 columns][8] int8, K padded with zeros: a 16-byte
//          load holds two columns' 8 k, which is SMMLA's 2 x 8 operand as it is, and for SDOT (and for
//          SMULL + SADALP) each column's two 4-k halves multiplied by an X octet loaded into both halves
//          of a register (the halves' sums are added at the end).
//
// The caller prepares X rows with prepare_int8_rows (int8_row_bytes(K) bytes each) and packs W in
// the matching WeightFormat (packed_weights.h asks the slot's layout, int8_layout()); ops multiply
// through PackedWeights::multiply.
#pragma once

#include <cstdint>

#include "gemm.h"

namespace moe_onnx {

// Columns per panel: the float GEMM's, so callers split int8 and float work into the same tasks.
constexpr int64_t kInt8Panel = kPanel;

enum class Int8Layout { kPairs, kQuads, kOctets };

// The layout of the kernel in use.
Int8Layout int8_layout();
// "pairs", "quads" or "octets".
const char* int8_layout_name(Int8Layout layout);

inline int64_t int8_pairs(int64_t K) { return (K + 1) / 2; }
inline int64_t int8_quads(int64_t K) { return (K + 3) / 4; }
inline int64_t int8_octets(int64_t K) { return (K + 7) / 8; }
// Bytes of a quad panel's corrections (16 int32, in front of its quads), and of the whole panel.
constexpr int64_t kInt8QuadHeader = kInt8Panel * 4;
inline int64_t int8_quad_panel_bytes(int64_t K) { return kInt8QuadHeader + int8_quads(K) * 4 * kInt8Panel; }
// Bytes of one prepared X row of K values (both layouts: a multiple of 4).
int64_t int8_row_bytes(int64_t K);
// Rows from which a call of the quad layout runs on AMX's tiles where the ISA table has them (fewer:
// the VNNI kernel). Measured on a 2-core Xeon with AMX (one expert, 2 threads, load ~8; microseconds
// AMX / VNNI): N=5760 K=2880 (weights from memory) 1 row 622 / 634, 4 rows 635 / 712, 8 rows 655 /
// 862, 16 rows 706 / 1788; N=768 K=1024 (weights in cache) 1 row 22-26 / 18-19, 4 rows 22-24 / 20-24,
// 8 rows 24-26 / 25-28, 16 rows 27 / 49-52: AMX gains from 8 rows (docs/building.md, "int8 and
// level-4 dots on AMX"); the model of the tiles takes the same rows, so tests cross it on any machine.
constexpr int64_t kInt8TileRows = 8;

// Writes `rows` rows of K int8 values (row stride K) as the kernel reads them, int8_row_bytes(K)
// bytes per row, padding included.
void prepare_int8_rows(const int8_t* src, int64_t rows, int64_t K, void* dst);

// C[m, 16 * (p - p0) + c] = sum_k X[m, k] * W[16 p + c, k] (int32, wrapping) for m < M, p in [p0, p1),
// c < 16. A: prepared rows with row stride lda bytes (>= int8_row_bytes(K)); W_packed: one expert's
// panels in the kernel's layout; C row stride ldc (>= 16 * (p1 - p0)).
void int8_gemm_panels(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0, int64_t p1,
                      int32_t* C, int64_t ldc);

namespace detail {
// The kernels behind int8_gemm_panels and prepare_int8_rows (the table's slot), arguments as there
// (K > 0, M > 0).
using Int8GemmFn = void (*)(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                            int64_t p1, int32_t* C, int64_t ldc);
using PrepareInt8RowsFn = void (*)(const int8_t* src, int64_t rows, int64_t K, void* dst);
void widen_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, void* dst);
void int8_gemm_pairs_portable(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                              int64_t p1, int32_t* C, int64_t ldc);
#if defined(MOE_ONNX_HAVE_AVX2)
void widen_int8_rows_avx2(const int8_t* src, int64_t rows, int64_t K, void* dst);
void int8_gemm_pairs_avx2(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                          int64_t p1, int32_t* C, int64_t ldc);
#endif
// The quad layout's rows (x ^ 0x80), without AVX-512: for AMX's model on any CPU.
void bias_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, void* dst);
// The octet layout's rows (x as it is, zero padded).
void copy_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, void* dst);
#if defined(MOE_ONNX_HAVE_NEON)
void int8_gemm_octets_neon(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                           int64_t p1, int32_t* C, int64_t ldc);
#endif
#if defined(MOE_ONNX_HAVE_DOTPROD)
void int8_gemm_octets_dotprod(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                              int64_t p1, int32_t* C, int64_t ldc);
#endif
#if defined(MOE_ONNX_HAVE_I8MM)
void int8_gemm_octets_i8mm(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                           int64_t p1, int32_t* C, int64_t ldc);
#endif
// AMX on the quad layout (int8_gemm_amx.h): on the tile instructions and on their model.
void int8_gemm_quads_amx_model(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                               int64_t p1, int32_t* C, int64_t ldc);
#if defined(MOE_ONNX_HAVE_AMX)
void int8_gemm_quads_amx(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                         int64_t p1, int32_t* C, int64_t ldc);
#endif
#if defined(MOE_ONNX_HAVE_AVX512_VNNI)
void bias_int8_rows_vnni(const int8_t* src, int64_t rows, int64_t K, void* dst);
void int8_gemm_quads_vnni(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                          int64_t p1, int32_t* C, int64_t ldc);
#endif
}  // namespace detail

}  // namespace moe_onnx
