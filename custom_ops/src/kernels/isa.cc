#include "isa.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#define MOE_ONNX_X86 1
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace moe_onnx {
namespace {

// ---------------------------------------------------------------------------- what the CPU has

// __builtin_cpu_supports takes only a string literal.
#if defined(MOE_ONNX_X86)
#define MOE_ONNX_CPU_HAS(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature))
#else
#define MOE_ONNX_CPU_HAS(feature) false
#endif

struct CpuFeatures {
  bool avx2 = false;    // with FMA and F16C
  bool avx512 = false;  // F/BW/DQ/VL
  bool avx512_vnni = false;
  bool avx512_bf16 = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool os_tile_state = false;  // XCR0 enables the tile configuration and data state
  bool neon = false;           // AArch64's Advanced SIMD
  bool dotprod = false, i8mm = false, bf16 = false;
};

#if defined(__aarch64__) && defined(__linux__)
// The bits Linux reports in the auxiliary vector (arch/arm64/include/uapi/asm/hwcap.h), spelled out
// here so that older C libraries' headers do not hide them.
constexpr unsigned long kHwcapAsimd = 1ul << 1, kHwcapAsimdDotprod = 1ul << 20;
constexpr unsigned long kHwcap2I8mm = 1ul << 13, kHwcap2Bf16 = 1ul << 14;
#endif

// x86: AVX512-BF16 and AMX from CPUID itself (not every compiler's __builtin_cpu_supports knows them).
// aarch64: Linux's hardware capabilities (getauxval); elsewhere Advanced SIMD alone, which every
// AArch64 CPU has.
CpuFeatures detect_cpu() {
  CpuFeatures cpu;
#if defined(__aarch64__)
  cpu.neon = true;
#if defined(__linux__)
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  cpu.neon = (hwcap & kHwcapAsimd) != 0;
  cpu.dotprod = cpu.neon && (hwcap & kHwcapAsimdDotprod) != 0;
  cpu.i8mm = cpu.neon && (hwcap2 & kHwcap2I8mm) != 0;
  cpu.bf16 = cpu.neon && (hwcap2 & kHwcap2Bf16) != 0;
#endif
#endif
  cpu.avx2 = MOE_ONNX_CPU_HAS("avx2") && MOE_ONNX_CPU_HAS("fma") && MOE_ONNX_CPU_HAS("f16c");
  cpu.avx512 = MOE_ONNX_CPU_HAS("avx512f") && MOE_ONNX_CPU_HAS("avx512bw") && MOE_ONNX_CPU_HAS("avx512dq") &&
               MOE_ONNX_CPU_HAS("avx512vl");
  cpu.avx512_vnni = MOE_ONNX_CPU_HAS("avx512vnni");
#if defined(MOE_ONNX_X86)
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    cpu.amx_bf16 = (edx >> 22) & 1;
    cpu.amx_tile = (edx >> 24) & 1;
    cpu.amx_int8 = (edx >> 25) & 1;
  }
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) cpu.avx512_bf16 = cpu.avx512 && ((eax >> 5) & 1);
  if (cpu.amx_tile && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 27) & 1)) {  // OSXSAVE: xgetbv works
    unsigned xcr0_low, xcr0_high;
    __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    cpu.os_tile_state = (xcr0_low & 0x60000u) == 0x60000u;  // XTILECFG (17), XTILEDATA (18)
  }
#endif
  return cpu;
}

const CpuFeatures& cpu() {
  static const CpuFeatures features = detect_cpu();
  return features;
}

// The OS's permission for this process to use the tile data state: "" when granted, else why not.
// Asked once per process.
const std::string& amx_permission_refusal() {
  static const std::string refusal = [] {
    if (!cpu().os_tile_state) return std::string("the OS does not enable the tile state (XCR0)");
#if defined(__linux__) && defined(__x86_64__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
      const int error = errno;
      return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") + std::strerror(error) +
             " (errno " + std::to_string(error) + ")";
    }
#endif
    return std::string();
  }();
  return refusal;
}

// ---------------------------------------------------------------------------- the choices

// This architecture's levels, in ascending order of capability.
#if defined(__aarch64__)
constexpr const char* kArchitecture = "aarch64";
constexpr IsaLevel kLevels[] = {IsaLevel::kPortable, IsaLevel::kNeon, IsaLevel::kDotprod, IsaLevel::kI8mm,
                                IsaLevel::kBf16};
