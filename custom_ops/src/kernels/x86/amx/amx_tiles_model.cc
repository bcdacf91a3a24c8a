#include "amx_tiles_model.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "float_convert.h"

namespace moe_onnx::amx::model {
namespace {

using TileRows = uint8_t[kTileRowBytes];

// This thread's tiles: the configuration loaded (if any) and 8 registers of 16 x 64 bytes.
struct Registers {
  bool configured = false;
  TileConfig config;
  alignas(64) TileRows tile[kTileCount][kTileRows];
};
thread_local Registers registers;

// Where the hardware faults (#GP on LDTILECFG, #UD on the others), the model stops the process.
[[noreturn]] void fault(const char* instruction, const char* rule) {
  std::fprintf(stderr, "moe_onnx tile model: %s: %s\n", instruction, rule);
  std::abort();
}

void check_config(const TileConfig& config) {
  if (config.palette != 1) fault("LDTILECFG", "the palette must be 1");
  if (config.start_row != 0) fault("LDTILECFG", "start_row must be 0");
  for (uint8_t byte : config.reserved0)
    if (byte != 0) fault("LDTILECFG", "reserved bytes must be zero");
  for (int t = 0; t < 16; ++t) {
    if (t >= kTileCount && (config.rows[t] != 0 || config.colsb[t] != 0))
      fault("LDTILECFG", "tiles 8-15 do not exist in palette 1");
    if (config.rows[t] > kTileRows) fault("LDTILECFG", "a tile has at most 16 rows");
    if (config.colsb[t] > kTileRowBytes) fault("LDTILECFG", "a tile row has at most 64 bytes");
    if ((config.rows[t] == 0) != (config.colsb[t] == 0))
      fault("LDTILECFG", "a tile has both rows and bytes per row, or neither");
  }
}

// Tile `t`, configured (else the instruction faults).
TileRows* configured_tile(const char* instruction, int t) {
  if (!registers.configured) fault(instruction, "no tile configuration is loaded on this thread");
  if (t < 0 || t >= kTileCount || registers.config.rows[t] == 0) fault(instruction, "the tile is not configured");
  return registers.tile[t];
}

int rows_of(int t) { return registers.config.rows[t]; }
int colsb_of(int t) { return registers.config.colsb[t]; }

// The shapes TDPBUSD and TDPBF16PS require of C += A x B (amx_tiles.h).
void check_product(const char* instruction, int c, int a, int b) {
  if (c == a || c == b || a == b) fault(instruction, "C, A and B must be three different tiles");
  if (rows_of(c) != rows_of(a)) fault(instruction, "C and A must have the same rows");
  if (colsb_of(c) != colsb_of(b)) fault(instruction, "C and B must have the same bytes per row");
  if (colsb_of(a) % 4 != 0 || colsb_of(c) % 4 != 0) fault(instruction, "bytes per row must be multiples of 4");
  if (rows_of(b) != colsb_of(a) / 4) fault(instruction, "B's rows must be A's bytes per row / 4");
}

// The rows past `rows` and the bytes past `colsb` of a tile written by an instruction are zero.
void zero_outside(TileRows* tile, int rows, int colsb) {
  for (int r = 0; r < kTileRows; ++r)
    std::memset(tile[r] + (r < rows ? colsb : 0), 0, static_cast<size_t>(kTileRowBytes - (r < rows ? colsb : 0)));
}

uint32_t dword(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------------------- TDPBF16PS, one element

// The arithmetic of TDPBF16PS as its pseudocode specifies it: fp32 fused multiply-adds and adds,
// rounded to nearest even, inputs below the normal range read as zero (DAZ) and results below it
// flushed to a zero of their sign (FTZ). NaN: the first NaN operand, quieted (x86's rule for two
// NaNs), before any invalid operation's default NaN.

constexpr uint32_t kDefaultNan = 0xffc00000u;  // x86's default (negative quiet) NaN
constexpr uint32_t kQuietBit = 0x00400000u;

// DAZ: a denormal reads as a zero of its sign.
float read_fp32(uint32_t bits) { return float_from_bits((bits & 0x7f800000u) == 0 ? bits & 0x80000000u : bits); }
float read_bf16(uint16_t bits) { return read_fp32(static_cast<uint32_t>(bits) << 16); }

// FTZ as the hardware detects it, after rounding: a result whose rounding to 24 bits with an unbounded
// exponent lies below 2^-126 becomes a zero of its sign. `r` is the IEEE result (whose denormal rounding
// can reach 2^-126 from below), `rescaled()` the same operation on operands scaled by 2^64, rounded in
// the normal range; only results at or below 2^-126 need it. (Such a result is exact cancellation of
// operands below 2^-101, so the scaled ones cannot overflow.)
template <class Rescaled>
float flush(float r, Rescaled rescaled) {
  if (r == 0.0f || std::fabs(r) > 0x1p-126f) return r;
  const float scaled = rescaled();
  return std::fabs(scaled) < 0x1p-62f ? std::copysign(0.0f, scaled) : scaled * 0x1p-64f;
}

// Whether an operand is NaN; `nan` then holds the first NaN operand, quieted.
bool first_nan(std::initializer_list<float> operands, float& nan) {
  for (float x : operands)
    if (std::isnan(x)) {
      nan = float_from_bits(float_bits(x) | kQuietBit);
      return true;
    }
  return false;
}

// a * b + c rounded once (a and b bf16 values, so a * b is exact).
float fma_daz_ftz(float a, float b, float c) {
  float nan;
  if (first_nan({a, b, c}, nan)) return nan;
  const float r = std::fma(a, b, c);  // an invalid operation (inf * 0, inf - inf) gives a NaN here
  if (std::isnan(r)) return float_from_bits(kDefaultNan);
  const bool scale_a = std::fabs(a) <= std::fabs(b);  // the smaller factor
  return flush(r, [&] { return std::fma(scale_a ? a * 0x1p64f : a, scale_a ? b : b * 0x1p64f, c * 0x1p64f); });
}

float add_daz_ftz(float a, float b) {
  float nan;
  if (first_nan({a, b}, nan)) return nan;
  const float r = a + b;
  if (std::isnan(r)) return float_from_bits(kDefaultNan);
  return flush(r, [&] { return a * 0x1p64f + b * 0x1p64f; });
}

// TDPBF16PS on one element: the products of the pairs' first elements in one chain of fused
// multiply-adds, of their second elements in another, both from +0 in increasing k; then
// c + (first + second).
uint32_t dot_bf16(uint32_t c, const uint16_t* a, const uint16_t* b, int pairs) {
  float first = 0.0f, second = 0.0f;
  for (int k = 0; k < pairs; ++k) {
    first = fma_daz_ftz(read_bf16(a[2 * k]), read_bf16(b[2 * k]), first);
    second = fma_daz_ftz(read_bf16(a[2 * k + 1]), read_bf16(b[2 * k + 1]), second);
  }
  return float_bits(add_daz_ftz(read_fp32(c), add_daz_ftz(first, second)));
}

// C[m][n] = element(C[m][n]'s bits, A's row m, B, n, A.colsb / 4) for C's configured elements, once the
// shapes of C += A x B are checked; the rest of C zeroed.
template <class Element>
void product(const char* instruction, int c, int a, int b, Element element) {
  TileRows* C = configured_tile(instruction, c);
  const TileRows* A = configured_tile(instruction, a);
  const TileRows* B = configured_tile(instruction, b);
  check_product(instruction, c, a, b);
  const int rows = rows_of(c), columns = colsb_of(c) / 4, groups = colsb_of(a) / 4;
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < columns; ++n) {
      const uint32_t result = element(dword(C[m] + 4 * n), A[m], B, n, groups);
      std::memcpy(C[m] + 4 * n, &result, 4);
    }
  zero_outside(C, rows, colsb_of(c));
}

}  // namespace

// ---------------------------------------------------------------------------- the instructions

void configure(const TileConfig& config) {
  if (registers.configured && registers.config == config) return;
  check_config(config);
  registers.config = config;
  registers.configured = true;
  std::memset(registers.tile, 0, sizeof registers.tile);
}

void release() {
  registers.configured = false;
  std::memset(registers.tile, 0, sizeof registers.tile);
}

void zero(int t) { std::memset(configured_tile("TILEZERO", t), 0, kTileRows * kTileRowBytes); }

void load(int t, const void* base, int64_t stride) {
  auto* tile = configured_tile("TILELOADD", t);
  const int rows = rows_of(t), colsb = colsb_of(t);
  for (int r = 0; r < rows; ++r) std::memcpy(tile[r], static_cast<const uint8_t*>(base) + r * stride, colsb);
  zero_outside(tile, rows, colsb);
}

void store(int t, void* base, int64_t stride) {
  const auto* tile = configured_tile("TILESTORED", t);
  for (int r = 0; r < rows_of(t); ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, tile[r], colsb_of(t));
}

void dpbusd(int c, int a, int b) {
  product("TDPBUSD", c, a, b, [](uint32_t sum, const uint8_t* a_row, const TileRows* B, int n, int quads) {
    for (int k = 0; k < quads; ++k)
      for (int i = 0; i < 4; ++i)  // unsigned: wraps modulo 2^32 as the instruction does
        sum += static_cast<uint32_t>(static_cast<int32_t>(a_row[4 * k + i]) *
                                     static_cast<int32_t>(static_cast<int8_t>(B[k][4 * n + i])));
    return sum;
  });
}

void dpbsud(int c, int a, int b) {
  product("TDPBSUD", c, a, b, [](uint32_t sum, const uint8_t* a_row, const TileRows* B, int n, int quads) {
    for (int k = 0; k < quads; ++k)
      for (int i = 0; i < 4; ++i)  // unsigned: wraps modulo 2^32 as the instruction does
        sum += static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(a_row[4 * k + i])) *
                                     static_cast<int32_t>(B[k][4 * n + i]));
    return sum;
  });
}

void dpbf16ps(int c, int a, int b) {
  product("TDPBF16PS", c, a, b, [](uint32_t acc, const uint8_t* a_row, const TileRows* B, int n, int pairs) {
    uint16_t row[2 * kTileRows], column[2 * kTileRows];  // A's row m and B's column n, pair after pair
    std::memcpy(row, a_row, 4 * pairs);
    for (int k = 0; k < pairs; ++k) std::memcpy(column + 2 * k, B[k] + 4 * n, 4);
    return dot_bf16(acc, row, column, pairs);
  });
}

}  // namespace moe_onnx::amx::model
