// AVX2 micro-kernel of int8_gemm_panels; this file alone is compiled with -mavx2 and is only called
// after a run-time check of the CPU. vpmaddwd multiplies int16 pairs and adds each pair into an
// int32 (at most 2 * 128 * 128, no overflow); vpaddd then wraps modulo 2^32 like the reference.
#include <immintrin.h>

#include <cstring>

#include "int8_gemm.h"

namespace moe_onnx {
namespace detail {

// Pairs of k per block: a block of one panel (kPairBlock x 64 bytes) stays in L1 while every row
// tile of the call passes over it; partial sums go through C between blocks (integer sums: exact).
constexpr int64_t kPairBlock = 256;

static inline __m256i broadcast_pair(const int16_t* a) {
  int32_t pair;
  std::memcpy(&pair, a, sizeof pair);
  return _mm256_set1_epi32(pair);
}

// Rows are named variables, not arrays, so they stay in registers (see gemm_avx2.cc).
template <int MR>
static inline void micro_int8(const int16_t* A, int64_t lda, int64_t pairs, const int16_t* B, int32_t* C,
                              int64_t ldc, bool accumulate) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  auto load = [](const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if (accumulate) {
    c00 = load(C), c01 = load(C + 8);
    if (MR > 1) c10 = load(C + ldc), c11 = load(C + ldc + 8);
    if (MR > 2) c20 = load(C + 2 * ldc), c21 = load(C + 2 * ldc + 8);
    if (MR > 3) c30 = load(C + 3 * ldc), c31 = load(C + 3 * ldc + 8);
    if (MR > 4) c40 = load(C + 4 * ldc), c41 = load(C + 4 * ldc + 8);
    if (MR > 5) c50 = load(C + 5 * ldc), c51 = load(C + 5 * ldc + 8);
  }
  for (int64_t q = 0; q < pairs; ++q) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + q * 2 * kInt8Panel));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + q * 2 * kInt8Panel + 16));
    __m256i a = broadcast_pair(A + 2 * q);
    c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(a, b0));
    c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(a, b1));
    if (MR > 1) {
      a = broadcast_pair(A + lda + 2 * q);
      c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(a, b0));
      c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(a, b1));
    }
    if (MR > 2) {
      a = broadcast_pair(A + 2 * lda + 2 * q);
      c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(a, b0));
      c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(a, b1));
    }
    if (MR > 3) {
      a = broadcast_pair(A + 3 * lda + 2 * q);
      c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(a, b0));
      c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(a, b1));
    }
    if (MR > 4) {
      a = broadcast_pair(A + 4 * lda + 2 * q);
      c40 = _mm256_add_epi32(c40, _mm256_madd_epi16(a, b0));
      c41 = _mm256_add_epi32(c41, _mm256_madd_epi16(a, b1));
    }
    if (MR > 5) {
      a = broadcast_pair(A + 5 * lda + 2 * q);
      c50 = _mm256_add_epi32(c50, _mm256_madd_epi16(a, b0));
      c51 = _mm256_add_epi32(c51, _mm256_madd_epi16(a, b1));
    }
  }
  auto store = [](int32_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); };
  store(C, c00), store(C + 8, c01);
  if (MR > 1) store(C + ldc, c10), store(C + ldc + 8, c11);
  if (MR > 2) store(C + 2 * ldc, c20), store(C + 2 * ldc + 8, c21);
  if (MR > 3) store(C + 3 * ldc, c30), store(C + 3 * ldc + 8, c31);
  if (MR > 4) store(C + 4 * ldc, c40), store(C + 4 * ldc + 8, c41);
  if (MR > 5) store(C + 5 * ldc, c50), store(C + 5 * ldc + 8, c51);
}

void int8_gemm_panels_avx2(const int16_t* A, int64_t lda, int64_t M, int64_t pairs, const int16_t* W_packed,
                           int64_t p0, int64_t p1, int32_t* C, int64_t ldc) {
  for (int64_t p = p0; p < p1; ++p) {
    int32_t* Cp = C + (p - p0) * kInt8Panel;
    for (int64_t q0 = 0; q0 < pairs; q0 += kPairBlock) {
      const int64_t qb = pairs - q0 < kPairBlock ? pairs - q0 : kPairBlock;
      const int16_t* B = W_packed + (p * pairs + q0) * 2 * kInt8Panel;
      const int16_t* Aq = A + 2 * q0;
      const bool acc = q0 > 0;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) micro_int8<6>(Aq + m * lda, lda, qb, B, Cp + m * ldc, ldc, acc);
      switch (M - m) {
        case 5: micro_int8<5>(Aq + m * lda, lda, qb, B, Cp + m * ldc, ldc, acc); break;
        case 4: micro_int8<4>(Aq + m * lda, lda, qb, B, Cp + m * ldc, ldc, acc); break;
        case 3: micro_int8<3>(Aq + m * lda, lda, qb, B, Cp + m * ldc, ldc, acc); break;
        case 2: micro_int8<2>(Aq + m * lda, lda, qb, B, Cp + m * ldc, ldc, acc); break;
        case 1: micro_int8<1>(Aq + m * lda, lda, qb, B, Cp + m * ldc, ldc, acc); break;
        default: break;
      }
    }
  }
}

}  // namespace detail
}  // namespace moe_onnx
