#include "qgemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "bf16_gemm.h"
#include "isa.h"
#include "workspace.h"

namespace moe_onnx {
namespace detail {
namespace {

// Row kk (< block) of column c of a block's codes.
int32_t code_at(const QuantPanels& layout, const uint8_t* codes, int64_t kk, int64_t c) {
  const int64_t G = layout.group_rows(), i = kk % G;
  const uint8_t* lane = codes + (kk / G) * kQuantGroupBytes + c * 4;
  if (layout.code == QuantCode::kInt8) return lane[i];
  return i < 4 ? lane[i] & 15 : lane[i - 4] >> 4;
}

// Column c's scale in a block's header: fp32, or E8M0 for E2M1 codes.
float scale_at(const QuantPanels& layout, const uint8_t* block, int64_t c) {
  if (layout.code == QuantCode::kE2M1) return float_from_bits(e8m0_scale_bits(block[c]));
  float s;
  std::memcpy(&s, block + 4 * c, 4);
  return s;
}

int32_t zero_point_at(const QuantPanels& layout, const uint8_t* block, int64_t c) {
  return layout.zero_points ? block[64 + c] : layout.default_zero_point();
}

}  // namespace

void quant_decode_portable(const QuantPanels& layout, const uint8_t* block, float* out) {
  const uint8_t* codes = block + layout.header_bytes();
  for (int64_t kk = 0; kk < layout.block; ++kk)
    for (int64_t c = 0; c < kPanel; ++c) {
      const int32_t q = code_at(layout, codes, kk, c);
      const float value = layout.code == QuantCode::kE2M1 ? kE2M1Values[q]
                                                          : static_cast<float>(q - zero_point_at(layout, block, c));
      out[kk * kPanel + c] = value * scale_at(layout, block, c);
    }
}

void quantize_activation_block(const float* a, int64_t block, int64_t padded, int8_t* q, float* sa, int32_t* sum) {
  float amax = 0.0f;  // NaN when the block has one (numpy's max)
  for (int64_t kk = 0; kk < block && !std::isnan(amax); ++kk)
    amax = std::isnan(a[kk]) ? a[kk] : std::max(amax, std::fabs(a[kk]));
  const float s = amax / 127.0f;  // NaN: every qa is 0 and the block's term NaN, as the reference's
  int32_t total = 0;
  for (int64_t kk = 0; kk < padded; ++kk) {
    const float v = kk < block && s != 0.0f ? std::nearbyint(a[kk] / s) : 0.0f;
    q[kk] = static_cast<int8_t>(v >= 127.0f ? 127 : v <= -127.0f ? -127 : v == v ? static_cast<int>(v) : 0);
    total += q[kk];
  }
  *sa = s;
  *sum = total;
}

void quant_activations_portable(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, int8_t* qa,
                                int64_t ldq, float* sa, int32_t* sums) {
  const int64_t blocks = layout.blocks(), padded = layout.activation_block();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b)
      quantize_activation_block(A + m * lda + b * layout.block, layout.block, padded, qa + m * ldq + b * padded,
                                sa + m * blocks + b, sums + m * blocks + b);
}

void quant_dots_portable(const QuantPanels& layout, const int8_t* qa, int64_t ldq, const int32_t* qa_sums,
                         const float* sa, int64_t M, const uint8_t* B, int64_t p0, int64_t p1, float* C, int64_t ldc) {
  const int64_t blocks = layout.blocks(), padded = layout.activation_block();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = p0; p < p1; ++p) {
      float* out = C + m * ldc + (p - p0) * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) out[c] = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = B + p * layout.panel_bytes() + b * layout.block_bytes();
        const uint8_t* codes = block + layout.header_bytes();
        const int8_t* a = qa + m * ldq + b * padded;
        for (int64_t c = 0; c < kPanel; ++c) {
          uint32_t dot = 0;  // unsigned: wraps modulo 2^32 as vpdpbusd does (only past K of ~66000)
          for (int64_t kk = 0; kk < layout.block; ++kk)
            dot += static_cast<uint32_t>(a[kk] * code_at(layout, codes, kk, c));
          dot -= static_cast<uint32_t>(zero_point_at(layout, block, c)) * static_cast<uint32_t>(qa_sums[m * blocks + b]);
          out[c] += (sa[m * blocks + b] * scale_at(layout, block, c)) * static_cast<float>(static_cast<int32_t>(dot));
        }
      }
    }
}

void quant_code_rows_portable(const QuantPanels& layout, const uint8_t* panel, int64_t block_k, uint8_t* rows) {
  for (int64_t b = 0; b < layout.blocks(); ++b) {
    const uint8_t* codes = panel + b * layout.block_bytes() + layout.header_bytes();
    for (int64_t c = 0; c < kPanel; ++c)
      for (int64_t k = 0; k < block_k; ++k)
        rows[b * block_k * kPanel + (k / 4) * 4 * kPanel + c * 4 + k % 4] =
            static_cast<uint8_t>(k < layout.block ? code_at(layout, codes, k, c) : 0);
  }
}

void quant_add_dots_portable(const QuantBlockDots& d, float* out, int64_t ldc) {
  for (int64_t m = 0; m < d.rows; ++m)
    for (int64_t i = 0; i < d.count; ++i) {
      const int32_t* dots = d.dots + i * d.block_stride + m * kPanel;
      const uint8_t* header = d.headers + i * d.header_stride;
      const float* scales = reinterpret_cast<const float*>(header);
      const float sa = d.sa[m * d.stride + i];
      for (int64_t c = 0; c < kPanel; ++c) {
        const uint32_t zero_point = d.zero_points ? header[64 + c] : static_cast<uint32_t>(d.default_zero_point);
        const uint32_t sum = static_cast<uint32_t>(d.sums[m * d.stride + i]);
        const uint32_t dot = static_cast<uint32_t>(dots[c]) - zero_point * sum;
        out[m * ldc + c] += (sa * scales[c]) * static_cast<float>(static_cast<int32_t>(dot));
      }
    }
}

}  // namespace detail

