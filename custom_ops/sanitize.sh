#!/usr/bin/env bash
# Builds the custom-op libraries with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/sanitize and runs the kernel, packing and packed-file tests and the fuzzer (tests/test_fuzz.py)
# against them (python is not instrumented: libasan is preloaded). Any finding fails the run. Usage:
# custom_ops/sanitize.sh [pytest args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/sanitize
python=${PYTHON:-python}

# libmoe_onnx_mpi is built and sanitized too: a fuzzed node of several ranks starts MPI in this one
# process (a world of one rank) and must refuse in the reference's words. tests/test_comm_mpi.py runs
# it under mpirun (not here).
cmake -S "$root/custom_ops" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMOE_ONNX_SANITIZE=address,undefined -DPython_EXECUTABLE="$(command -v "$python")" >/dev/null
cmake --build "$build"

export MOE_ONNX_CUSTOM_OPS_LIBRARY=$build/libmoe_onnx_ops.so
export MOE_ONNX_PYTHON_HOST_LIBRARY=$build/libmoe_onnx_python_host.so
LD_PRELOAD="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libubsan.so)"
export LD_PRELOAD
# Leaks of the Python interpreter itself are not ours; everything else stops the run.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cd "$root"
# The packing and packed-weights-file tests too (they read damaged files and write panels with the ISA
# slots), but not those that bound resident memory: ASan's shadow pages are resident as well, and its allocator
# keeps freed memory.
"$python" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_runtime.py tests/test_amx_tiles.py \
  tests/test_fuzz.py tests/test_packing.py tests/test_packed_file.py \
  -k "not resident_once and not held_as_the_files_pages and not larger_than_memory and not do_not_grow_memory" "$@"
