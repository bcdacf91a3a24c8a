// The tile layer's model build (amx_tiles.h): each tile instruction as scalar C++ on this thread's
// model registers, 8 tiles of 16 rows x 64 bytes and a configuration, honouring the configuration as
// the hardware does (rows and bytes per row; what lies past them reads as zero). Any CPU; no flags.
#pragma once

#include <cstdint>

#include "amx_tiles.h"

namespace moe_onnx::amx {

namespace model {
// The instructions on tile numbers (amx_tiles_model.cc). A use the hardware would fault on (an
// invalid configuration, an unconfigured tile, shapes that do not fit) aborts, naming the rule.
void configure(const TileConfig& config);
void release();
void zero(int tile);
void load(int tile, const void* base, int64_t stride);
void store(int tile, void* base, int64_t stride);
void dpbusd(int c, int a, int b);
void dpbsud(int c, int a, int b);
void dpbf16ps(int c, int a, int b);
}  // namespace model

struct ModelTiles {
  static void configure(const TileConfig& config) { model::configure(config); }
  static void release() { model::release(); }
  template <int T>
  static void zero(Tile<T>) {
    model::zero(T);
  }
  template <int T>
  static void load(Tile<T>, const void* base, int64_t stride) {
    model::load(T, base, stride);
  }
  template <int T>
  static void store(Tile<T>, void* base, int64_t stride) {
    model::store(T, base, stride);
  }
  template <int C, int A, int B>
  static void dpbusd(Tile<C>, Tile<A>, Tile<B>) {
    model::dpbusd(C, A, B);
  }
  template <int C, int A, int B>
  static void dpbsud(Tile<C>, Tile<A>, Tile<B>) {
    model::dpbsud(C, A, B);
  }
  template <int C, int A, int B>
  static void dpbf16ps(Tile<C>, Tile<A>, Tile<B>) {
    model::dpbf16ps(C, A, B);
  }
};

}  // namespace moe_onnx::amx