#elif defined(MOE_ONNX_X86)
constexpr const char* kArchitecture = "x86-64";
constexpr IsaLevel kLevels[] = {IsaLevel::kPortable, IsaLevel::kAvx2, IsaLevel::kAvx512, IsaLevel::kAmx};
#else
constexpr const char* kArchitecture = "this architecture";
constexpr IsaLevel kLevels[] = {IsaLevel::kPortable};
#endif
constexpr IsaLevel kAllLevels[] = {IsaLevel::kPortable, IsaLevel::kAvx2,    IsaLevel::kAvx512, IsaLevel::kAmx,
                                   IsaLevel::kNeon,     IsaLevel::kDotprod, IsaLevel::kI8mm,   IsaLevel::kBf16};

// A level's place in kLevels, -1 for another architecture's.
int rank(IsaLevel level) {
  for (size_t i = 0; i < sizeof kLevels / sizeof kLevels[0]; ++i)
    if (kLevels[i] == level) return static_cast<int>(i);
  return -1;
}

// Whether `level` includes `floor` (false where floor is another architecture's level).
bool at_least(IsaLevel level, IsaLevel floor) { return rank(floor) >= 0 && rank(level) >= rank(floor); }

// "'portable', 'neon', ...": this architecture's levels.
std::string level_names() {
  std::string names;
  for (IsaLevel level : kLevels) names += std::string(names.empty() ? "'" : ", '") + isa_name(level) + "'";
  return names;
}

// MOE_ONNX_GEMM's level, if set.
std::optional<IsaLevel> requested_level() {
  const char* force = std::getenv("MOE_ONNX_GEMM");
  if (force == nullptr || *force == '\0') return std::nullopt;
  for (IsaLevel level : kAllLevels) {
    if (std::strcmp(force, isa_name(level)) != 0) continue;
    if (rank(level) >= 0) return level;
    throw std::invalid_argument(std::string("MOE_ONNX_GEMM='") + force + "' is a level of another architecture; " +
                                kArchitecture + "'s levels are " + level_names());
  }
  throw std::invalid_argument(std::string("MOE_ONNX_GEMM='") + force + "' is not a level; expected one of " +
                              level_names());
}

enum class AmxMode { kHardware, kModel, kOff };

AmxMode amx_mode() {
  const char* mode = std::getenv("MOE_ONNX_AMX");
  if (mode == nullptr || *mode == '\0') return AmxMode::kHardware;
  if (std::strcmp(mode, "model") == 0) return AmxMode::kModel;
  if (std::strcmp(mode, "off") == 0) return AmxMode::kOff;
  throw std::invalid_argument(std::string("MOE_ONNX_AMX='") + mode +
                              "' is not a mode; expected 'model' (the AMX kernels on the scalar model of the tile "
                              "instructions) or 'off' (unset: the hardware where it is usable)");
}

// The highest SIMD level (x86: below amx) that the CPU and this build support.
IsaLevel simd_level() {
  IsaLevel level = IsaLevel::kPortable;
#if defined(MOE_ONNX_HAVE_AVX2)
  if (cpu().avx2) level = IsaLevel::kAvx2;
#endif
#if defined(MOE_ONNX_HAVE_AVX512)
  if (level == IsaLevel::kAvx2 && cpu().avx512) level = IsaLevel::kAvx512;
#endif
#if defined(MOE_ONNX_HAVE_NEON)
  if (cpu().neon) level = IsaLevel::kNeon;
#endif
#if defined(MOE_ONNX_HAVE_DOTPROD)
  if (level == IsaLevel::kNeon && cpu().dotprod) level = IsaLevel::kDotprod;
#endif
#if defined(MOE_ONNX_HAVE_I8MM)
  if (level == IsaLevel::kDotprod && cpu().i8mm) level = IsaLevel::kI8mm;
#endif
#if defined(MOE_ONNX_HAVE_ARM_BF16)
  if (level == IsaLevel::kI8mm && cpu().bf16) level = IsaLevel::kBf16;
#endif
  return level;
}

