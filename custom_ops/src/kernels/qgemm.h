// GEMM on quantized B panels (QMOE's weights: int4/int8 codes with per-block fp32 scales and zero
// points, or MXFP4's E2M1 codes with power-of-two scales), the weights decoded in registers.
//
// Packed B ([K, N] logically, N outputs, K inputs): ceil(N / 16) panels of 16 columns; each panel is
// its K blocks (block_size rows; one block of K rows for per-column scales) one after the other, and
// each block is
//   header  int: 16 fp32 scales (one per column), then 16 uint8 zero points when the weights have them
//           (else every column's zero point is 2^(bits - 1)); MXFP4: the 16 columns' uint8 E8M0 scales s
//           as stored (the scale 2^(s - 127), e8m0_scale_bits), so a panel is as large as the codes and
//           scales it is packed from, and the kernels widen them at the block's end (its code groups
//           then start 16 bytes into a cache line: unaligned loads)
//   codes   groups of G rows (G = 8 for 4-bit codes, 4 for 8-bit), 64 bytes each: 16 columns x 4 bytes
//           (the column's 32-bit lane). 8-bit: byte i of a lane is row i of the group; 4-bit: byte i
//           holds row i in its low nibble and row 4 + i in its high nibble. A block's last group is
//           zero padded (only per-column blocks of K % G != 0 have one).
// So one 64-byte load gives G rows of 16 columns: a row is a shift and a mask per 32-bit lane, and
// the lane's 4 bytes are the 4 consecutive k that vpdpbusd sums (accuracy level 4).
//
// accuracy level 0: C = A @ W with W[k, c] = (q - zp) * scale (int) or e2m1(q) * scale (mxfp4).
// Up to kFusedRows rows (decode) the micro-kernels compute it per block as weight-only int4 kernels
// do, decoding each panel row once into a register for all the rows: the block's dot with the centred
// code values, dot_b = sum over k in the block of A[m, k] * v(q) (v(q) = q - zp, or e2m1(q): exact
// floats) in one fp32 FMA chain in increasing k, then C = fma(scale_b, dot_b, C) over the blocks in
// order. Per weight that is a shift and one vpermps over the 16 values of the 4-bit codes (minus the
// default zero point 8), or a shift pair and a conversion of the 8-bit code flipped by 0x80 (q - 128),
// a subtraction more with explicit zero points, and one FMA: decode streams the quantized bytes.
// More rows (prefill) dequantize a pair of panels into an L2 scratch once per call, exactly
// (v(q) * scale, one rounding: the reference's weights), and run the fp32 GEMM on them (gemm.h): those
// rows get the bits of MOE on the dequantized weights. Either way a row's result depends only on the
// number of rows its expert has in the call (the task plan's, not the thread count).
//
// accuracy level 3 (where the ISA table has a bf16 GEMM, bf16_gemm.h): up to kFusedRows rows as level
// 0 (the fused kernels where the table has them); more rows dequantize the pair of panels into bf16 pair panels instead (v(q) *
// scale rounded once to fp32, then to bf16) and run the bf16 GEMM on the rows rounded to bf16: the
// bits of MOE at level 3 on the dequantized weights, whose rows go to bf16 the same way.
//
// accuracy level 4 (int only): every row of A is quantized per block to int8 (sa = max|a| / 127,
// qa = round-half-even(a / sa) clipped to +-127), dot = sum qa * (q - zp) in int32 (exact, computed
// as sum q * qa - zp * sum qa), C = sum over blocks in order of (sa * scale) * dot. The rows are
// quantized once (quantize_int8_rows: the ops do it once per run for every row, and every panel task
// of the rows reads them: Int8Rows), then quant_gemm_int8_rows takes the dots. AVX512-VNNI (vpdpbusd,
// unsigned codes x signed activations) where the CPU has it; the portable loops give the same
// integers and the same sums. Where the ISA table has AMX's int8 tiles, calls of kQuantTileRows rows
// or more on blocks of kQuantTileBlock k or more run on TDPBSUD (qgemm_amx.h: signed A x unsigned B,
// the quantized rows and the codes as they are, 8-bit codes of whole tile rows read in place), whose
// int32 sums are vpdpbusd's: the same dots, and C gets the same bits. Which kernel a call takes
// depends on its rows only (the task plan's).
#pragma once

#include <cstdint>
#include <type_traits>

#include "gemm.h"
#include "row_dispatch.h"

