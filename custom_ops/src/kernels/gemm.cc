#include "gemm.h"

#include <cstring>

#include "isa.h"

namespace moe_onnx {
namespace detail {

// a * b + c as the portable chain takes it: fused where the architecture's base instruction set has a
// fused multiply-add (aarch64), else a multiply then an add (x86-64: this file is compiled without -mfma).
static inline float multiply_add(float a, float b, float c) {
#if defined(__aarch64__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Element c of panel row k as fp32 (bf16 rows are stored in bf16_lane order).
template <FloatType W>
static inline float panel_element(const void* B, int64_t k, int64_t c) {
  return to_fp32<W>(B, k * kPanel + (W == FloatType::kBF16 ? bf16_lane(c) : c));
}

template <FloatType W, int MR>
static void micro_portable(const float* A, int64_t lda, int64_t K, const void* B, float* C, int64_t ldc) {
  float acc[MR][kPanel];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kPanel; ++c) acc[r][c] = 0.0f;
  float b[kPanel];
  for (int64_t k = 0; k < K; ++k) {
    for (int c = 0; c < kPanel; ++c) b[c] = panel_element<W>(B, k, c);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      for (int c = 0; c < kPanel; ++c) acc[r][c] = multiply_add(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(C + r * ldc, acc[r], sizeof acc[r]);
}

template <FloatType W>
static void gemm_portable(const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                          int64_t p1, float* C, int64_t ldc) {
  const size_t esz = float_size(W);
  const int64_t stride = K * kPanel;  // elements per panel
  for (int64_t p = p0; p < p1; ++p) {
    const void* B = static_cast<const char*>(B_packed) + static_cast<size_t>(p * stride) * esz;
    float* Cp = C + (p - p0) * kPanel;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) micro_portable<W, 4>(A + m * lda, lda, K, B, Cp + m * ldc, ldc);
    for (; m < M; ++m) micro_portable<W, 1>(A + m * lda, lda, K, B, Cp + m * ldc, ldc);
  }
}

void gemm_panels_portable(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed,
                          int64_t p0, int64_t p1, float* C, int64_t ldc) {
  with_float_type(type,
                  [&](auto w) { gemm_portable<decltype(w)::value>(A, lda, M, K, B_packed, p0, p1, C, ldc); });
}

}  // namespace detail

void gemm_panels(FloatType type, const float* A, int64_t lda, int64_t M, int64_t K, const void* B_packed, int64_t p0,
                 int64_t p1, float* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kPanel) * sizeof(float));
    return;
  }
  kernels().gemm_panels(type, A, lda, M, K, B_packed, p0, p1, C, ldc);
}

}  // namespace moe_onnx
