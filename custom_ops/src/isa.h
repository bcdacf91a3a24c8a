// Which instruction-set level the kernels use, chosen once per process at run time.
//
// Levels, each including the one before: portable (plain C++), avx2 (AVX2 + FMA + F16C), avx512
// (AVX-512 F/BW/DQ/VL), amx (AMX tiles with bf16 and int8; no kernels for it are built yet). The kernels use the highest level the
// CPU supports; MOE_ONNX_GEMM=portable|avx2|avx512|amx caps it at that level, and a level the CPU
// lacks (or an unknown name) is an error naming what the CPU has. Extensions inside a level that
// not every CPU of that level has (AVX512-VNNI today) are asked for separately.
#pragma once

#include <string>

namespace moe_onnx {

enum class IsaLevel { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// The level the kernels use (MOE_ONNX_GEMM applied). Throws std::invalid_argument when
// MOE_ONNX_GEMM names an unknown level or one this CPU cannot run.
IsaLevel isa_level();
// Whether the kernels use at least `level`.
inline bool isa_at_least(IsaLevel level) { return static_cast<int>(isa_level()) >= static_cast<int>(level); }
// The highest level this CPU (and this build) supports, ignoring MOE_ONNX_GEMM.
IsaLevel cpu_isa_level();
// "portable", "avx2", "avx512" or "amx".
const char* isa_name(IsaLevel level);

// An extension, true only when the CPU has them and the chosen level includes their base level.
bool use_avx512_vnni();  // vpdpbusd on zmm (needs avx512)

}  // namespace moe_onnx
