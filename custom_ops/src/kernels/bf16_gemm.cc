#include "bf16_gemm.h"

#include <cfloat>
#include <cmath>
#include <cstring>

#include "isa.h"

namespace moe_onnx {
namespace detail {
namespace {

// An fp32 value below the normal range as a zero of its sign (vdpbf16ps's DAZ on its inputs and FTZ
// on its result); NaN and the rest unchanged.
inline float flush_denormal(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

// acc + a * b as one vdpbf16ps lane step: a fused multiply-add of the flushed operands, its result
// flushed.
inline float dot_step(float acc, uint16_t a, uint16_t b) {
  return flush_denormal(
      std::fma(flush_denormal(bf16_to_float(a)), flush_denormal(bf16_to_float(b)), flush_denormal(acc)));
}

}  // namespace

void bf16_gemm_portable(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                        int64_t p1, float* C, int64_t ldc) {
  const auto* B = static_cast<const uint16_t*>(B_packed);
  const int64_t panel = K * kPanel;  // elements of a pair panel
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel; ++c) {
        const uint16_t* a = A + m * lda;
        const uint16_t* b = B + p * panel + 2 * c;
        float acc = 0.0f;
        for (int64_t j = 0; j < K / 2; ++j) {  // pair j: the odd k first, as vdpbf16ps
          acc = dot_step(acc, a[2 * j + 1], b[j * 2 * kPanel + 1]);
          acc = dot_step(acc, a[2 * j], b[j * 2 * kPanel]);
        }
        C[m * ldc + (p - p0) * kPanel + c] = acc;
      }
}

}  // namespace detail

void bf16_gemm_panels(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                      int64_t p1, float* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  const int64_t padded = bf16_padded_k(K);
  if (padded == 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kPanel) * sizeof(float));
    return;
  }
  const KernelTable& table = kernels();
  if (M >= kBf16TileRows && table.bf16_gemm_tiles)
    return table.bf16_gemm_tiles(A, lda, M, padded, B_packed, p0, p1, C, ldc);
  table.bf16_gemm(A, lda, M, padded, B_packed, p0, p1, C, ldc);
}

void round_to_bf16(FloatType type, const void* src, int64_t n, uint16_t* dst) {
  switch (type) {
    case FloatType::kBF16: std::memcpy(dst, src, static_cast<size_t>(n) * 2); break;
    case FloatType::kF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(half_to_float(in[i]));
      break;
    }
    default: narrow_row(FloatType::kBF16, static_cast<const float*>(src), dst, n);
  }
}

void bf16_row(FloatType type, const void* src, int64_t n, uint16_t* dst) {
  round_to_bf16(type, src, n, dst);
  std::memset(dst + n, 0, static_cast<size_t>(bf16_padded_k(n) - n) * 2);
}

}  // namespace moe_onnx