// Sets t.amx and t.amx_reason; true when the AMX hardware is usable (the permission asked only then).
bool decide_amx(KernelTable& t, AmxMode mode, std::optional<IsaLevel> requested, IsaLevel simd) {
  auto set = [&t](AmxState state, std::string reason) {
    t.amx = state;
    t.amx_reason = std::move(reason);
    return state == AmxState::kUsable;
  };
  if (mode == AmxMode::kModel) return set(AmxState::kModelled, "MOE_ONNX_AMX=model: the scalar model of the tiles");
  if (!cpu().amx_tile || !cpu().avx512) return set(AmxState::kNotInCpu, "this CPU has no AMX");
#if defined(MOE_ONNX_HAVE_AMX)
  const bool built = simd == IsaLevel::kAvx512;  // the tile kernels sit on top of AVX-512
#else
  const bool built = false;
#endif
  if (!built) return set(AmxState::kNotInBuild, "this build has no AMX kernels (its compiler took no AMX flags)");
  if (mode == AmxMode::kOff) return set(AmxState::kOff, "MOE_ONNX_AMX=off");
  if (requested && !at_least(*requested, IsaLevel::kAmx))
    return set(AmxState::kCapped, std::string("MOE_ONNX_GEMM=") + isa_name(*requested));
  const std::string& refusal = amx_permission_refusal();
  if (!refusal.empty()) return set(AmxState::kRefused, "refused by the OS: " + refusal);
  return set(AmxState::kUsable, "the hardware");
}

// ---------------------------------------------------------------------------- the kernels of each level

void fill_portable(KernelTable& t) {
  t.gemm_panels = {detail::gemm_panels_portable, "portable"};
  t.widen_row = {detail::widen_row_portable, "portable"};
  t.narrow_row = {detail::narrow_row_portable, "portable"};
  t.transpose_tile = {detail::transpose_tile_portable, "portable"};
  t.quant_code_groups = {detail::quant_code_groups_portable, "portable"};
  t.int8_gemm = {Int8Layout::kPairs, detail::widen_int8_rows_portable, detail::int8_gemm_pairs_portable, "portable", {}};
  t.quant_decode = {detail::quant_decode_portable, "portable"};
  t.quant_activations = {detail::quant_activations_portable, "portable"};
  t.quant_dots = {detail::quant_dots_portable, "portable"};
  t.quant_tile_steps = {detail::quant_code_rows_portable, detail::quant_add_dots_portable, "portable"};
  t.gated_activation = {detail::gated_activation_portable, "portable"};
  t.pointwise_activation = {detail::pointwise_activation_portable, "portable"};
}

void fill_avx2(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_AVX2)
  t.gemm_panels = {detail::gemm_panels_avx2, "avx2"};
  t.widen_row = {detail::widen_row_avx2, "avx2"};
  t.quant_code_groups = {detail::quant_code_groups_avx2, "avx2"};
  t.int8_gemm = {Int8Layout::kPairs, detail::widen_int8_rows_avx2, detail::int8_gemm_pairs_avx2, "avx2", {}};
  t.quant_fused = {detail::quant_fused_avx2, "avx2"};
  t.quant_decode = {detail::quant_decode_avx2, "avx2"};
  t.gated_activation = {detail::gated_activation_avx2, "avx2"};
  t.pointwise_activation = {detail::pointwise_activation_avx2, "avx2"};
#endif
}

void fill_avx512(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_AVX512)
  t.gemm_panels = {detail::gemm_panels_avx512, "avx512"};
  t.widen_row = {detail::widen_row_avx512, "avx512"};
  t.narrow_row = {detail::narrow_row_avx512, "avx512"};
  t.transpose_tile = {detail::transpose_tile_avx512, "avx512"};
  t.quant_code_groups = {detail::quant_code_groups_avx512, "avx512"};
  t.quant_fused = {detail::quant_fused_avx512, "avx512"};
  t.quant_decode = {detail::quant_decode_avx512, "avx512"};
  t.quant_activations = {detail::quant_activations_avx512, "avx512"};
  t.quant_tile_steps = {detail::quant_code_rows_avx512, detail::quant_add_dots_avx512, "avx512"};
  t.gated_activation = {detail::gated_activation_avx512, "avx512"};
  t.pointwise_activation = {detail::pointwise_activation_avx512, "avx512"};
#endif
#if defined(MOE_ONNX_HAVE_AVX512_VNNI)
  if (t.avx512_vnni) {
    t.int8_gemm = {Int8Layout::kQuads, detail::bias_int8_rows_vnni, detail::int8_gemm_quads_vnni, "avx512-vnni",
                   {}};
    t.quant_dots = {detail::quant_dots_vnni, "avx512-vnni"};
  }
#endif
}

