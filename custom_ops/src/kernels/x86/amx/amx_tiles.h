// The tile layer the AMX kernels are written against, in two builds with one interface: a kernel is a
// template over a `Tiles` policy class and its source is compiled twice,
//   - against HardwareTiles (amx_tiles_hardware.h): the instructions, in a `*_amx.cc` file built with
//     the AMX flags (CMake builds it only where the compiler takes them), called only where the ISA
//     table says AMX is usable (isa.h: AmxState::kUsable);
//   - against ModelTiles (amx_tiles_model.h): a scalar model of each instruction, in a `*_amx_model.cc`
//     file built without them, so the same kernel code runs on every CPU (MOE_ONNX_AMX=model).
// Everything else in a kernel's source (its helpers) is a template over Tiles too, or in an unnamed
// namespace, so the two builds never share an inline function compiled with different flags.
//
// The policy's members (static, identical in both classes):
//   configure(const TileConfig& config)   this thread's tiles take `config`. The configuration is per
//       thread (each onnxruntime pool thread loads its own): loaded, with every tile zeroed as
//       LDTILECFG does, only when it differs from the one this thread has loaded; tracked per thread.
//   release()                             TILERELEASE: this thread's tiles back to their initial state
//       (nothing loaded). Call it before a kernel returns (ReleaseTiles below), so that no tile state
//       outlives the call: the OS saves none on a context switch, and the next call configures again.
//   zero(tmm<T>)                          TILEZERO: tile T all zero.
//   load(tmm<T>, base, stride)            TILELOADD: T's configured rows x colsb bytes from rows `stride`
//       bytes apart (the bytes past colsb and the rows past `rows` read as zero).
//   store(tmm<T>, base, stride)           TILESTORED: T's rows x colsb bytes to rows `stride` bytes apart.
//   dpbusd(tmm<C>, tmm<A>, tmm<B>)        TDPBUSD, int32 C += u8 A x s8 B:
//       C[m][n] += sum over k < A.colsb / 4, i < 4 of uint8(A[m][4k + i]) * int8(B[k][4n + i]),
//       wrapping modulo 2^32: exact, so the model and the hardware agree bitwise.
//   dpbsud(tmm<C>, tmm<A>, tmm<B>)        TDPBSUD, int32 C += s8 A x u8 B: as dpbusd with A's bytes signed
//       and B's unsigned (exact, wrapping).
//   dpbf16ps(tmm<C>, tmm<A>, tmm<B>)      TDPBF16PS, fp32 C += bf16 A x bf16 B, as the instruction's
//       pseudocode specifies it: for each C[m][n], the products A[m][2k] * B[k][2n] in one chain of
//       fp32 fused multiply-adds and A[m][2k + 1] * B[k][2n + 1] in another, both from +0 in
//       increasing k (k < A.colsb / 4), then C[m][n] + (first + second); every operation rounded to
//       nearest even, inputs below the normal range (bf16 and C's fp32) read as zero, results whose
//       rounding (with an unbounded exponent) lies below 2^-126 flushed to a zero of their sign; a NaN
//       operand gives itself, quieted (x86's rule: the first NaN operand of the operation, so a NaN C
//       wins, then the first chain's over the second's, the latest k's within a chain), an invalid
//       operation (inf * 0, inf - inf) the default NaN 0xffc00000. The model gives the hardware's bits
//       (5 million random elements compared, NaN, infinities and denormals included; tests/
//       test_amx_tiles.py). The exact sum rounded once would differ from both in about half the
//       elements (by up to about 2^-21 of the sum of the absolute terms, on random data).
// Shapes, as the hardware requires them (else it faults; the model aborts naming the rule): C, A and B
// are three different configured tiles; C.rows == A.rows, C.colsb == B.colsb, B.rows == A.colsb / 4,
// and every colsb a multiple of 4. B is the "VNNI" layout: row k holds, for each of C's columns n,
// the 4 (int8) or 2 (bf16) consecutive k of that column side by side.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace moe_onnx::amx {

constexpr int kTileCount = 8;      // tmm0 .. tmm7
constexpr int kTileRows = 16;      // rows of a tile at most
constexpr int kTileRowBytes = 64;  // bytes of a tile row at most

// A tile configuration of palette 1, in LDTILECFG's 64-byte memory format. Unused tiles have 0 rows
// and 0 bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved0[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tiles 0-7 (8-15 reserved, zero)
  uint8_t rows[16] = {};    // rows of tiles 0-7 (8-15 reserved, zero)

  // Tile `tile` as `row_count` rows of `row_bytes` bytes (<= kTileRows, <= kTileRowBytes).
  TileConfig& shape(int tile, int row_count, int row_bytes) {
    rows[tile] = static_cast<uint8_t>(row_count);
    colsb[tile] = static_cast<uint16_t>(row_bytes);
    return *this;
  }
  bool operator==(const TileConfig& other) const { return std::memcmp(this, &other, sizeof *this) == 0; }
  bool operator!=(const TileConfig& other) const { return !(*this == other); }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Tile register N as a type: the instructions name their tiles in the encoding, so kernels pass