namespace {

// Panels dequantized per fp32 GEMM call: two, the fp32 kernel's widest tile for M > 2.
constexpr int64_t kDecodedPanels = 2;

// Per pair of panels: their weights dequantized into fp32 panels, then the fp32 GEMM.
void decode_then_gemm(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  const int64_t panel_floats = layout.K * kPanel;
  Scratch scratch;
  float* decoded = scratch.take<float>(kDecodedPanels * panel_floats, "the dequantized weight panels");
  for (int64_t p = p0; p < p1; p += kDecodedPanels) {
    const int64_t n = std::min(kDecodedPanels, p1 - p);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t b = 0; b < layout.blocks(); ++b)
        kernels().quant_decode(layout, B + (p + j) * layout.panel_bytes() + b * layout.block_bytes(),
                          decoded + j * panel_floats + b * layout.block * kPanel);
    gemm_panels(FloatType::kF32, A, lda, M, layout.K, decoded, 0, n, C + (p - p0) * kPanel, ldc);
  }
}

// Level 3's prefill: the rows rounded to bf16 once per call; per pair of panels, their weights
// dequantized (fp32, as level 0's) and rounded into bf16 pair panels, then the bf16 GEMM.
void decode_then_bf16_gemm(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const uint8_t* B,
                           int64_t p0, int64_t p1, float* C, int64_t ldc) {
  const int64_t K = layout.K, panel_elements = bf16_pair_panel_elements(K), ldr = bf16_row_stride(K);
  Scratch scratch;
  uint16_t* rows = scratch.take<uint16_t>(M * ldr, "the bf16 activation rows");
  for (int64_t m = 0; m < M; ++m) bf16_row(FloatType::kF32, A + m * lda, K, rows + m * ldr);
  float* decoded = scratch.take<float>(layout.block * kPanel, "a dequantized weight block");
  uint16_t* pairs = scratch.take<uint16_t>(kDecodedPanels * panel_elements, "the dequantized bf16 weight panels");
  for (int64_t j = 0; j < kDecodedPanels; ++j)  // the rows past K stay zero (from the pair that holds K)
    std::fill(pairs + j * panel_elements + K / 2 * 2 * kPanel, pairs + (j + 1) * panel_elements, uint16_t{0});
  for (int64_t p = p0; p < p1; p += kDecodedPanels) {
    const int64_t n = std::min(kDecodedPanels, p1 - p);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t b = 0; b < layout.blocks(); ++b) {
        kernels().quant_decode(layout, B + (p + j) * layout.panel_bytes() + b * layout.block_bytes(), decoded);
        uint16_t* panel = pairs + j * panel_elements;
        for (int64_t kk = 0; kk < layout.block; ++kk) {
          const int64_t k = b * layout.block + kk;
          uint16_t* pair_row = panel + (k / 2) * 2 * kPanel + k % 2;
          for (int64_t c = 0; c < kPanel; ++c) pair_row[2 * c] = float_to_bf16(decoded[kk * kPanel + c]);
        }
      }
    bf16_gemm_panels(rows, ldr, M, K, pairs, 0, n, C + (p - p0) * kPanel, ldc);
  }
}

// C's rows m < M, `panels` panels wide: zero (K = 0).
void zero_panels(int64_t M, int64_t panels, float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>(panels * kPanel) * sizeof(float));
}

}  // namespace

void quantize_int8_rows(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const Int8Rows& rows) {
  if (M > 0 && layout.K > 0) kernels().quant_activations(layout, A, lda, M, rows.qa, rows.ldq, rows.sa, rows.sums);
}

void quant_gemm_int8_rows(const QuantPanels& layout, const Int8Rows& rows, int64_t M, const void* B_packed, int64_t p0,
                          int64_t p1, float* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  if (layout.K <= 0) return zero_panels(M, p1 - p0, C, ldc);
  const auto* B = static_cast<const uint8_t*>(B_packed);
  const KernelTable& table = kernels();
  if (table.quant_tiles && M >= kQuantTileRows && layout.block >= kQuantTileBlock)
    return table.quant_tiles(table.quant_tile_steps, layout, rows.qa, rows.ldq, rows.sums, rows.sa, M, B, p0, p1, C,
                             ldc);
  table.quant_dots(layout, rows.qa, rows.ldq, rows.sums, rows.sa, M, B, p0, p1, C, ldc);
}

void quant_gemm_panels(const QuantPanels& layout, const float* A, int64_t lda, int64_t M, const void* B_packed,
                       int64_t p0, int64_t p1, float* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  const auto* B = static_cast<const uint8_t*>(B_packed);
  if (layout.K <= 0) return zero_panels(M, p1 - p0, C, ldc);
  if (layout.int8_activations) throw std::logic_error("internal: level-4 panels multiply quantized rows");
  if (layout.bf16_prefill && M > kFusedRows) return decode_then_bf16_gemm(layout, A, lda, M, B, p0, p1, C, ldc);
  if (M <= kFusedRows && kernels().quant_fused) return kernels().quant_fused(layout, A, lda, M, B, p0, p1, C, ldc);
  decode_then_gemm(layout, A, lda, M, B, p0, p1, C, ldc);
}

}  // namespace moe_onnx