// aarch64's levels (kernels/arm64/): Advanced SIMD's kernels, the int8 GEMM on the octet layout
// (int8_gemm.h) with the best of SMULL/SADALP, SDOT and SMMLA the level has, level 4's dots on SDOT, and
// the bf16 GEMM on BFDOT (fewer than kBf16TileRows rows) and BFMMLA.
void fill_neon(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_NEON)
  t.gemm_panels = {detail::gemm_panels_neon, "neon"};
  t.widen_row = {detail::widen_row_neon, "neon"};
  t.narrow_row = {detail::narrow_row_neon, "neon"};
  t.gated_activation = {detail::gated_activation_neon, "neon"};
  t.pointwise_activation = {detail::pointwise_activation_neon, "neon"};
  t.quant_fused = {detail::quant_fused_neon, "neon"};
  t.quant_decode = {detail::quant_decode_neon, "neon"};
  t.int8_gemm = {Int8Layout::kOctets, detail::copy_int8_rows_portable, detail::int8_gemm_octets_neon, "neon", {}};
#endif
}

void fill_dotprod(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_DOTPROD)
  t.int8_gemm = {Int8Layout::kOctets, detail::copy_int8_rows_portable, detail::int8_gemm_octets_dotprod, "dotprod",
                 {}};
  t.quant_dots = {detail::quant_dots_dotprod, "dotprod"};
#endif
}

void fill_i8mm(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_I8MM)
  t.int8_gemm = {Int8Layout::kOctets, detail::copy_int8_rows_portable, detail::int8_gemm_octets_i8mm, "i8mm", {}};
#endif
}

void fill_arm_bf16(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_ARM_BF16)
  t.bf16_gemm = {detail::bf16_gemm_bfdot, "bfdot"};
  t.bf16_gemm_tiles = {detail::bf16_gemm_bfmmla, "bfmmla"};
#endif
}

// The bf16 GEMM's slots (bf16_gemm.h): vdpbf16ps where the table has AVX512-BF16; AMX-BF16's tiles
// (the hardware, or the model) with, below their rows, vdpbf16ps or, without it, its arithmetic in
// portable code. Neither: no bf16 GEMM, and accuracy_level 3 runs level 0's kernels.
void fill_bf16(KernelTable& t) {
#if defined(MOE_ONNX_HAVE_AVX512_BF16)
  if (t.avx512_bf16) t.bf16_gemm = {detail::bf16_gemm_avx512bf16, "avx512-bf16"};
#endif
  if (!t.amx_bf16) return;
  if (t.amx == AmxState::kModelled) {
    t.bf16_gemm_tiles = {detail::bf16_gemm_amx_model, "amx-model"};
  } else {
#if defined(MOE_ONNX_HAVE_AMX)
    t.bf16_gemm_tiles = {detail::bf16_gemm_amx, "amx"};
#endif
  }
  if (!t.bf16_gemm) t.bf16_gemm = {detail::bf16_gemm_portable, "portable"};
}

// AMX's kernels, over the slots below them: on the hardware where `amx` is usable, on the model where
// it is modelled (on any level: the quad rows' portable preparation where VNNI is not in the table,
// whose tiles then take every call).
void fill_amx(KernelTable& t) {
  if (t.amx_int8) {
    Slot<detail::Int8GemmFn> int8_tiles{detail::int8_gemm_quads_amx_model, "amx-model"};
#if defined(MOE_ONNX_HAVE_AMX)
    if (t.amx == AmxState::kUsable) int8_tiles = {detail::int8_gemm_quads_amx, "amx"};
#endif
    if (t.int8_gemm.layout != Int8Layout::kQuads)
      t.int8_gemm = {Int8Layout::kQuads, detail::bias_int8_rows_portable, int8_tiles.fn, int8_tiles.name, {}};
    t.int8_gemm.tiles = int8_tiles;
    t.quant_tiles = {detail::quant_dots_amx_model, "amx-model"};
#if defined(MOE_ONNX_HAVE_AMX)
    if (t.amx == AmxState::kUsable) t.quant_tiles = {detail::quant_dots_amx, "amx"};
#endif
  }
}

