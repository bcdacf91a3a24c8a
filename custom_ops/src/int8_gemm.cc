#include "int8_gemm.h"

#include <cstring>

#include "common.h"
#include "isa.h"

namespace moe_onnx {

namespace detail {

void widen_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, int16_t* dst) {
  const int64_t stride = 2 * int8_pairs(K);
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* d = dst + r * stride;
    for (int64_t k = 0; k < K; ++k) d[k] = src[r * K + k];
    if (stride > K) d[K] = 0;
  }
}

void int8_gemm_panels_portable(const int16_t* A, int64_t lda, int64_t M, int64_t pairs, const int16_t* W_packed,
                               int64_t p0, int64_t p1, int32_t* C, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    const int16_t* B = W_packed + p * pairs * 2 * kInt8Panel;
    for (int64_t m = 0; m < M; ++m) {
      uint32_t acc[kInt8Panel] = {};  // unsigned: the sum wraps modulo 2^32 without overflow UB
      const int16_t* a = A + m * lda;
      for (int64_t q = 0; q < pairs; ++q) {
        const int32_t a0 = a[2 * q], a1 = a[2 * q + 1];
        const int16_t* b = B + q * 2 * kInt8Panel;
        for (int64_t c = 0; c < kInt8Panel; ++c)
          acc[c] += static_cast<uint32_t>(a0 * b[2 * c] + a1 * b[2 * c + 1]);
      }
      int32_t* out = C + m * ldc + (p - p0) * kInt8Panel;
      for (int64_t c = 0; c < kInt8Panel; ++c) out[c] = static_cast<int32_t>(acc[c]);
    }
  }
}

}  // namespace detail

namespace {
using Int8GemmFn = void (*)(const int16_t*, int64_t, int64_t, int64_t, const int16_t*, int64_t, int64_t, int32_t*,
                            int64_t);
using WidenFn = void (*)(const int8_t*, int64_t, int64_t, int16_t*);

struct Dispatch {
  Int8GemmFn fn = detail::int8_gemm_panels_portable;
  WidenFn widen = detail::widen_int8_rows_portable;
  Dispatch() {
#if defined(MOE_ONNX_HAVE_AVX2)
    if (isa_at_least(IsaLevel::kAvx2)) {
      fn = detail::int8_gemm_panels_avx2;
      widen = detail::widen_int8_rows_avx2;
    }
#endif
  }
};

const Dispatch& dispatch() {
  static const Dispatch d;
  return d;
}
}  // namespace

void int8_gemm_panels(const int16_t* A, int64_t lda, int64_t M, int64_t pairs, const int16_t* W_packed, int64_t p0,
                      int64_t p1, int32_t* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  if (pairs <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kInt8Panel) * 4);
    return;
  }
  dispatch().fn(A, lda, M, pairs, W_packed, p0, p1, C, ldc);
}

void widen_int8_rows(const int8_t* src, int64_t rows, int64_t K, int16_t* dst) {
  if (rows > 0) dispatch().widen(src, rows, K, dst);
}

}  // namespace moe_onnx
