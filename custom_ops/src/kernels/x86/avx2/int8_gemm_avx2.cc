// AVX2 micro-kernels of int8_gemm_panels (the pair layout); this file alone is compiled with -mavx2
// and is only called after a run-time check of the CPU. vpmaddwd multiplies int16 pairs and adds
// each pair into an int32 (at most 2 * 128 * 128, no overflow); vpaddd then wraps modulo 2^32 like
// the reference.
//
// Without VNNI this pair (one multiply, one add per 16 products) is the fastest exact int8 product
// AVX2 has: vpmaddubsw does 32 products per instruction but saturates its int16 pair sums, and the
// splits that keep it exact cost more instructions than they save. On AMD Zen 3 the pair issues at
// about 1.6 per cycle: 25 products per cycle against the 16 of two fp32 FMAs.
#include <immintrin.h>

#include "int8_gemm.h"

namespace moe_onnx {
namespace detail {

// Pairs of k per block: a block of one panel (kPairBlock x 64 bytes) stays in L1 while every row
// tile of the call passes over it; partial sums go through C between blocks (integer sums: exact).
constexpr int64_t kPairBlock = 256;

// The loops are written in assembly: compilers keep the accumulators in registers but copy each sum
// back into its register after the add, and those copies cost a quarter of the throughput. Per pair
// step ymm0-1 hold the panel row (16 columns x 2 k) and each row broadcasts its pair into ymm2.
#define MOE_ONNX_INT8_ROW(addr, acc0, acc1)      \
  "vpbroadcastd " addr ", %%ymm2\n\t"            \
  "vpmaddwd %%ymm0, %%ymm2, %%ymm3\n\t"          \
  "vpmaddwd %%ymm1, %%ymm2, %%ymm2\n\t"          \
  "vpaddd %%ymm3, %[" acc0 "], %[" acc0 "]\n\t" \
  "vpaddd %%ymm2, %[" acc1 "], %[" acc1 "]\n\t"
#define MOE_ONNX_INT8_LOOP(rows)                 \
  "test %[n], %[n]\n\t"                          \
  "jz 2f\n\t"                                    \
  ".p2align 5\n"                                 \
  "1:\n\t"                                       \
  "vmovdqu (%[b]), %%ymm0\n\t"                   \
  "vmovdqu 32(%[b]), %%ymm1\n\t" rows            \
  "add $64, %[b]\n\t"                            \
  "add $4, %[a]\n\t"                             \
  "add $4, %[a3]\n\t"                            \
  "dec %[n]\n\t"                                 \
  "jnz 1b\n"                                     \
  "2:\n\t"
#define MOE_ONNX_INT8_POINTERS [a] "+r"(a), [a3] "+r"(a3), [b] "+r"(b), [n] "+r"(n)
#define MOE_ONNX_INT8_CLOBBERS "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3"

// MR (1-4) rows x 16 columns of one panel over `pairs` pair steps. Rows 0-2 are read at a, a + s,
// a + 2s (s = the row stride in bytes), row 3 at a3. Every `every` steps one line of `pf` (the next
// block) is prefetched into L2, `pf_lines` lines in all: the memory works while the tiles compute.
template <int MR>
static inline void micro_int8(const int16_t* A, int64_t lda, int64_t pairs, const int16_t* B, int32_t* C,
                              int64_t ldc, bool accumulate, const char* pf, int64_t pf_lines) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  auto load = [](const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if (accumulate) {
    c00 = load(C), c01 = load(C + 8);
    if (MR > 1) c10 = load(C + ldc), c11 = load(C + ldc + 8);
    if (MR > 2) c20 = load(C + 2 * ldc), c21 = load(C + 2 * ldc + 8);
    if (MR > 3) c30 = load(C + 3 * ldc), c31 = load(C + 3 * ldc + 8);
  }
  const int16_t* a = A;
  const int16_t* a3 = A + (MR > 3 ? 3 * lda : 0);
  const int16_t* b = B;
  const int64_t s = lda * static_cast<int64_t>(sizeof(int16_t));
  const int64_t every = pf_lines > 0 && pairs / pf_lines > 0 ? pairs / pf_lines : pairs;
  for (int64_t done = 0; done < pairs; done += every) {
    int64_t n = pairs - done < every ? pairs - done : every;
    if (pf_lines-- > 0) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    if constexpr (MR == 4) {
      __asm__ volatile(MOE_ONNX_INT8_LOOP(MOE_ONNX_INT8_ROW("(%[a])", "c00", "c01")
                                              MOE_ONNX_INT8_ROW("(%[a],%[s],1)", "c10", "c11")
                                                  MOE_ONNX_INT8_ROW("(%[a],%[s],2)", "c20", "c21")
                                                      MOE_ONNX_INT8_ROW("(%[a3])", "c30", "c31"))
                       : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20),
                         [c21] "+x"(c21), [c30] "+x"(c30), [c31] "+x"(c31), MOE_ONNX_INT8_POINTERS
                       : [s] "r"(s)
                       : MOE_ONNX_INT8_CLOBBERS);
    } else if constexpr (MR == 3) {
      __asm__ volatile(MOE_ONNX_INT8_LOOP(MOE_ONNX_INT8_ROW("(%[a])", "c00", "c01")
                                              MOE_ONNX_INT8_ROW("(%[a],%[s],1)", "c10", "c11")
                                                  MOE_ONNX_INT8_ROW("(%[a],%[s],2)", "c20", "c21"))
                       : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20),
                         [c21] "+x"(c21), MOE_ONNX_INT8_POINTERS
                       : [s] "r"(s)
                       : MOE_ONNX_INT8_CLOBBERS);
    } else if constexpr (MR == 2) {
      __asm__ volatile(MOE_ONNX_INT8_LOOP(MOE_ONNX_INT8_ROW("(%[a])", "c00", "c01")
                                              MOE_ONNX_INT8_ROW("(%[a],%[s],1)", "c10", "c11"))
                       : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), MOE_ONNX_INT8_POINTERS
                       : [s] "r"(s)
                       : MOE_ONNX_INT8_CLOBBERS);
    } else {
      static_assert(MR == 1, "1 to 4 rows");
      __asm__ volatile(MOE_ONNX_INT8_LOOP(MOE_ONNX_INT8_ROW("(%[a])", "c00", "c01"))
                       : [c00] "+x"(c00), [c01] "+x"(c01), MOE_ONNX_INT8_POINTERS
                       :
                       : MOE_ONNX_INT8_CLOBBERS);
    }
  }
  auto store = [](int32_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); };
  store(C, c00), store(C + 8, c01);
  if (MR > 1) store(C + ldc, c10), store(C + ldc + 8, c11);
  if (MR > 2) store(C + 2 * ldc, c20), store(C + 2 * ldc + 8, c21);
  if (MR > 3) store(C + 3 * ldc, c30), store(C + 3 * ldc + 8, c31);
}

