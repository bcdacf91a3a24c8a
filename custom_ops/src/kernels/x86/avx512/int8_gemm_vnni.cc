// AVX512-VNNI micro-kernels of int8_gemm_panels (the quad layout, int8_gemm.h); this file alone is
// compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni and is only called after a run-time
// check of the CPU (the ISA table, isa.h, assigns it where the CPU has AVX512-VNNI).
//
// vpdpbusd multiplies 4 unsigned bytes of X (u = x + 128) by 4 signed bytes of W per int32 lane and
// adds their sum (at most 4 * 255 * 128, no overflow) into the lane, wrapping modulo 2^32 (not the
// saturating vpdpbusds). Each column's sum starts at its panel's correction -128 * sum_k W[c, k], so
// it ends at sum_k x * w modulo 2^32: numpy's int32 result. One zmm holds the 16 columns of a panel
// row (64 bytes: 4 k x 16 columns), so 64 products per instruction against the 16 of AVX2's pair.
#include <immintrin.h>

#include <cstring>

#include "int8_gemm.h"

namespace moe_onnx {
namespace detail {

// Quads of k per block: a block of two panels (2 x kQuadBlock x 64 bytes = 16 KB) stays in L1 while
// every row tile of the call passes over it; partial sums go through C between blocks (exact).
constexpr int64_t kQuadBlock = 128;
// Rows per tile: MR x 2 panels of accumulators (16 zmm) plus the two panel rows and a broadcast.
constexpr int kMaxRows = 8;

// The next block's lines, prefetched into L2 while the tiles compute on this one: `lines` 64-byte
// lines from each of `streams` (1 or 2) panels.
struct NextBlock {
  const char* stream[2];
  int streams;
  int64_t lines;
  const char* line(int64_t i) const { return stream[i / lines] + (i % lines) * 64; }
};

// MR rows x NP (1 or 2) panels over `quads` quad steps. B: the first panel's quads of this block,
// the second at B + panel_bytes. The accumulators start at `start` (a panel's corrections, for the
// first block, the same for every row) or at C (later blocks). Every `every` steps one line of
// `next` (lines first .. first + count) is prefetched.
template <int MR, int NP>
static inline void tile_vnni(const uint8_t* A, int64_t lda, int64_t quads, const int8_t* B, int64_t panel_bytes,
                             const int32_t* start, int32_t* C, int64_t ldc, const NextBlock& next, int64_t first,
                             int64_t count) {
  __m512i acc[MR][NP];
  for (int j = 0; j < NP; ++j) {
    const __m512i corrections = start ? _mm512_loadu_si512(start + j * panel_bytes / 4) : _mm512_setzero_si512();
    for (int m = 0; m < MR; ++m)
      acc[m][j] = start ? corrections : _mm512_loadu_si512(C + m * ldc + j * kInt8Panel);
  }
  const int64_t every = count > 0 && quads / count > 0 ? quads / count : quads;
  const char* pf = count > 0 ? next.line(first) : nullptr;
  int64_t left_in_stream = count > 0 ? next.lines - first % next.lines : 0;
  for (int64_t done = 0; done < quads; done += every) {
    const int64_t end = quads - done < every ? quads : done + every;
    if (count-- > 0) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
      if (--left_in_stream == 0) pf = next.stream[1], left_in_stream = next.lines;
    }
    for (int64_t q = done; q < end; ++q) {
      __m512i b[NP];
      for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_si512(B + j * panel_bytes + q * 64);
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, A + m * lda + 4 * q, 4);
        const __m512i a = _mm512_set1_epi32(quad);
        for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], a, b[j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_si512(C + m * ldc + j * kInt8Panel, acc[m][j]);
}

template <int NP>
static void tile_rows(int rows, const uint8_t* A, int64_t lda, int64_t quads, const int8_t* B, int64_t panel_bytes,
                      const int32_t* start, int32_t* C, int64_t ldc, const NextBlock& next, int64_t first,
                      int64_t count) {
  switch (rows) {
    case 8: return tile_vnni<8, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    case 7: return tile_vnni<7, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    case 6: return tile_vnni<6, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    case 5: return tile_vnni<5, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    case 4: return tile_vnni<4, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    case 3: return tile_vnni<3, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    case 2: return tile_vnni<2, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
    default: return tile_vnni<1, NP>(A, lda, quads, B, panel_bytes, start, C, ldc, next, first, count);
  }
}

void bias_int8_rows_vnni(const int8_t* src, int64_t rows, int64_t K, void* dst) {
  const int64_t stride = 4 * int8_quads(K);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* s = src + r * K;
    uint8_t* d = static_cast<uint8_t*>(dst) + r * stride;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) _mm512_storeu_si512(d + k, _mm512_xor_si512(_mm512_loadu_si512(s + k), flip));
    for (; k < K; ++k) d[k] = static_cast<uint8_t>(s[k] ^ 0x80);
    for (; k < stride; ++k) d[k] = 0x80;  // x = 0 (the panels' padding is zero anyway)
  }
}

void int8_gemm_quads_vnni(const void* A_rows, int64_t lda, int64_t M, int64_t K, const void* W_packed, int64_t p0,
                          int64_t p1, int32_t* C, int64_t ldc) {
  const uint8_t* A = static_cast<const uint8_t*>(A_rows);
  const int64_t quads = int8_quads(K);
  const int64_t panel_bytes = int8_quad_panel_bytes(K);
  const char* W = static_cast<const char*>(W_packed);
  // Row tiles of equal height, at most kMaxRows (17 rows: 6 + 6 + 5, not 8 + 8 + 1).
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows, base = M / tiles, extra = M % tiles;
  for (int64_t p = p0; p < p1; p += 2) {
    const int np = p + 1 < p1 ? 2 : 1;
    const char* panel = W + p * panel_bytes;
    int32_t* Cp = C + (p - p0) * kInt8Panel;
    for (int64_t q0 = 0; q0 < quads; q0 += kQuadBlock) {
      const int64_t qb = quads - q0 < kQuadBlock ? quads - q0 : kQuadBlock;
      const int8_t* B = reinterpret_cast<const int8_t*>(panel + kInt8QuadHeader + q0 * 64);
      const int32_t* start = q0 == 0 ? reinterpret_cast<const int32_t*>(panel) : nullptr;
      // The next block of these panels, or the start of the next ones (headers included); each tile
      // fetches its share of the lines.
      NextBlock next{};
      next.streams = np;
      if (q0 + qb < quads) {
        next.lines = quads - q0 - qb < kQuadBlock ? quads - q0 - qb : kQuadBlock;
        for (int j = 0; j < np; ++j) next.stream[j] = reinterpret_cast<const char*>(B + qb * 64) + j * panel_bytes;
      } else {
        next.lines = 1 + (quads < kQuadBlock ? quads : kQuadBlock);
        for (int j = 0; j < np; ++j) next.stream[j] = panel + (np + j) * panel_bytes;
      }
      const int64_t total = next.streams * next.lines, share = (total + tiles - 1) / tiles;
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(base + (t < extra ? 1 : 0));
        const int64_t first = t * share, count = first < total ? (total - first < share ? total - first : share) : 0;
        if (np == 2)
          tile_rows<2>(rows, A + m * lda + 4 * q0, lda, qb, B, panel_bytes, start, Cp + m * ldc, ldc, next, first,
                       count);
        else
          tile_rows<1>(rows, A + m * lda + 4 * q0, lda, qb, B, panel_bytes, start, Cp + m * ldc, ldc, next, first,
                       count);
        m += rows;
      }
    }
  }
}

}  // namespace detail
}  // namespace moe_onnx
