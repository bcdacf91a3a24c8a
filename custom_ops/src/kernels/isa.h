// The ISA table: the kernel each slot of the library runs, filled once per process (kernels()) from
// what the CPU, this build and the OS support. Callers call a slot (kernels().gemm_panels(...)); no
// caller asks which instruction set is in use.
//
// Levels, per architecture, each including the one before:
//   x86-64   portable (plain C++), avx2 (AVX2 + FMA + F16C), avx512 (AVX-512 F/BW/DQ/VL), amx (AMX
//            tiles, on top of avx512);
//   aarch64  portable, neon (Advanced SIMD, every AArch64 CPU), dotprod (+ SDOT/UDOT, Armv8.2's
//            FEAT_DotProd), i8mm (+ SMMLA/USMMLA/USDOT, FEAT_I8MM), bf16 (+ BFDOT/BFMMLA, FEAT_BF16; both
//            of these last come with Armv8.6, e.g. Neoverse V1/V2).
// The table is filled in ascending order of capability, each level's kernels overwriting the slots
// they have, up to the highest level the CPU, the build and the OS support. MOE_ONNX_GEMM (a level of
// this architecture) caps it; a level not available here, or an unknown name, is an error naming the
// highest level available. Extensions not every x86 CPU of a level has (AVX512-VNNI, AVX512-BF16) and
// AMX's int8 and bf16 instructions are capabilities the table records; a kernel that needs one is
// assigned only where the table has it.
//
// AMX needs, on Linux, the OS's permission for the tile data state: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), requested once, when the table is filled, and only when AMX would be used. The
// AMX slots run the tile kernels (amx_tiles.h) on the hardware where `amx` is kUsable, or on the
// scalar model of the tile instructions, on any CPU, with MOE_ONNX_AMX=model; MOE_ONNX_AMX=off leaves
// the hardware unused. `amx` and `amx_reason` say which, and why.
#pragma once

#include <string>
#include <utility>

#include "activation.h"
#include "bf16_gemm.h"
#include "float_rows.h"
#include "gemm.h"
#include "int8_gemm.h"
#include "qgemm.h"
#include "transpose_tile.h"

namespace moe_onnx {

enum class IsaLevel { kPortable, kAvx2, kAvx512, kAmx, kNeon, kDotprod, kI8mm, kBf16 };

// "portable", "avx2", "avx512", "amx", "neon", "dotprod", "i8mm" or "bf16".
const char* isa_name(IsaLevel level);

// Where the AMX slots run, and why.
enum class AmxState {
  kUsable,      // the hardware: the CPU has AMX, this build its tile kernels, the OS granted the tile state
  kModelled,    // MOE_ONNX_AMX=model: the scalar model of the tile instructions (any CPU)
  kOff,         // MOE_ONNX_AMX=off
  kCapped,      // MOE_ONNX_GEMM caps the level below amx
  kNotInCpu,    // this CPU has no AMX (amx_tile), or no AVX-512 level under it
  kNotInBuild,  // this build has no hardware tile kernels (the compiler took no AMX flags)
  kRefused,     // the OS refused the tile data state (amx_reason names the error)
};

// "usable", "modelled", "off", "capped", "not-in-cpu", "not-in-build" or "refused".
const char* amx_state_name(AmxState state);

// A slot: a kernel and the name the report gives it ("none" while unfilled).
template <class Fn>
struct Slot {
  Fn fn = nullptr;
  const char* name = "none";

  explicit operator bool() const { return fn != nullptr; }
  template <class... Args>
  decltype(auto) operator()(Args&&... args) const {
    return fn(std::forward<Args>(args)...);
  }
};

// The int8 GEMM's slot: its kernel fixes the layout of both operands (int8_gemm.h), so the kernel,
// the preparation of X's rows and the layout change together. Where the table has AMX's int8 tiles,
// they take the calls of kInt8TileRows rows or more (the quad layout; `multiply` the others).
struct Int8GemmKernels {
  Int8Layout layout = Int8Layout::kPairs;
  detail::PrepareInt8RowsFn prepare = nullptr;
  detail::Int8GemmFn multiply = nullptr;
  const char* name = "none";
  Slot<detail::Int8GemmFn> tiles;
};

struct KernelTable {
  IsaLevel level = IsaLevel::kPortable;  // MOE_ONNX_GEMM applied

  // Capabilities (false where the level in use excludes them).
  bool avx512_vnni = false;  // vpdpbusd on zmm
  bool avx512_bf16 = false;  // vdpbf16ps
  bool amx_int8 = false;     // TDPBUSD for the AMX slots (hardware, or the model)
  bool amx_bf16 = false;     // TDPBF16PS likewise
  AmxState amx = AmxState::kNotInCpu;
  std::string amx_reason;    // a sentence saying why `amx` is what it is

  // The slots.
  Slot<detail::GemmFn> gemm_panels;        // gemm.h
  Slot<detail::WidenRowFn> widen_row;      // float_rows.h
  Slot<detail::NarrowRowFn> narrow_row;
  Slot<detail::TransposeTileFn> transpose_tile;  // transpose_tile.h: packing weights into panels
  Slot<detail::QuantCodeGroupsFn> quant_code_groups;  // transpose_tile.h: QMOE's codes into quantized panels
  Int8GemmKernels int8_gemm;                 // int8_gemm.h
  Slot<detail::QuantFusedFn> quant_fused;  // qgemm.h; none at the portable level (it always decodes)
  Slot<detail::QuantDecodeFn> quant_decode;
  Slot<detail::QuantActivationsFn> quant_activations;  // level 4's int8 activations
  Slot<detail::QuantDotFn> quant_dots;
  Slot<detail::QuantTilesFn> quant_tiles;  // AMX: level 4's calls of kQuantTileRows rows or more
  detail::QuantTileSteps quant_tile_steps;  // quant_tiles' steps outside the tiles
  Slot<detail::GatedKernel*> gated_activation;  // activation.h
  Slot<detail::PointwiseKernel*> pointwise_activation;
  // bf16_gemm.h (accuracy_level 3): filled only where the table has a bf16 dot-product instruction
  // (AVX512-BF16, or AMX-BF16: the hardware or its model). bf16_gemm takes the calls of fewer than
  // kBf16TileRows rows (and all of them without AMX-BF16), bf16_gemm_tiles the others.
  Slot<detail::Bf16GemmFn> bf16_gemm;
  Slot<detail::Bf16GemmFn> bf16_gemm_tiles;

  // "key=value;..." of the level, every slot's kernel, the capabilities and the AMX state and reason
  // (values hold no ';').
  std::string report() const;
};

// The table, filled on the first call. Throws std::invalid_argument when MOE_ONNX_GEMM names an
// unknown level or one not available here, or MOE_ONNX_AMX an unknown mode (a later call tries again).
const KernelTable& kernels();

}  // namespace moe_onnx