#undef MOE_ONNX_INT8_ROW
#undef MOE_ONNX_INT8_LOOP
#undef MOE_ONNX_INT8_POINTERS
#undef MOE_ONNX_INT8_CLOBBERS

void widen_int8_rows_avx2(const int8_t* src, int64_t rows, int64_t K, void* dst) {
  const int64_t stride = 2 * int8_pairs(K);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* s = src + r * K;
    int16_t* d = static_cast<int16_t*>(dst) + r * stride;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k))));
    for (; k < K; ++k) d[k] = s[k];
    if (stride > K) d[K] = 0;
  }
}

void int8_gemm_pairs_avx2(const void* A_rows, int64_t lda_bytes, int64_t M, int64_t K, const void* W_packed,
                          int64_t p0, int64_t p1, int32_t* C, int64_t ldc) {
  const int16_t* A = static_cast<const int16_t*>(A_rows);
  const int64_t lda = lda_bytes / 2, pairs = int8_pairs(K);
  // Row tiles of equal height, at most 4 (17 rows: 4 + 4 + 3 + 3 + 3, not 4 x 4 + 1): a short tile
  // spends as much on loads and loop control as on products.
  const int64_t tiles = (M + 3) / 4, base = M / tiles, extra = M % tiles;
  for (int64_t p = p0; p < p1; ++p) {
    int32_t* Cp = C + (p - p0) * kInt8Panel;
    for (int64_t q0 = 0; q0 < pairs; q0 += kPairBlock) {
      const int64_t qb = pairs - q0 < kPairBlock ? pairs - q0 : kPairBlock;
      const int16_t* B = static_cast<const int16_t*>(W_packed) + (p * pairs + q0) * 2 * kInt8Panel;
      const int16_t* Aq = A + 2 * q0;
      const bool acc = q0 > 0;
      // The next block (contiguous: the next pair block or the next panel) goes to L2 while the
      // tiles compute on this one, each tile fetching its share of the lines (one per pair step).
      const int64_t share = (qb + tiles - 1) / tiles;
      const char* next = reinterpret_cast<const char*>(B + qb * 2 * kInt8Panel);
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = base + (t < extra ? 1 : 0);
        const int16_t* At = Aq + m * lda;
        int32_t* Ct = Cp + m * ldc;
        const char* pf = next + t * share * 64;
        switch (rows) {
          case 4: micro_int8<4>(At, lda, qb, B, Ct, ldc, acc, pf, share); break;
          case 3: micro_int8<3>(At, lda, qb, B, Ct, ldc, acc, pf, share); break;
          case 2: micro_int8<2>(At, lda, qb, B, Ct, ldc, acc, pf, share); break;
          default: micro_int8<1>(At, lda, qb, B, Ct, ldc, acc, pf, share); break;
        }
        m += rows;
      }
    }
  }
}

}  // namespace detail
}  // namespace moe_onnx
