#include "isa.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace moe_onnx {
namespace {

// __builtin_cpu_supports takes only a string literal.
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define MOE_ONNX_CPU_HAS(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature))
#else
#define MOE_ONNX_CPU_HAS(feature) false
#endif

IsaLevel detect() {
  // Levels are usable only when this build compiled their kernels.
  IsaLevel level = IsaLevel::kPortable;
#if defined(MOE_ONNX_HAVE_AVX2)
  if (MOE_ONNX_CPU_HAS("avx2") && MOE_ONNX_CPU_HAS("fma") && MOE_ONNX_CPU_HAS("f16c")) level = IsaLevel::kAvx2;
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
  if (level == IsaLevel::kAvx2 && MOE_ONNX_CPU_HAS("avx512f") && MOE_ONNX_CPU_HAS("avx512bw") &&
      MOE_ONNX_CPU_HAS("avx512dq") && MOE_ONNX_CPU_HAS("avx512vl"))
    level = IsaLevel::kAvx512;
#endif
  // No AMX kernels are built yet: MOE_ONNX_GEMM=amx is a known level this build reports as unsupported.
  return level;
}

IsaLevel chosen() {
  const IsaLevel supported = cpu_isa_level();
  const char* force = std::getenv("MOE_ONNX_GEMM");
  if (force == nullptr || *force == '\0') return supported;
  for (IsaLevel level : {IsaLevel::kPortable, IsaLevel::kAvx2, IsaLevel::kAvx512, IsaLevel::kAmx}) {
    if (std::strcmp(force, isa_name(level)) != 0) continue;
    if (static_cast<int>(level) > static_cast<int>(supported))
      throw std::invalid_argument(std::string("MOE_ONNX_GEMM=") + force + ": this CPU (or this build of the library) " +
                                  "supports up to '" + isa_name(supported) + "'");
    return level;
  }
  throw std::invalid_argument(std::string("MOE_ONNX_GEMM='") + force +
                              "' is not a level; expected one of 'portable', 'avx2', 'avx512', 'amx'");
}

}  // namespace

IsaLevel cpu_isa_level() {
  static const IsaLevel level = detect();
  return level;
}

IsaLevel isa_level() {
  static const IsaLevel level = chosen();  // a throw leaves it unset: the next call reports again
  return level;
}

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::kPortable: return "portable";
    case IsaLevel::kAvx2: return "avx2";
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAmx: return "amx";
  }
  return "unknown";
}

bool use_avx512_vnni() { return isa_at_least(IsaLevel::kAvx512) && MOE_ONNX_CPU_HAS("avx512vnni"); }

}  // namespace moe_onnx
