// The tile layer's hardware build (amx_tiles.h): the AMX instructions. Include it only in the files
// CMake compiles with the AMX flags (`*_amx.cc`), and call what they define only where the ISA table
// says AMX is usable (isa.h): elsewhere the instructions fault.
//
// The instructions are written as inline assembly rather than GCC's _tile_* macros: those paste the
// tile number into the instruction's text (so a template argument cannot name it), and their loads and
// LDTILECFG do not tell the compiler all the memory they read (so it may move a store to that memory
// past them). Here LDTILECFG reads the whole configuration as its operand, and the loads and stores
// carry a "memory" clobber.
#pragma once

#if !defined(__x86_64__) || !defined(__AMX_TILE__)
#error "amx_tiles_hardware.h is for the files compiled with the AMX flags (custom_ops/CMakeLists.txt)"
#endif

#include <cstdint>

#include "amx_tiles.h"

namespace moe_onnx::amx {

// The configuration this thread has loaded (loaded: false after release or before the first load).
struct LoadedTileConfig {
  bool loaded = false;
  TileConfig config;
};
inline thread_local LoadedTileConfig this_thread_tiles;

struct HardwareTiles {
  static void configure(const TileConfig& config) {
    if (this_thread_tiles.loaded && this_thread_tiles.config == config) return;
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
    this_thread_tiles.config = config;
    this_thread_tiles.loaded = true;
  }
  static void release() {
    __asm__ volatile("tilerelease" ::);
    this_thread_tiles.loaded = false;
  }
  template <int T>
  static void zero(Tile<T>) {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(Tile<T>, const void* base, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(Tile<T>, void* base, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void dpbusd(Tile<C>, Tile<A>, Tile<B>) {
    __asm__ volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  template <int C, int A, int B>
  static void dpbsud(Tile<C>, Tile<A>, Tile<B>) {
    __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  template <int C, int A, int B>
  static void dpbf16ps(Tile<C>, Tile<A>, Tile<B>) {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

}  // namespace moe_onnx::amx
