// The loops every int8 GEMM of the octet layout (int8_gemm.h: X rows as they are, W in panels of
// [octets][16 columns][8] int8) shares on aarch64: panels, K blocks, row tiles of equal height, the next
// block prefetched; each kernel (arm64/neon/int8_gemm_neon.cc: SMULL + SADALP, arm64/dotprod/: SDOT,
// arm64/i8mm/: SMMLA) brings its tile. Included only by those files: each instantiates it with its own
// tile type, compiled with its own flags.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "int8_gemm.h"
#include "row_dispatch.h"

namespace moe_onnx::detail::arm64 {

constexpr int64_t kOctetRowBytes = 8 * kInt8Panel;  // one octet of k for the 16 columns of a panel
// Octets per K block: a panel's block (32 KB) stays in L1 while every row tile of the call passes over
// it; the int32 partial sums go through C between blocks (wrapping sums: exact).
constexpr int64_t kOctetBlock = 256;

// A prefetch of the next block into L2: a line every `every` octet steps (step()), `lines` lines in all.
struct Prefetch {
  const char* next;
  int64_t every, lines;
  int64_t countdown = every;

  inline void step() {
    if (lines > 0 && --countdown == 0) {
      __builtin_prefetch(next, 0, 2);
      next += 64;
      --lines;
      countdown = every;
    }
  }
};

// The 8 int8 of a row's octet at p in both halves of a q register (the SMULL and SDOT tiles' A operand).
inline int8x16_t octet_in_both_halves(const int8_t* p) {
  uint64_t octet;
  std::memcpy(&octet, p, 8);
  return vreinterpretq_s8_u64(vdupq_n_u64(octet));
}

// C[m, 16 (p - p0) + c] = sum_k X[m, k] * W[16 p + c, k] for m < M, p in [p0, p1), c < 16 (int32, wrapping).
// Tile::kMaxRows rows at most per tile; Tile::run<MR>(A, lda, octets, B, C, ldc, accumulate, prefetch)
// writes to C the sums over `octets` octets of MR rows (A: their first octet, lda bytes apart) times
// one panel's (B: its first octet row), plus C's values where `accumulate`; it calls prefetch.step()
// once per octet.
template <class Tile>
void octet_gemm(const void* A_rows, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0, int64_t p1,
                int32_t* C, int64_t ldc) {
  const auto* A = static_cast<const int8_t*>(A_rows);
  const auto* W = static_cast<const int8_t*>(W_packed);
  const int64_t octets = int8_octets(K), panel_bytes = octets * kOctetRowBytes;
  for (int64_t p = p0; p < p1; ++p) {
    int32_t* Cp = C + (p - p0) * kInt8Panel;
    equal_blocks(octets, kOctetBlock, 1, [&](int64_t o0, int64_t ob) {
      const int8_t* B = W + p * panel_bytes + o0 * kOctetRowBytes;
      // The next block follows (this panel's next one, or the next panel's first): each tile fetches
      // its share of its lines.
      const int64_t lines = ob * kOctetRowBytes / 64;
      row_tiles<Tile::kMaxRows>(M, [&](auto rows, int64_t m, int64_t t, int64_t tiles) {
        const int64_t share = (lines + tiles - 1) / tiles, first = t * share;
        const int64_t count = first < lines ? (lines - first < share ? lines - first : share) : 0;
        Prefetch prefetch{reinterpret_cast<const char*>(B + ob * kOctetRowBytes) + first * 64,
                          count > 0 && ob / count > 0 ? ob / count : 1, count};
        Tile::template run<decltype(rows)::value>(A + m * lda + 8 * o0, lda, ob, B, Cp + m * ldc, ldc, o0 > 0,
                                                  prefetch);
      });
    });
  }
}

}  // namespace moe_onnx::detail::arm64
