#include "int8_gemm.h"

#include <cstring>

#include "isa.h"

namespace moe_onnx {

namespace detail {

void widen_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, void* dst) {
  const int64_t stride = 2 * int8_pairs(K);
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* d = static_cast<int16_t*>(dst) + r * stride;
    for (int64_t k = 0; k < K; ++k) d[k] = src[r * K + k];
    if (stride > K) d[K] = 0;
  }
}

void int8_gemm_pairs_portable(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                              int64_t p1, int32_t* C, int64_t ldc) {
  const int64_t pairs = int8_pairs(K);
  for (int64_t p = p0; p < p1; ++p) {
    const int16_t* B = static_cast<const int16_t*>(W_packed) + p * pairs * 2 * kInt8Panel;
    for (int64_t m = 0; m < M; ++m) {
      uint32_t acc[kInt8Panel] = {};  // unsigned: the sum wraps modulo 2^32 without overflow UB
      const int16_t* a = reinterpret_cast<const int16_t*>(static_cast<const char*>(A) + m * lda);
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

void bias_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, void* dst) {
  const int64_t stride = 4 * int8_quads(K);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* d = static_cast<uint8_t*>(dst) + r * stride;
    for (int64_t k = 0; k < K; ++k) d[k] = static_cast<uint8_t>(src[r * K + k] ^ 0x80);
    for (int64_t k = K; k < stride; ++k) d[k] = 0x80;
  }
}

void copy_int8_rows_portable(const int8_t* src, int64_t rows, int64_t K, void* dst) {
  const int64_t stride = 8 * int8_octets(K);
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* d = static_cast<int8_t*>(dst) + r * stride;
    std::memcpy(d, src + r * K, static_cast<size_t>(K));
    std::memset(d + K, 0, static_cast<size_t>(stride - K));
  }
}

}  // namespace detail

Int8Layout int8_layout() { return kernels().int8_gemm.layout; }

const char* int8_layout_name(Int8Layout layout) {
  switch (layout) {
    case Int8Layout::kPairs: return "pairs";
    case Int8Layout::kQuads: return "quads";
    case Int8Layout::kOctets: return "octets";
  }
  return "unknown";
}

int64_t int8_row_bytes(int64_t K) {
  switch (int8_layout()) {
    case Int8Layout::kQuads: return 4 * int8_quads(K);
    case Int8Layout::kOctets: return 8 * int8_octets(K);
    default: return 2 * 2 * int8_pairs(K);
  }
}

void int8_gemm_panels(const void* A, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0, int64_t p1,
                      int32_t* C, int64_t ldc) {
  if (M <= 0 || p1 <= p0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, static_cast<size_t>((p1 - p0) * kInt8Panel) * 4);
    return;
  }
  const Int8GemmKernels& kernel = kernels().int8_gemm;
  (kernel.tiles && M >= kInt8TileRows ? kernel.tiles.fn : kernel.multiply)(A, lda, M, K, W_packed, p0, p1, C, ldc);
}

void prepare_int8_rows(const int8_t* src, int64_t rows, int64_t K, void* dst) {
  if (rows > 0) kernels().int8_gemm.prepare(src, rows, K, dst);
}

}  // namespace moe_onnx
