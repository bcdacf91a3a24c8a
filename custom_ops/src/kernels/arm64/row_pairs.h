// C's rows in and out of the accumulators of the 2 x 2 matrix multiply-adds (SMMLA: arm64/i8mm/, BFMMLA:
// arm64/bf16/): acc[p][j] holds rows 2p, 2p + 1 x columns 2j, 2j + 1 of 16 columns, lanes (2p, 2j), (2p,
// 2j + 1), (2p + 1, 2j), (2p + 1, 2j + 1); for an odd MR the last pair's second row is zeros, never read
// or written. Int32 (SMMLA) or fp32 (BFMMLA) lanes: the same moves on either.
#pragma once

#include <arm_neon.h>

#include <cstdint>

namespace moe_onnx::detail::arm64 {

// The moves below for each element type: a row's two lanes of a register, zeros, two rows' halves joined,
// a register as its two 64-bit halves, a row's four lanes stored.
inline int32x2_t load_half(const int32_t* p) { return vld1_s32(p); }
inline float32x2_t load_half(const float* p) { return vld1_f32(p); }
inline int32x2_t zero_half(const int32_t*) { return vdup_n_s32(0); }
inline float32x2_t zero_half(const float*) { return vdup_n_f32(0.0f); }
inline int32x4_t join_halves(int32x2_t top, int32x2_t bottom) { return vcombine_s32(top, bottom); }
inline float32x4_t join_halves(float32x2_t top, float32x2_t bottom) { return vcombine_f32(top, bottom); }
inline uint64x2_t as_row_halves(int32x4_t v) { return vreinterpretq_u64_s32(v); }
inline uint64x2_t as_row_halves(float32x4_t v) { return vreinterpretq_u64_f32(v); }
inline void store_row(int32_t* p, uint64x2_t v) { vst1q_s32(p, vreinterpretq_s32_u64(v)); }
inline void store_row(float* p, uint64x2_t v) { vst1q_f32(p, vreinterpretq_f32_u64(v)); }

// acc[p][j] = C's values of its lanes where `accumulate`, else zeros.
template <int MR, class Vector, class T>
inline void load_row_pairs(Vector (&acc)[(MR + 1) / 2][8], const T* C, int64_t ldc, bool accumulate) {
#pragma GCC unroll 4
  for (int p = 0; p < (MR + 1) / 2; ++p) {
    const bool second = 2 * p + 1 < MR;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const auto top = accumulate ? load_half(C + 2 * p * ldc + 2 * j) : zero_half(C);
      const auto bottom = accumulate && second ? load_half(C + (2 * p + 1) * ldc + 2 * j) : zero_half(C);
      acc[p][j] = join_halves(top, bottom);
    }
  }
}

// C's rows r < MR = the accumulators' lanes.
template <int MR, class Vector, class T>
inline void store_row_pairs(const Vector (&acc)[(MR + 1) / 2][8], T* C, int64_t ldc) {
#pragma GCC unroll 4
  for (int p = 0; p < (MR + 1) / 2; ++p) {
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const uint64x2_t left = as_row_halves(acc[p][j]), right = as_row_halves(acc[p][j + 1]);
      store_row(C + 2 * p * ldc + 2 * j, vzip1q_u64(left, right));
      if (2 * p + 1 < MR) store_row(C + (2 * p + 1) * ldc + 2 * j, vzip2q_u64(left, right));
    }
  }
}

}  // namespace moe_onnx::detail::arm64