// tmm<N> and the policy takes N as a template argument.
template <int N>
struct Tile {
  static_assert(N >= 0 && N < kTileCount, "tiles are tmm0 .. tmm7");
  static constexpr int index = N;
};
template <int N>
inline constexpr Tile<N> tmm{};

// Releases this thread's tiles when the scope ends (a kernel's last statement, whatever the path).
template <class Tiles>
struct ReleaseTiles {
  ReleaseTiles() = default;
  ReleaseTiles(const ReleaseTiles&) = delete;
  ReleaseTiles& operator=(const ReleaseTiles&) = delete;
  ~ReleaseTiles() { Tiles::release(); }
};

// One row block of C in the kernels that compute two row tiles x two column panels at once: tmm0-3 the
// accumulators (row tile 0/1 x panel 0/1), tmm4-5 A's two row tiles, tmm6-7 B's two panels.
struct RowBlock {
  int rows0 = 0, rows1 = 0;  // rows of the block's first and second row tile (rows1 0: one row tile)

  // The block of C's rows from m (of M).
  static RowBlock at(int64_t m, int64_t M) {
    return {static_cast<int>(std::min<int64_t>(kTileRows, M - m)),
            static_cast<int>(std::clamp<int64_t>(M - m - kTileRows, 0, kTileRows))};
  }
  // Its tile configuration: A tiles `a_row_bytes` wide, B tiles `b_rows` rows of 64 bytes. A lone last
  // row tile keeps the pair's shape for the tiles it leaves unused: often no new configuration.
  TileConfig config(int a_row_bytes, int b_rows) const {
    const int second = rows1 > 0 ? rows1 : kTileRows;
    return TileConfig()
        .shape(0, rows0, 64)
        .shape(1, rows0, 64)
        .shape(2, second, 64)
        .shape(3, second, 64)
        .shape(4, rows0, a_row_bytes)
        .shape(5, second, a_row_bytes)
        .shape(6, b_rows, 64)
        .shape(7, b_rows, 64);
  }
  // kernel.block<two_rows, two_panels>(args...), the flags as template arguments.
  template <class Kernel, class... Args>
  void run(Kernel& kernel, bool two_panels, Args... args) const {
    if (rows1 > 0)
      two_panels ? kernel.template block<true, true>(args...) : kernel.template block<true, false>(args...);
    else
      two_panels ? kernel.template block<false, true>(args...) : kernel.template block<false, false>(args...);
  }
};

// C's rows [0, M) by RowBlock times B's panels [p0, p1) in pairs: kernel.block<...>(m, p) for each, with A
// tiles 64 bytes wide and B tiles kTileRows rows (the bf16 and int8 GEMMs); the tiles released at the end.
template <class Tiles, class Kernel>
void run_row_blocks(Kernel& kernel, int64_t M, int64_t p0, int64_t p1) {
  ReleaseTiles<Tiles> release;
  for (int64_t m = 0; m < M; m += 2 * kTileRows) {
    const RowBlock rows = RowBlock::at(m, M);
    Tiles::configure(rows.config(64, kTileRows));
    for (int64_t p = p0; p < p1; p += 2) rows.run(kernel, p + 1 < p1, m, p);
  }
}

// The inner step of a RowBlock kernel: A's row tile at a0 (and, kTwoRows, at a1), rows `a_stride` bytes
// apart, times B's panel at b0 (and, kTwoPanels, at b1), rows 64 bytes apart, accumulated by `dot` (a
// Tiles product, dpbusd or dpbf16ps, as a callable) into tmm0-3 (row tile x panel).
template <class Tiles, bool kTwoRows, bool kTwoPanels, class Dot>
void block_step(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1, Dot dot) {
  Tiles::load(tmm<4>, a0, a_stride);
  Tiles::load(tmm<6>, b0, kTileRowBytes);
  dot(tmm<0>, tmm<4>, tmm<6>);
  if (kTwoPanels) {
    Tiles::load(tmm<7>, b1, kTileRowBytes);
    dot(tmm<1>, tmm<4>, tmm<7>);
  }
  if (kTwoRows) {
    Tiles::load(tmm<5>, a1, a_stride);
    dot(tmm<2>, tmm<5>, tmm<6>);
    if (kTwoPanels) dot(tmm<3>, tmm<5>, tmm<7>);
  }
}

// A RowBlock kernel's accumulators tmm0-3 stored: row tile r's panel j at c + r * row_tile + j * panel
// (elements of T), rows `stride` bytes apart.
template <class Tiles, bool kTwoRows, bool kTwoPanels, class T>
void store_block(T* c, int64_t row_tile, int64_t panel, int64_t stride) {
  Tiles::store(tmm<0>, c, stride);
  if (kTwoPanels) Tiles::store(tmm<1>, c + panel, stride);
  if (kTwoRows) Tiles::store(tmm<2>, c + row_tile, stride);
  if (kTwoRows && kTwoPanels) Tiles::store(tmm<3>, c + row_tile + panel, stride);
}

}  // namespace moe_onnx::amx