namespace moe_onnx {

enum class QuantCode { kInt4, kInt8, kE2M1 };

// Level 4's tiles take blocks of kQuantTileBlock k or more (below, qgemm.cc's threshold).
constexpr int64_t kQuantTileBlock = 64;

// Rows of a code group (the layout above): 4 of 8-bit codes, 8 of 4-bit.
constexpr int quant_group_rows(QuantCode code) { return code == QuantCode::kInt8 ? 4 : 8; }

// Bytes of a block's header: 16 E8M0 scales for E2M1 codes; 16 fp32 scales, then 16 zero points where present.
constexpr int64_t quant_header_bytes(QuantCode code, bool zero_points) {
  return code == QuantCode::kE2M1 ? 16 : 64 + (zero_points ? 16 : 0);
}

// The layout of one expert's quantized panels.
struct QuantPanels {
  QuantCode code = QuantCode::kInt8;
  int64_t K = 0;
  int64_t block = 0;          // rows per block (K for per-column scales)
  bool zero_points = false;   // whether the headers carry zero points
  bool int8_activations = false;  // accuracy level 4
  bool bf16_prefill = false;      // accuracy level 3 where the table has a bf16 GEMM

  int bits() const { return code == QuantCode::kInt8 ? 8 : 4; }
  int64_t group_rows() const { return quant_group_rows(code); }
  int64_t blocks() const { return block > 0 ? K / block : 0; }
  int64_t groups_per_block() const { return (block + group_rows() - 1) / group_rows(); }
  int64_t header_bytes() const { return quant_header_bytes(code, zero_points); }
  int64_t block_bytes() const { return header_bytes() + groups_per_block() * 64; }
  int64_t panel_bytes() const { return blocks() * block_bytes(); }
  // Level 4: a block's k in the quantized activation rows, zero padded: whole groups, and for blocks
  // the tiles take (kQuantTileBlock k or more) whole tile rows of 64 k.
  int64_t activation_block() const {
    const int64_t whole = block >= kQuantTileBlock ? 64 : group_rows();
    return (block + whole - 1) / whole * whole;
  }
  int64_t activation_row_bytes() const { return blocks() * activation_block(); }
  // The default zero point of int codes.
  int32_t default_zero_point() const { return code == QuantCode::kInt8 ? 128 : 8; }
};

constexpr int64_t kQuantGroupBytes = 64;
// Rows up to which the micro-kernels decode in registers (more: decode a panel once, fp32 GEMM).
constexpr int64_t kFusedRows = 4;
// Accuracy level 4 runs on AMX's tiles, where the ISA table has them, for calls of kQuantTileRows rows
// or more on blocks of kQuantTileBlock k or more; the other calls on the quant_dots kernel. Each
// block's dots leave the tiles for the vector units (the scales): on blocks of 16 and 32 k that costs
// as much as VNNI's whole dot. From 4 rows the tiles are faster than VNNI (at 1 row slower, at 2
// even: one thread, every expert with the same rows). The model of the tiles takes the same calls
// (docs/building.md, "int8 and level-4 dots on AMX", has the measurements).
constexpr int64_t kQuantTileRows = 4;

// The values of the 16 4-bit codes: int (q itself, and q - 8 for the default zero point) and E2M1 (FP4).
constexpr float kInt4Values[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
constexpr float kInt4CentredValues[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The bits of an E8M0 scale as fp32: 2^(s - 127) (s = 0: 2^-127, a subnormal float), NaN for 255. The SIMD
// kernels widen a header's 16 with the same two exceptions.
constexpr uint32_t kE8M0Zero = 0x00400000u, kE8M0NaN = 0x7FC00000u;
inline uint32_t e8m0_scale_bits(uint8_t s) { return s == 255 ? kE8M0NaN : s == 0 ? kE8M0Zero : uint32_t{s} << 23; }

// C[m, 16 * (p - p0) + c] = sum_k A[m, k] * W_p[k, c] for m < M, p in [p0, p1), c < 16 (the layout's
// accuracy level decides how; level 4 takes quantized rows: quant_gemm_int8_rows). A: fp32 rows of
// stride lda (K valid elements); C row stride ldc.
void quant_gemm_panels(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const void* B_packed,
                       int64_t p0, int64_t p1, float* C, int64_t ldc);

// Level 4's activation rows quantized per block: row m's codes at qa + m * ldq (ldq =
// activation_row_bytes(): block b at b * activation_block(), zero padded), its blocks' scales and
// sums of codes at sa and sums + m * blocks + b.
struct Int8Rows {
  int8_t* qa = nullptr;
  int64_t ldq = 0;
  float* sa = nullptr;
  int32_t* sums = nullptr;
  int64_t blocks = 0;

  // The rows from row m on.
  Int8Rows from(int64_t m) const { return {qa + m * ldq, ldq, sa + m * blocks, sums + m * blocks, blocks}; }
};
// Rows m < M of A (fp32, stride lda, K valid elements) quantized into `rows` (room for M rows).
void quantize_int8_rows(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const Int8Rows& rows);
// Level 4: C[m, 16 * (p - p0) + c] for m < M, p in [p0, p1) from M quantized rows.
void quant_gemm_int8_rows(const QuantPanels& layout, const Int8Rows& rows, int64_t M, const void* B_packed,
                          int64_t p0, int64_t p1, float* C, int64_t ldc);

namespace detail {
// The kernels of quant_gemm_panels: the ISA table's quant_fused, quant_decode and quant_dots slots.
// The fused kernel on M <= kFusedRows rows: C[m, 16 (p - p0) + c] for m < M, p in [p0, p1). No
// portable one: the portable level always decodes blocks.
using QuantFusedFn = void (*)(const QuantPanels&, const float* A, int64_t lda, int64_t M, const uint8_t* B,
                              int64_t p0, int64_t p1, float* C, int64_t ldc);
// One block of one panel dequantized, v(q) * scale, as [block][16] fp32 (rows of the fp32 GEMM's panel).
using QuantDecodeFn = void (*)(const QuantPanels&, const uint8_t* block, float* out);
// Level 4's int8 activations: rows m < M of A, each block b's K values quantized as the op defines
// them (sa = max |a| / 127, qa = round-half-even(a / sa) clipped to +-127, 0 where sa is 0 or a / sa
// NaN; a NaN in the block makes sa NaN) into qa + m * ldq + b * padded (zero past the block's values,
// padded = activation_block()), with sa[m * blocks + b] and the sums of the block's qa in
// sums[m * blocks + b]. Every kernel gives the same bits.
using QuantActivationsFn = void (*)(const QuantPanels&, const float* A, int64_t lda, int64_t M, int8_t* qa,
                                    int64_t ldq, float* sa, int32_t* sums);
// One block of QuantActivationsFn (the portable kernel's, and the others' for blocks with a NaN).
void quantize_activation_block(const float* a, int64_t block, int64_t padded, int8_t* qa, float* sa, int32_t* sum);
// Level 4: C[m, 16 (p - p0) + c] for m < M, p in [p0, p1) from the rows quantized per block (qa, blocks
// activation_block() apart, row stride ldq; their sums qa_sums and scales sa, [M][blocks]): per block the
// exact int32 dot, then C += (sa * scale) * float(dot) over the blocks in order (products and sums
// each rounded once, no FMA: the portable and VNNI kernels give the same bits).
using QuantDotFn = void (*)(const QuantPanels&, const int8_t* qa, int64_t ldq, const int32_t* qa_sums, const float* sa,
                            int64_t M, const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc);

// AMX's level-4 kernel (qgemm_amx.h), with its steps outside the tiles (on AVX-512 where the level has
// it: the AMX files take the AMX flags only):
//   code_rows: a panel's blocks as TDPBSUD's B rows, block b's at rows + 16 * block_k * b: block_k / 4
//     rows of 16 columns x 4 uint8 holding q for k < block and zero past it (the codes the tiles cannot
//     read in place: 4-bit ones, and blocks not of whole tile rows).
//   add_dots: `count` consecutive blocks' dots of one panel into C (QuantBlockDots).
using QuantCodeRowsFn = void (*)(const QuantPanels&, const uint8_t* panel, int64_t block_k, uint8_t* rows);
// For m < rows, c < 16 and the blocks i < count in order: out[m * ldc + c] += (sa[m * stride + i] *
// scale_i[c]) * float(dot_i[m][c] - zp_i[c] * sums[m * stride + i]) (int32, wrapping), products and
// sums rounded once (quant_dots' order); dot_i[m] at dots + i * block_stride + 16 * m, scale_i the 16
// fp32 at headers + i * header_stride, zp_i the 16 uint8 64 bytes on (zero_points) or
// default_zero_point.
struct QuantBlockDots {
  int64_t rows, count;
  const int32_t* dots;
  int64_t block_stride;
  const int32_t* sums;
  const float* sa;
  int64_t stride;
  const uint8_t* headers;
  int64_t header_stride;
  bool zero_points;
  int32_t default_zero_point;
};
using QuantAddDotsFn = void (*)(const QuantBlockDots&, float* out, int64_t ldc);
struct QuantTileSteps {
  QuantCodeRowsFn code_rows = nullptr;
  QuantAddDotsFn add_dots = nullptr;
  const char* name = "none";
};
// quant_dots' contract on AMX, with the steps.
using QuantTilesFn = void (*)(const QuantTileSteps&, const QuantPanels&, const int8_t* qa, int64_t ldq,
                              const int32_t* qa_sums, const float* sa, int64_t M, const uint8_t* B, int64_t p0,
                              int64_t p1, float* C, int64_t ldc);

// The SIMD kernels' dispatch: calls body(Q, ZP) as template arguments for the layout's code and zero points.
template <class Body>
void with_decoder(const QuantPanels& layout, Body&& body) {
  using Int4 = std::integral_constant<QuantCode, QuantCode::kInt4>;
  using Int8 = std::integral_constant<QuantCode, QuantCode::kInt8>;
  using E2M1 = std::integral_constant<QuantCode, QuantCode::kE2M1>;
  const bool zp = layout.zero_points;
  switch (layout.code) {
    case QuantCode::kInt4: return zp ? body(Int4{}, std::true_type{}) : body(Int4{}, std::false_type{});
    case QuantCode::kInt8: return zp ? body(Int8{}, std::true_type{}) : body(Int8{}, std::false_type{});
    case QuantCode::kE2M1: return body(E2M1{}, std::false_type{});
  }
}

// The loops of the SIMD quant_fused kernels (x86/avx2/qgemm_avx2.cc, arm64/neon/qgemm_neon.cc): every panel
// of [p0, p1) on the M (1 to kFusedRows) rows, as panel(rows, panel's codes, its C), the row count a
// std::integral_constant (with_rows).
template <class Panel>
void for_fused_panels(const QuantPanels& layout, int64_t M, const uint8_t* B, int64_t p0, int64_t p1, float* C,
                      Panel&& panel) {
  with_rows<kFusedRows>(M, [&](auto rows) {
    for (int64_t p = p0; p < p1; ++p) panel(rows, B + p * layout.panel_bytes(), C + (p - p0) * kPanel);
  });
}

// The loops of the SIMD quant_dots kernels (x86/avx512/qgemm_vnni.cc, arm64/dotprod/qgemm_dotprod.cc): the M
// rows in tiles of up to kRows, each over the panels of [p0, p1), as tile(rows, the tile's qa, its qa_sums,
// its sa, the panel's codes, its C), the row count a std::integral_constant (with_rows).
template <int kRows, class Tile>
void for_dot_tiles(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* qa_sums, const float* sa,
                   int64_t M, const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc, Tile&& tile) {
  const int64_t blocks = layout.blocks();
  for (int64_t m = 0; m < M; m += kRows)
    with_rows<kRows>(M - m < kRows ? M - m : kRows, [&](auto rows) {
      for (int64_t p = p0; p < p1; ++p)
        tile(rows, qa + m * ldq, qa_sums + m * blocks, sa + m * blocks, B + p * layout.panel_bytes(),
             C + m * ldc + (p - p0) * kPanel);
    });
}

void quant_decode_portable(const QuantPanels&, const uint8_t*, float*);
void quant_activations_portable(const QuantPanels&, const float*, int64_t, int64_t, int8_t*, int64_t, float*, int32_t*);
void quant_code_rows_portable(const QuantPanels&, const uint8_t*, int64_t, uint8_t*);
void quant_add_dots_portable(const QuantBlockDots&, float*, int64_t);
void quant_dots_amx_model(const QuantTileSteps&, const QuantPanels&, const int8_t*, int64_t, const int32_t*,
                          const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#if defined(MOE_ONNX_HAVE_AMX)
void quant_dots_amx(const QuantTileSteps&, const QuantPanels&, const int8_t*, int64_t, const int32_t*, const float*,
                    int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#endif
void quant_dots_portable(const QuantPanels&, const int8_t*, int64_t, const int32_t*, const float*, int64_t,
                         const uint8_t*, int64_t, int64_t, float*, int64_t);
#if defined(MOE_ONNX_HAVE_AVX2)
void quant_fused_avx2(const QuantPanels&, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                      int64_t);
void quant_decode_avx2(const QuantPanels&, const uint8_t*, float*);
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
void quant_fused_avx512(const QuantPanels&, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                        int64_t);
void quant_decode_avx512(const QuantPanels&, const uint8_t*, float*);
void quant_activations_avx512(const QuantPanels&, const float*, int64_t, int64_t, int8_t*, int64_t, float*, int32_t*);
void quant_code_rows_avx512(const QuantPanels&, const uint8_t*, int64_t, uint8_t*);
void quant_add_dots_avx512(const QuantBlockDots&, float*, int64_t);
#endif
#if defined(MOE_ONNX_HAVE_NEON)
void quant_fused_neon(const QuantPanels&, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                      int64_t);
void quant_decode_neon(const QuantPanels&, const uint8_t*, float*);
#endif
#if defined(MOE_ONNX_HAVE_DOTPROD)
void quant_dots_dotprod(const QuantPanels&, const int8_t*, int64_t, const int32_t*, const float*, int64_t,
                        const uint8_t*, int64_t, int64_t, float*, int64_t);
#endif
#if defined(MOE_ONNX_HAVE_AVX512_VNNI)
void quant_dots_vnni(const QuantPanels&, const int8_t*, int64_t, const int32_t*, const float*, int64_t, const uint8_t*,
                     int64_t, int64_t, float*, int64_t);
#endif
}  // namespace detail

}  // namespace moe_onnx