KernelTable fill() {
  const AmxMode mode = amx_mode();
  const std::optional<IsaLevel> requested = requested_level();
  KernelTable t;
  const IsaLevel available = decide_amx(t, mode, requested, simd_level()) ? IsaLevel::kAmx : simd_level();
  if (requested && !at_least(available, *requested)) {
    std::string message = std::string("MOE_ONNX_GEMM=") + isa_name(*requested) +
                          ": this CPU (or this build of the library) supports up to '" + isa_name(available) + "'";
    if (*requested == IsaLevel::kAmx) message += " (AMX: " + t.amx_reason + ")";
    throw std::invalid_argument(message);
  }
  t.level = requested.value_or(available);
  t.avx512_vnni = at_least(t.level, IsaLevel::kAvx512) && cpu().avx512_vnni;
  t.avx512_bf16 = at_least(t.level, IsaLevel::kAvx512) && cpu().avx512_bf16;
  t.amx_int8 = t.amx == AmxState::kModelled || (t.amx == AmxState::kUsable && cpu().amx_int8);
  t.amx_bf16 = t.amx == AmxState::kModelled || (t.amx == AmxState::kUsable && cpu().amx_bf16);

  fill_portable(t);
  if (at_least(t.level, IsaLevel::kAvx2)) fill_avx2(t);
  if (at_least(t.level, IsaLevel::kAvx512)) fill_avx512(t);
  if (at_least(t.level, IsaLevel::kNeon)) fill_neon(t);
  if (at_least(t.level, IsaLevel::kDotprod)) fill_dotprod(t);
  if (at_least(t.level, IsaLevel::kI8mm)) fill_i8mm(t);
  if (at_least(t.level, IsaLevel::kBf16)) fill_arm_bf16(t);
  fill_bf16(t);
  if (t.amx == AmxState::kUsable || t.amx == AmxState::kModelled) fill_amx(t);
  return t;
}

const char* yes_no(bool value) { return value ? "yes" : "no"; }

}  // namespace

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::kPortable: return "portable";
    case IsaLevel::kAvx2: return "avx2";
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAmx: return "amx";
    case IsaLevel::kNeon: return "neon";
    case IsaLevel::kDotprod: return "dotprod";
    case IsaLevel::kI8mm: return "i8mm";
    case IsaLevel::kBf16: return "bf16";
  }
  return "unknown";
}

const char* amx_state_name(AmxState state) {
  switch (state) {
    case AmxState::kUsable: return "usable";
    case AmxState::kModelled: return "modelled";
    case AmxState::kOff: return "off";
    case AmxState::kCapped: return "capped";
    case AmxState::kNotInCpu: return "not-in-cpu";
    case AmxState::kNotInBuild: return "not-in-build";
    case AmxState::kRefused: return "refused";
  }
  return "unknown";
}

std::string KernelTable::report() const {
  std::string out;
  auto add = [&out](const char* key, const std::string& value) {
    out += out.empty() ? "" : ";";
    out += key;
    out += "=";
    out += value;
  };
  add("level", isa_name(level));
  add("gemm_panels", gemm_panels.name);
  add("widen_row", widen_row.name);
  add("narrow_row", narrow_row.name);
  add("transpose_tile", transpose_tile.name);
  add("quant_code_groups", quant_code_groups.name);
  add("int8_gemm", int8_gemm.name);
  add("int8_layout", int8_layout_name(int8_gemm.layout));
  add("int8_gemm_tiles", int8_gemm.tiles.name);
  add("int8_tile_rows", std::to_string(kInt8TileRows));
  add("quant_fused", quant_fused.name);
  add("quant_decode", quant_decode.name);
  add("quant_activations", quant_activations.name);
  add("quant_dots", quant_dots.name);
  add("quant_tiles", quant_tiles.name);
  add("quant_tile_steps", quant_tile_steps.name);
  add("quant_tile_rows", std::to_string(kQuantTileRows));
  add("quant_tile_block", std::to_string(kQuantTileBlock));
  add("gated_activation", gated_activation.name);
  add("pointwise_activation", pointwise_activation.name);
  add("bf16_gemm", bf16_gemm.name);
  add("bf16_gemm_tiles", bf16_gemm_tiles.name);
  add("avx512_vnni", yes_no(avx512_vnni));
  add("avx512_bf16", yes_no(avx512_bf16));
  add("amx_int8", yes_no(amx_int8));
  add("amx_bf16", yes_no(amx_bf16));
  add("amx", amx_state_name(amx));
  add("amx_reason", amx_reason);
  return out;
}

const KernelTable& kernels() {
  static const KernelTable table = fill();  // a throw leaves it unfilled: the next call reports again
  return table;
}

}  // namespace moe_onnx
