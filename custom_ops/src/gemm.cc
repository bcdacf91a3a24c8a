#include "gemm.h"

#include <cstdlib>
#include <cstring>

namespace moe_onnx {
namespace detail {

template <int MR>
static void micro_portable(const float* A, int64_t lda, int64_t K, const float* B, float* C, int64_t ldc) {
  float acc[MR][kPanel];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kPanel; ++c) acc[r][c] = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * kPanel;
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      for (int c = 0; c < kPanel; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(C + r * ldc, acc[r], sizeof acc[r]);
}

void gemm_panels_portable(const float* A, int64_t lda, int64_t M, int64_t K, const float* B_packed, int64_t p0,
                          int64_t p1, float* C, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* B = B_packed + p * K * kPanel;
    float* Cp = C + (p - p0) * kPanel;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) micro_portable<4>(A + m * lda, lda, K, B, Cp + m * ldc, ldc);
    for (; m < M; ++m) micro_portable<1>(A + m * lda, lda, K, B, Cp + m * ldc, ldc);
  }
}

}  // namespace detail

namespace {
using GemmFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t);

struct Dispatch {
  GemmFn fn = detail::gemm_panels_portable;
  const char* name = "portable";
  Dispatch() {
    const char* force = std::getenv("MOE_ONNX_GEMM");
    if (force && std::strcmp(force, "portable") == 0) return;
#if defined(MOE_ONNX_HAVE_AVX2) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      fn = detail::gemm_panels_avx2;
      name = "avx2-fma";
    }
#endif
  }
};

const Dispatch& dispatch() {
  static const Dispatch d;
  return d;
}
}  // namespace

void gemm_panels(const float* A, int64_t lda, int64_t M, int64_t K, const float* B_packed, int64_t p0, int64_t p1,
                 float* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kPanel) * sizeof(float));
    return;
  }
  dispatch().fn(A, lda, M, K, B_packed, p0, p1, C, ldc);
}

const char* gemm_isa() { return dispatch().name; }

}  // namespace moe_onnx
