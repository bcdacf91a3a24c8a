#include "float_rows.h"

#include "isa.h"

namespace moe_onnx {
namespace detail {
namespace {

template <FloatType T>
void widen_elements(const void* src, int64_t done, float* dst, int64_t n) {
  for (int64_t i = done; i < n; ++i) dst[i] = to_fp32<T>(src, i);
}

template <class Narrow>
void narrow_elements(const float* src, int64_t done, void* dst, int64_t n, Narrow narrow) {
  auto* d = static_cast<uint16_t*>(dst);
  for (int64_t i = done; i < n; ++i) d[i] = narrow(src[i]);
}

}  // namespace

void widen_row_from(FloatType type, const void* src, int64_t done, float* dst, int64_t n) {
  switch (type) {
    case FloatType::kF16: return widen_elements<FloatType::kF16>(src, done, dst, n);
    case FloatType::kBF16: return widen_elements<FloatType::kBF16>(src, done, dst, n);
    default:
      if (n > done) std::memcpy(dst + done, static_cast<const float*>(src) + done, static_cast<size_t>(n - done) * 4);
  }
}

void widen_row_portable(FloatType type, const void* src, float* dst, int64_t n) { widen_row_from(type, src, 0, dst, n); }

void narrow_row_from(FloatType type, const float* src, int64_t done, void* dst, int64_t n) {
  switch (type) {
    case FloatType::kF16: return narrow_elements(src, done, dst, n, float_to_half);
    case FloatType::kBF16: return narrow_elements(src, done, dst, n, float_to_bf16);
    default:
      if (n > done) std::memcpy(static_cast<float*>(dst) + done, src + done, static_cast<size_t>(n - done) * 4);
  }
}

void narrow_row_portable(FloatType type, const float* src, void* dst, int64_t n) {
  narrow_row_from(type, src, 0, dst, n);
}

}  // namespace detail

void widen_row(FloatType type, const void* src, float* dst, int64_t n) {
  if (n > 0) kernels().widen_row(type, src, dst, n);
}

void narrow_row(FloatType type, const float* src, void* dst, int64_t n) {
  if (n > 0) kernels().narrow_row(type, src, dst, n);
}

}  // namespace moe_onnx
