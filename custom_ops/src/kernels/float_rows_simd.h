// widen_row (float_rows.h) written once over a vector mapping V (avx2/simd_avx2.h, avx512/simd_avx512.h):
// V::kLanes elements at a time through the mapping's widening, the tail by the portable form. Included
// by the ISA folders' float_rows files only, compiled with their flags.
#pragma once

#include <cstdint>

#include "float_rows.h"

namespace moe_onnx::detail {

template <class V>
void widen_row_simd(FloatType type, const void* src, float* dst, int64_t n) {
  const auto* s16 = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (type == FloatType::kF16) {
    for (; i + V::kLanes <= n; i += V::kLanes) V::store(dst + i, V::widen_f16(s16 + i));
  } else if (type == FloatType::kBF16) {
    for (; i + V::kLanes <= n; i += V::kLanes) V::store(dst + i, V::widen_bf16(s16 + i));
  }
  widen_row_from(type, src, i, dst, n);
}

}  // namespace moe_onnx::detail
