#!/usr/bin/env bash
# The aarch64 kernels built and tested on an x86-64 machine (docs/building.md, "aarch64"): cross-compiles
# the libraries and the test programs into build/arm64 (cmake/aarch64-linux-gnu.cmake; the tools:
# scripts/install_arm64_tools.sh) and runs them under qemu-aarch64-static:
#   kernels   moe_onnx_kernel_check at every aarch64 level: on a plain NEON CPU (-cpu cortex-a57), one with
#             dotprod (neoverse-n1), and one with dotprod, i8mm and bf16 (max) at each MOE_ONNX_GEMM cap; each
#             run must report the level and kernels named here, and every kernel must pass its check
#   sessions  tests/arm64_sessions.py: fused models in sessions of onnxruntime's aarch64 library (from its
#             PyPI wheel, kept in build/arm64/onnxruntime) at each level, against this machine's outputs
# Usage: custom_ops/arm64.sh [kernels|sessions]...   (default: both). CI runs it after the test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/arm64
python=${PYTHON:-python}
sysroot=${MOE_ONNX_ARM64_SYSROOT:-/usr/aarch64-linux-gnu}
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(kernels sessions)

for tool in aarch64-linux-gnu-g++ qemu-aarch64-static cmake; do
    if ! command -v "$tool" >/dev/null; then
        echo "arm64.sh: $tool not found; run scripts/install_arm64_tools.sh" >&2
        exit 1
    fi
done

# The onnxruntime headers of this machine's build, where it fetched them (else CMake fetches them again); once
# configured, the build folder's cache keeps its own (another choice would rebuild everything).
ort_include=()
if [[ ! -f $build/CMakeCache.txt ]]; then
    header=$(find "$root/build" -path "$build" -prune -o -name onnxruntime_cxx_api.h -print 2>/dev/null | sort | head -n 1)
    [[ -n $header ]] && ort_include=(-DMOE_ONNX_ORT_INCLUDE_DIR="$(dirname "$header")")
fi

start=$SECONDS
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root/custom_ops" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_TOOLCHAIN_FILE="$root/custom_ops/cmake/aarch64-linux-gnu.cmake" -DMOE_ONNX_ARM64_SYSROOT="$sysroot" \
      -DMOE_ONNX_PYTHON_HOST=OFF -DMOE_ONNX_MPI=OFF -DMOE_ONNX_TEST_PROGRAMS=ON "${ort_include[@]}" >/dev/null
cmake --build "$build" --parallel
echo "arm64.sh: cross build took $((SECONDS - start)) s"

aarch64() {  # aarch64() CPU COMMAND...: runs an aarch64 program under qemu on that CPU model
    local cpu=$1
    shift
    qemu-aarch64-static -L "$sysroot" -cpu "$cpu" "$@"
}

kernels() {
    local start=$SECONDS
    # CPU model | MOE_ONNX_GEMM | MOE_ONNX_AMX | what the kernel report must say
    local runs=(
        "cortex-a57|||level=neon,gemm_panels=neon,int8_gemm=neon,int8_layout=octets,quant_dots=portable,bf16_gemm=none"
        "neoverse-n1|||level=dotprod,int8_gemm=dotprod,quant_dots=dotprod,bf16_gemm=none"
        "max|||level=bf16,int8_gemm=i8mm,quant_dots=dotprod,bf16_gemm=bfdot,bf16_gemm_tiles=bfmmla"
        "max|i8mm||level=i8mm,int8_gemm=i8mm,bf16_gemm=none"
        "max|dotprod||level=dotprod,int8_gemm=dotprod"
        "max|neon||level=neon,int8_gemm=neon,widen_row=neon"
        "max|portable||level=portable,gemm_panels=portable,int8_gemm=portable,int8_layout=pairs"
        "cortex-a57||model|level=neon,amx=modelled,int8_gemm_tiles=amx-model,bf16_gemm=portable,bf16_gemm_tiles=amx-model"
    )
    local run cpu gemm amx expect
    for run in "${runs[@]}"; do
        IFS='|' read -r cpu gemm amx expect <<<"$run"
        echo "== -cpu $cpu MOE_ONNX_GEMM=$gemm MOE_ONNX_AMX=$amx"
        env -u MOE_ONNX_GEMM -u MOE_ONNX_AMX ${gemm:+MOE_ONNX_GEMM=$gemm} ${amx:+MOE_ONNX_AMX=$amx} \
            qemu-aarch64-static -L "$sysroot" -cpu "$cpu" "$build/moe_onnx_kernel_check" --expect "$expect"
    done
    # A level this CPU lacks, and another architecture's, are refused in the table's words.
    local refusal
    refusal=$(MOE_ONNX_GEMM=i8mm aarch64 neoverse-n1 "$build/moe_onnx_kernel_check" || true)
    grep -q "MOE_ONNX_GEMM=i8mm: this CPU (or this build of the library) supports up to 'dotprod'" <<<"$refusal" ||
        { echo "arm64.sh: MOE_ONNX_GEMM=i8mm on neoverse-n1 was not refused as expected: $refusal" >&2; exit 1; }
    refusal=$(MOE_ONNX_GEMM=avx512 aarch64 max "$build/moe_onnx_kernel_check" || true)
    grep -q "MOE_ONNX_GEMM='avx512' is a level of another architecture; aarch64's levels are 'portable', 'neon'" \
        <<<"$refusal" || { echo "arm64.sh: MOE_ONNX_GEMM=avx512 was not refused as expected: $refusal" >&2; exit 1; }
    echo "arm64.sh: kernel checks took $((SECONDS - start)) s"
}

sessions() {
    local start=$SECONDS
    "$python" "$root/tests/arm64_sessions.py" --build "$build" --sysroot "$sysroot"
    echo "arm64.sh: sessions took $((SECONDS - start)) s"
}

for step in "${steps[@]}"; do
    case $step in
        kernels) kernels ;;
        sessions) sessions ;;
        *) echo "arm64.sh: unknown step '$step' (kernels, sessions)" >&2; exit 2 ;;
    esac
done
